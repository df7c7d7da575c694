"""encode's ``chunking`` option: long texts split into chunks, each chunk embedded.

``{"chunking": {"max_tokens", "overlap", "strategy", "pool"}}`` on an encode request asks the
server to split each text with the model's own tokenizer and to answer, per item, its
``chunks`` (character offsets, outputs, tokens) and, with ``pool: "mean"``, one pooled
``dense`` vector. This module holds the option's type and what can be checked without the
model: ``parse_chunking`` (each field, as the OpenAPI schema says; EncodeRequest.from_wire
calls it) and ``check_chunking`` (what the option needs of the rest of the request; the
gateway and the worker call it). The split itself, and the checks that need the model (its
token limit), are the worker's (heron.worker.chunking, heron.worker.chunked_encode).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from heron_sdk.errors import invalid_field
from heron_sdk.types import Item, check_fields, optional_field, shown

CHUNKING_FIELDS = frozenset({"max_tokens", "overlap", "strategy", "pool"})
# "tokens": windows of max_tokens tokens; "sentences": whole sentences packed up to
# max_tokens (a sentence longer than that is split by tokens).
CHUNK_STRATEGIES = ("tokens", "sentences")
CHUNK_POOLS = ("mean",)


@dataclass(frozen=True, slots=True)
class ChunkingOptions:
    """How encode splits each text. ``max_tokens`` None: as many as the model takes with its
    special tokens and prompt (the worker knows it); ``pool`` "mean": each item also answers
    the mean of its chunks' dense vectors (normalized when the model normalizes)."""

    max_tokens: int | None = None
    overlap: int = 0  # tokens each chunk shares with the one before it
    strategy: str = "tokens"
    pool: str | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"overlap": self.overlap, "strategy": self.strategy}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.pool is not None:
            out["pool"] = self.pool
        return out

    @classmethod
    def of(cls, value: ChunkingOptions | Mapping[str, Any] | bool | None
           ) -> ChunkingOptions | None:
        """The SDK's ``chunking=`` argument: options, their wire dict, True (the defaults) or
        None/False (no chunking); a dict is checked as a server would check it."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, ChunkingOptions):
            return value
        return parse_chunking(dict(value))


def parse_chunking(raw: Any) -> ChunkingOptions | None:
    """The ``chunking`` field of an encode body (None when absent or null): each field on
    its own, as the OpenAPI schema says (422 INVALID_FIELD naming ``chunking.<field>``).
    What depends on other fields is ``check_chunking``'s."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise invalid_field("chunking", "must be an object {max_tokens, overlap, strategy, "
                                        "pool}")
    check_fields(raw, CHUNKING_FIELDS, "chunking")
    # The keys renamed to their paths, so that the shared field readers name them so.
    body = {f"chunking.{key}": value for key, value in raw.items()}
    max_tokens = optional_field(body, "chunking.max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise invalid_field("chunking.max_tokens", "must be a positive integer")
    overlap = optional_field(body, "chunking.overlap", int, 0)
    if overlap < 0:
        raise invalid_field("chunking.overlap", "must be >= 0")
    strategy = optional_field(body, "chunking.strategy", str, "tokens")
    if strategy not in CHUNK_STRATEGIES:
        raise invalid_field("chunking.strategy", f"{shown(strategy)} is not one of "
                                                 f"{list(CHUNK_STRATEGIES)}")
    pool = optional_field(body, "chunking.pool", str, None)
    if pool is not None and pool not in CHUNK_POOLS:
        raise invalid_field("chunking.pool", f"{shown(pool)} is not one of "
                                             f"{list(CHUNK_POOLS)} (or null)")
    return ChunkingOptions(max_tokens, overlap, strategy, pool)


def check_chunking(options: ChunkingOptions | None, items: Sequence[Item],
                   output_types: Sequence[str]) -> None:
    """What ``chunking`` needs of the rest of the request (no model needed: the gateway
    refuses these before a queue, the worker again): overlap under max_tokens, dense
    output to pool, and texts to cut (an item given as token ids or an image is named).
    422 INVALID_FIELD."""
    if options is None:
        return
    if options.max_tokens is not None and options.overlap >= options.max_tokens:
        raise invalid_field("chunking.overlap", f"must be less than max_tokens "
                                                f"({options.max_tokens}), got {options.overlap}")
    if options.pool is not None and "dense" not in output_types:
        raise invalid_field("chunking.pool", "pools dense vectors: output_types must "
                                             "include dense")
    for n, item in enumerate(items):
        if item.tokens is not None:
            raise invalid_field(f"items[{n}].tokens", "chunking splits texts; an item given "
                                                      "as token ids cannot be chunked")
        if item.is_image:
            raise invalid_field(f"items[{n}].image", "chunking splits texts; an image "
                                                     "cannot be chunked")
