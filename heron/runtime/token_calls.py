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
    MAX_ITEMS_PER_REQUEST,
    Item,
    RequestOptions,
    check_fields,
    check_text,
    check_token_ids,
    optional_field,
    require_object,
)

TOKENIZE_FIELDS = frozenset({"items", "add_special_tokens", "input_type", "priority",
                             "timeout_s"})
DECODE_FIELDS = frozenset({"items", "skip_special_tokens", "priority", "timeout_s"})


def _count(values: list[Any], name: str) -> None:
    if not values:
        raise invalid_field(name, "must not be empty")
    if len(values) > MAX_ITEMS_PER_REQUEST:
        raise HeronError(ErrorCode.TOO_MANY_ITEMS, f"{name}: {len(values)} items is over the "
                         f"limit of {MAX_ITEMS_PER_REQUEST}", field=name)


def _options(body: Mapping[str, Any]) -> RequestOptions:
    return RequestOptions.from_wire({k: body[k] for k in ("priority", "timeout_s")
                                     if k in body})


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
        body = require_object(body)
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
        return cls(items, optional_field(body, "add_special_tokens", bool, True), input_type,
                   _options(body))

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
        body = require_object(body)
        check_fields(body, DECODE_FIELDS)
        raw = body.get("items")
        if not isinstance(raw, list):
            raise invalid_field("items", "is required and must be a list of token id lists")
        _count(raw, "items")
        sequences = [check_token_ids(ids, f"items[{i}]") for i, ids in enumerate(raw)]
        return cls(sequences, optional_field(body, "skip_special_tokens", bool, True),
                   _options(body))

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
