"""A request parser against the OpenAPI schema of its body: shared by the tests of every
route's parser (Heron's, OpenAI's, Cohere's, TEI's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemathesis.core import NotSet

from heron_sdk.errors import HeronError


def parser_agrees_with_schema(body: Any, parse: Callable[[Any], object],
                              valid: Callable[[Any], bool]) -> HeronError | None:
    """The parser takes ``body`` exactly when the schema allows it, and refuses it with a 4xx
    otherwise; the refusal, if any. Values that are not JSON are the body codec's (400), not
    the parser's."""
    if isinstance(body, NotSet | bytes | bytearray) or not isinstance(
            body, dict | list | str | int | float | None):
        return None
    try:
        parse(body)
        refused = None
    except HeronError as exc:
        refused = exc
    if valid(body):
        assert refused is None, f"the schema allows {body!r}; the parser says {refused}"
    else:
        assert refused is not None, f"the schema refuses {body!r}; the parser took it"
        assert 400 <= refused.status < 500, refused
    return refused
