"""OpenAI-compatible `POST /v1/embeddings` bodies: parsing and answers (worker and gateway).

The body takes OpenAI's own fields (``EMBEDDINGS_FIELDS``); ``user`` is read and not used.
Any other field is a 422 naming it, as on Heron's own routes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import (
    MAX_INTEGER,
    MAX_ITEMS_PER_REQUEST,
    check_fields,
    check_finite,
    check_text,
    integral,
)
from heron_sdk.wire import array_to_base64

# Every field of OpenAI's embeddings request (platform.openai.com/docs/api-reference/embeddings).
EMBEDDINGS_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})


def parse_embeddings_request(body: Any) -> tuple[str, list[str], str, int | None]:
    """(model, texts, encoding_format, dimensions) from an OpenAI embeddings body."""
    if not isinstance(body, Mapping):
        raise HeronError(ErrorCode.MALFORMED_BODY, "body must be an object")
    check_fields(body, EMBEDDINGS_FIELDS)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_field("user", "must be a string")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_field("model", "is required and must be a string")
    raw = body.get("input")
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        texts = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(t, int | list) for t in raw):
        raise invalid_field("input", "token-id input is not supported; send strings")
    elif raw is None:
        raise invalid_field("input", "is required")
    else:
        raise invalid_field("input", "must be a string or a non-empty list of strings")
    for i, text in enumerate(texts):
        check_text(text, f"input[{i}]")
    if len(texts) > MAX_ITEMS_PER_REQUEST:
        raise HeronError(ErrorCode.TOO_MANY_ITEMS,
                         f"input: {len(texts)} items is over the limit of "
                         f"{MAX_ITEMS_PER_REQUEST}", field="input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding  # "" and false are errors, too
    if encoding not in ("float", "base64"):
        raise invalid_field("encoding_format", "must be 'float' or 'base64'")
    check_finite(body.get("dimensions"), "dimensions")
    dims = integral(body.get("dimensions"))
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                             or not 0 < dims <= MAX_INTEGER):
        raise invalid_field("dimensions", f"must be an integer from 1 to {MAX_INTEGER}")
    return model, texts, encoding, dims


def embeddings_response(model: str, vectors: list, tokens: int, encoding: str) -> dict:
    data = [{"object": "embedding", "index": i,
             "embedding": array_to_base64(v) if encoding == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
