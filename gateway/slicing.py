"""Split a request's items into work items sized for the workers' batcher.

Each work item is one JetStream message. Bounds: items, estimated tokens (characters / 4,
the gateway has no tokenizer) and bytes (NATS max_payload). Neither one message per item
(per-message overhead dominates) nor one giant message (one worker would get all of it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from heron_sdk import wire
from heron_sdk.chunking import ChunkingOptions
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import Item

CHARS_PER_TOKEN = 4
# msgpack framing of one item ({"text", "id"} map, string headers), rounded up.
ITEM_OVERHEAD_BYTES = 24
# An image item's tokens, for slicing: the gateway cannot know the model's patch count;
# CLIP ViT-B/16 at 224 px has 197 (ViT-B/32: 50, SigLIP so400m/14 at 384: 729).
IMAGE_TOKENS = 197
# Room for a work item's headers (request id, reply subject, deadline, ...; ~300 bytes).
HEADER_BYTES = 1024
# Headers plus the request's other fields (options, output types, ...).
MESSAGE_OVERHEAD_BYTES = 2048


@dataclass(frozen=True, slots=True)
class Slice:
    """Items ``start .. start + count - 1`` of a request."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


# A chunk's tokens when the request leaves chunking.max_tokens to the model and its config
# names no limit (the worker knows the model's own: MiniLM's 256 less [CLS] and [SEP]).
CHUNK_TOKENS_UNKNOWN = 254


def chunk_weights(items: Sequence[Item], chunking: ChunkingOptions | None,
                  max_sequence_length: int | None) -> list[int] | None:
    """Each item's estimated chunks, for admission and the backlog (None: not chunked,
    an item each). A chunked item is computed as that many items: counted as one, a
    request of a few long documents was admitted against a backlog it outweighed."""
    if chunking is None:
        return None
    window = chunking.max_tokens or (
        max_sequence_length - 2 if max_sequence_length else CHUNK_TOKENS_UNKNOWN)
    step = max(1, window - chunking.overlap)
    return [max(1, math.ceil(max(0, estimate_tokens(item.text) - chunking.overlap) / step))
            for item in items]


def item_tokens(item: Item) -> int:
    """An item's estimated tokens: counted when it is given as token ids."""
    if item.image is not None:
        return IMAGE_TOKENS
    return len(item.tokens) + 2 if item.tokens is not None else estimate_tokens(item.text)


def item_bytes(item: Item) -> int:
    if item.image is not None:  # msgpack bin: the bytes themselves
        size = len(item.image) + ITEM_OVERHEAD_BYTES
        return size if item.id is None else size + len(item.id.encode())
    if item.tokens is not None:  # msgpack ints: 1 to 5 bytes each
        size = 5 * len(item.tokens) + ITEM_OVERHEAD_BYTES
        return size if item.id is None else size + len(item.id.encode())
    size = len(item.text.encode()) + ITEM_OVERHEAD_BYTES
    return size if item.id is None else size + len(item.id.encode())


def plan_slices(items: Sequence[Item], *, max_items: int, max_tokens: int, max_payload: int,
                shared_text: str = "") -> list[Slice]:
    """Greedy slices under every bound. ``shared_text`` travels with every slice (the score
    query, an instruction): it counts against each slice's bytes, and, as a cross-encoder
    reads it with every item, against each item's tokens.

    When only the item bound binds, slices come out even (150 items at 64 -> 50/50/50, not
    64/64/22), so a pool's workers get equal shares. One item over the token bound still goes
    (alone); one item that cannot fit a NATS message is a 413.
    """
    if not items:
        return []
    budget = max_payload - len(shared_text.encode()) - MESSAGE_OVERHEAD_BYTES
    if len(items) == 1:  # most requests: only the message size can refuse one item
        _check_fits(0, item_bytes(items[0]), budget)
        return [Slice(0, 1)]
    shared_tokens = estimate_tokens(shared_text) if shared_text else 0
    per_slice = math.ceil(len(items) / math.ceil(len(items) / max_items))
    slices: list[Slice] = []
    start = count = tokens = size = 0
    for index, item in enumerate(items):
        tokens_here = item_tokens(item) + shared_tokens
        item_size = item_bytes(item)
        _check_fits(index, item_size, budget)
        if count and (count >= per_slice or tokens + tokens_here > max_tokens
                      or size + item_size > budget):
            slices.append(Slice(start, count))
            start, count, tokens, size = index, 0, 0, 0
        count += 1
        tokens += tokens_here
        size += item_size
    slices.append(Slice(start, count))
    return slices


def _check_fits(index: int, item_size: int, budget: int) -> None:
    """413 for an item that cannot fit a NATS message with what travels with it."""
    if item_size > budget:
        raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"items[{index}]: {item_size} bytes is over the cluster's "
                         f"per-message limit of {budget} bytes (NATS max_payload)",
                         field=f"items[{index}]")


def encode_slices(wire_body: dict[str, Any], slices: Sequence[Slice], max_payload: int,
                  ) -> list[tuple[Slice, bytes]]:
    """msgpack bodies of each slice: the request's wire form with only that slice's items.

    Byte estimates are estimates: a slice whose encoded body and headers still pass
    ``max_payload`` is halved until it fits (plan_slices refused single items that cannot).
    """
    items = wire_body["items"]
    max_bytes = max_payload - HEADER_BYTES
    out: list[tuple[Slice, bytes]] = []

    def emit(piece: Slice) -> None:
        payload = wire.encode({**wire_body, "items": items[piece.start:piece.stop]},
                              wire.MSGPACK)
        if len(payload) > max_bytes and piece.count > 1:
            half = piece.count // 2
            emit(Slice(piece.start, half))
            emit(Slice(piece.start + half, piece.count - half))
            return
        if len(payload) > max_bytes:
            raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                             f"items[{piece.start}]: {len(payload)} bytes is over the "
                             f"cluster's per-message limit of {max_bytes} bytes",
                             field=f"items[{piece.start}]")
        out.append((piece, payload))

    for piece in slices:
        emit(piece)
    return out

