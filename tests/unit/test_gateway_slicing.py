"""Work items are bounded in items, estimated tokens and bytes, and cover every item once."""

from __future__ import annotations

import itertools

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from heron.gateway.slicing import HEADER_BYTES, Slice, encode_slices, estimate_tokens, plan_slices
from heron_sdk.errors import HeronError
from heron_sdk.types import Item

BIG = 1 << 20


def covers(slices: list[Slice], n: int) -> bool:
    starts = [s.start for s in slices]
    return starts == sorted(starts) and all(
        a.stop == b.start for a, b in itertools.pairwise(slices)) and \
        slices[0].start == 0 and slices[-1].stop == n


def test_item_bound_gives_even_slices() -> None:
    items = [Item(f"t{i}") for i in range(150)]
    slices = plan_slices(items, max_items=64, max_tokens=BIG, max_payload=BIG)
    assert [s.count for s in slices] == [50, 50, 50]
    assert covers(slices, 150)


def test_small_request_is_one_work_item() -> None:
    slices = plan_slices([Item("a"), Item("b")], max_items=64, max_tokens=8192,
                         max_payload=BIG)
    assert slices == [Slice(0, 2)]


def test_token_bound_counts_the_shared_query() -> None:
    items = [Item("x" * 400) for _ in range(10)]  # 100 estimated tokens each
    alone = plan_slices(items, max_items=64, max_tokens=500, max_payload=BIG)
    assert [s.count for s in alone] == [5, 5]
    with_query = plan_slices(items, max_items=64, max_tokens=500, max_payload=BIG,
                             shared_text="q" * 400)  # +100 per item for a cross-encoder
    assert max(s.count for s in with_query) == 2 and covers(with_query, 10)


def test_one_item_over_the_token_bound_goes_alone() -> None:
    items = [Item("a"), Item("y" * 100_000), Item("b")]
    slices = plan_slices(items, max_items=64, max_tokens=1000, max_payload=BIG)
    assert slices == [Slice(0, 1), Slice(1, 1), Slice(2, 1)]


def test_byte_bound_keeps_messages_under_max_payload() -> None:
    items = [Item("é" * 3000) for _ in range(40)]  # 6000 bytes each in UTF-8
    max_payload = 64 * 1024
    slices = plan_slices(items, max_items=64, max_tokens=BIG, max_payload=max_payload)
    assert len(slices) > 1 and covers(slices, 40)
    body = {"items": [i.to_wire() for i in items], "output_types": ["dense"]}
    for piece, payload in encode_slices(body, slices, max_payload):
        assert len(payload) + HEADER_BYTES <= max_payload
        assert len(msgpack.unpackb(payload)["items"]) == piece.count


def test_an_item_that_cannot_fit_a_message_is_413() -> None:
    items = [Item("ok"), Item("z" * 70_000)]
    with pytest.raises(HeronError) as err:
        plan_slices(items, max_items=64, max_tokens=BIG, max_payload=64 * 1024)
    assert err.value.status == 413 and err.value.field == "items[1]"


def test_encode_halves_a_slice_that_came_out_too_big() -> None:
    body = {"items": ["w" * 1000] * 8, "instruction": "i" * 2000}
    pieces = encode_slices(body, [Slice(0, 8)], max_payload=HEADER_BYTES + 5000)
    assert [p.count for p, _ in pieces] == [2, 2, 2, 2]
    assert all(len(b) + HEADER_BYTES <= HEADER_BYTES + 5000 for _, b in pieces)
    assert msgpack.unpackb(pieces[1][1])["instruction"] == "i" * 2000


def test_estimate_tokens() -> None:
    assert estimate_tokens("") == 1 and estimate_tokens("abcd") == 1
    assert estimate_tokens("abcde") == 2


@given(lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=300),
       max_items=st.integers(1, 80), max_tokens=st.integers(50, 3000))
def test_slices_cover_every_item_once_within_bounds(lengths: list[int], max_items: int,
                                                    max_tokens: int) -> None:
    items = [Item("a" * n) for n in lengths]
    slices = plan_slices(items, max_items=max_items, max_tokens=max_tokens,
                         max_payload=BIG)
    assert covers(slices, len(items))
    for s in slices:
        assert 1 <= s.count <= max_items
        tokens = sum(estimate_tokens(i.text) for i in items[s.start:s.stop])
        assert s.count == 1 or tokens <= max_tokens


def test_chunk_weights_estimate_each_items_chunks() -> None:
    from heron.gateway.slicing import CHUNK_TOKENS_UNKNOWN, chunk_weights
    from heron_sdk.chunking import ChunkingOptions

    items = [Item("a" * 4000), Item("short"), Item("b" * 400)]  # ~1000, 2, 100 tokens
    assert chunk_weights(items, None, None) is None  # not chunked: an item each
    assert chunk_weights(items, ChunkingOptions(max_tokens=100), None) == [10, 1, 1]
    # overlap: each chunk after the first advances max_tokens - overlap tokens
    assert chunk_weights(items, ChunkingOptions(max_tokens=100, overlap=50), None) == \
        [19, 1, 1]  # windows end at 100, 150, ... 1000
    # the model's limit less its two special tokens, or a guess when the config has none
    assert chunk_weights(items, ChunkingOptions(), 102) == [10, 1, 1]
    assert chunk_weights(items, ChunkingOptions(), None) == \
        [-(-1000 // CHUNK_TOKENS_UNKNOWN), 1, 1]
