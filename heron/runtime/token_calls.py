"""The tokenizer calls of the backend contract (heron.runtime.backend): ``tokenize`` (texts
-> the model's tokens, with their offsets) and ``decode`` (token ids -> text), as the TEI
routes /tokenize and /decode need them.

Each request is a dataclass with ``from_wire``/``to_wire``: the gateway sends it to a worker
of the model's pool as a work item of task ``tokenize`` or ``decode`` (the body's ``items``
are sliced like any request's), and the worker answers per item. Answers, per item:

- tokenize: ``{"tokens": [{"id", "text", "special", "start", "stop"}, ...]}``, ``start`` and
  ``stop`` byte offsets into the text as the model saw it (its prompt first), None for a
  special token (TEI's SimpleToken);
- decode: ``{"text": "..."}``;

in a body ``{"model", "items", "usage": {"tokens"}}`` like encode's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import (
    INPUT_TYPES,
    MAX_INTEGER,
    MAX_ITEMS_PER_REQUEST,
    MAX_TEXT_CHARS,
    Item,
    RequestOptions,
    check_fields,
    check_text,
    integral,
)

TOKENIZE_FIELDS = frozenset({"items", "add_special_tokens", "input_type", "priority",
                             "timeout_s"})
DECODE_FIELDS = frozenset({"items", "skip_special_tokens", "priority", "timeout_s"})


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise HeronError(ErrorCode.MALFORMED_BODY, "body must be an object")
    return body


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_field(name, "must be a boolean")
    return value


def _count(values: list[Any], name: str) -> None:
    if not values:
        raise invalid_field(name, "must not be empty")
    if len(values) > MAX_ITEMS_PER_REQUEST:
        raise HeronError(ErrorCode.TOO_MANY_ITEMS, f"{name}: {len(values)} items is over the "
                         f"limit of {MAX_ITEMS_PER_REQUEST}", field=name)


def _options(body: Mapping[str, Any]) -> RequestOptions:
    return RequestOptions.from_wire({k: body[k] for k in ("priority", "timeout_s")
                                     if k in body})


def token_ids(value: Any, name: str) -> tuple[int, ...]:
    """A non-empty list of token ids, integers from 0 to MAX_INTEGER (the worker checks them
    against the model's vocabulary), at most MAX_TEXT_CHARS of them."""
    if not isinstance(value, list) or not value:
        raise invalid_field(name, "must be a non-empty list of token ids")
    if len(value) > MAX_TEXT_CHARS:
        raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"{name}: {len(value)} token ids is over {MAX_TEXT_CHARS}", field=name)
    out = []
    for i, raw in enumerate(value):
        token = integral(raw)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_INTEGER:
            raise invalid_field(f"{name}[{i}]", f"must be a token id (an integer from 0 to "
                                f"{MAX_INTEGER})")
        out.append(token)
    return tuple(out)


@dataclass(slots=True)
class TokenizeRequest:
    """Texts to tokenize as the model does for encode: after the prompt of ``input_type``'s
    side (None: the document side, encode's default), with or without special tokens, never
    truncated."""

    items: list[Item]
    add_special_tokens: bool = True
    input_type: str | None = None  # a heron_sdk.types.INPUT_TYPES key
    options: RequestOptions = field(default_factory=RequestOptions)

    @classmethod
    def from_wire(cls, body: Any) -> TokenizeRequest:
        body = _object(body)
        check_fields(body, TOKENIZE_FIELDS)
        raw = body.get("items")
        if not isinstance(raw, list):
            raise invalid_field("items", "is required and must be a list of strings")
        _count(raw, "items")
        items = []
        for i, text in enumerate(raw):
            if not isinstance(text, str):
                raise invalid_field(f"items[{i}]", "must be a string")
            items.append(Item(check_text(text, f"items[{i}]")))
        input_type = body.get("input_type")
        if input_type is not None and (not isinstance(input_type, str)
                                       or input_type not in INPUT_TYPES):
            raise invalid_field("input_type", f"must be one of {list(INPUT_TYPES)}")
        return cls(items, _flag(body, "add_special_tokens", True), input_type, _options(body))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"items": [i.text for i in self.items],
                               "add_special_tokens": self.add_special_tokens,
                               "priority": self.options.priority}
        if self.input_type is not None:
            out["input_type"] = self.input_type
        if self.options.timeout_s is not None:
            out["timeout_s"] = self.options.timeout_s
        return out


@dataclass(slots=True)
class DecodeRequest:
    """Sequences of token ids to turn back into text."""

    sequences: list[tuple[int, ...]]
    skip_special_tokens: bool = True
    options: RequestOptions = field(default_factory=RequestOptions)

    @classmethod
    def from_wire(cls, body: Any) -> DecodeRequest:
        body = _object(body)
        check_fields(body, DECODE_FIELDS)
        raw = body.get("items")
        if not isinstance(raw, list):
            raise invalid_field("items", "is required and must be a list of token id lists")
        _count(raw, "items")
        sequences = [token_ids(ids, f"items[{i}]") for i, ids in enumerate(raw)]
        return cls(sequences, _flag(body, "skip_special_tokens", True), _options(body))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"items": [list(ids) for ids in self.sequences],
                               "skip_special_tokens": self.skip_special_tokens,
                               "priority": self.options.priority}
        if self.options.timeout_s is not None:
            out["timeout_s"] = self.options.timeout_s
        return out

    def size_items(self) -> list[Item]:
        """Stand-ins with the sequences' sizes, for the gateway's work-item slicing (which
        estimates tokens and bytes from texts): about 6 characters an id, what an id costs
        in the message at most (msgpack int32: 5 bytes) rounded up."""
        return [Item("0" * (6 * len(ids))) for ids in self.sequences]
