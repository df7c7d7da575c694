"""Bulk encoding's pure part (sdk/streaming.py): chunking, order, the in-flight bound and
where an error surfaces, with requests completed in any order and no server or clock.
The drivers run here with plain functions as requests; against a real server, see
tests/integration/test_sdk_bulk.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from heron_sdk import Client, EncodeResult, Item, ServerError
from heron_sdk.streaming import (
    Chunk,
    ChunkBuilder,
    EncodeStream,
    OrderedWindow,
    aiter_chunks,
    checked,
    drive_async,
    drive_sync,
    iter_chunks,
    progress_bar_class,
)


def chunks_of(count: int, size: int, max_bytes: int = 1 << 30) -> list[Chunk]:
    return list(iter_chunks((f"t{i}" for i in range(count)), ChunkBuilder(size, max_bytes)))


def result_for(chunk: Chunk, ids: list[str | None] | None = None) -> EncodeResult:
    ids = [item.id for item in chunk.items] if ids is None else ids
    body = {"model": "m", "usage": {"tokens": len(chunk)},
            "items": [{"dense": [1.0], "tokens": 1, "id": i} for i in ids]}
    return EncodeResult.from_body(body)


# ---- chunking --------------------------------------------------------------------------------
def test_chunks_are_consecutive_and_full_but_the_last() -> None:
    got = chunks_of(10, 4)
    assert [(c.seq, c.offset, len(c)) for c in got] == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]
    assert [i.text for c in got for i in c.items] == [f"t{i}" for i in range(10)]
    assert chunks_of(8, 4)[-1].offset == 4 and len(chunks_of(8, 4)) == 2
    assert chunks_of(0, 4) == []


def test_a_chunk_closes_when_full_not_when_the_next_item_comes() -> None:
    builder = ChunkBuilder(2, 1 << 30)
    assert builder.add("a") == []
    assert [c.offset for c in builder.add("b")] == [0]  # a slow input does not hold it
    assert builder.flush() is None


def test_chunks_stay_within_the_byte_limit() -> None:
    texts = ["x" * 40, "y" * 40, "z" * 40, "w" * 200, "v"]
    got = list(iter_chunks(texts, ChunkBuilder(100, 100)))
    assert [[i.text[0] for i in c.items] for c in got] == [["x", "y"], ["z"], ["w"], ["v"]]
    # two chunks from one add: the byte limit closes one, the size limit the next
    builder = ChunkBuilder(1, 10)
    assert builder.add("a") and [c.offset for c in builder.add("b" * 20)] == [1]


def test_items_keep_their_ids_and_bad_items_name_their_position() -> None:
    got = chunks_of(0, 1) + list(iter_chunks([Item("a", id="x"), "b"], ChunkBuilder(5, 99)))
    assert got[0].items == [Item("a", id="x"), Item("b")]
    source = iter(["a", "b", 3, "d"])
    out = iter_chunks(source, ChunkBuilder(10, 99))
    first = next(out)  # the items before the bad one are not lost
    assert [i.text for i in first.items] == ["a", "b"]
    with pytest.raises(TypeError, match=r"items\[2\] must be a str or an Item") as info:
        next(out)
    assert any("failed at item 2" in note for note in info.value.__notes__)
    assert next(source) == "d"  # nothing read past the failure


def test_an_input_that_raises_hands_back_what_came_before() -> None:
    def texts() -> Iterator[str]:
        yield from (f"t{i}" for i in range(7))
        raise OSError("disk gone")

    out = iter_chunks(texts(), ChunkBuilder(3, 99))
    assert [(c.offset, len(c)) for c in (next(out), next(out), next(out))] == \
        [(0, 3), (3, 3), (6, 1)]
    with pytest.raises(OSError, match="disk gone") as info:
        next(out)
    assert any("failed at item 7" in note for note in info.value.__notes__)


async def test_async_input_is_chunked_the_same() -> None:
    async def texts() -> AsyncIterator[str]:
        for i in range(5):
            yield f"t{i}"

    got = [c async for c in aiter_chunks(texts(), ChunkBuilder(2, 99))]
    assert [(c.offset, len(c)) for c in got] == [(0, 2), (2, 2), (4, 1)]


# ---- the window: order, bound, errors --------------------------------------------------------
def simulate(chunks: list[Chunk], limit: int, rng: random.Random,
             fail: dict[int, Exception] | None = None,
             handed: list[int] | None = None) -> tuple[list[int], list[int], int]:
    """Play a server that answers in-flight chunks in a random order. Returns the seqs
    handed back (also appended to ``handed`` as they come), the seqs ever cancelled, and
    the most ever outstanding."""
    window: OrderedWindow[str] = OrderedWindow(limit)
    source, fail = iter(chunks), fail or {}
    handed = [] if handed is None else handed
    cancelled: list[int] = []
    flying: list[int] = []
    peak = 0
    while True:
        while (ready := window.pop()) is not None:
            chunk, result = ready
            assert result == f"r{chunk.seq}"
            handed.append(chunk.seq)
        if window.done:
            return handed, cancelled, peak
        while window.can_send():
            chunk = next(source, None)
            if chunk is None:
                window.end()
                break
            window.sent(chunk)
            flying.append(chunk.seq)
        peak = max(peak, window.outstanding)
        assert len(flying) <= limit and window.in_flight == sorted(flying)
        for seq in window.cancel():
            cancelled.append(seq)
            if seq in flying:
                flying.remove(seq)
        if not flying:  # the input just ended: the next pop says what is left
            continue
        seq = flying.pop(rng.randrange(len(flying)))
        if seq in fail:
            window.failed(seq, fail[seq])
        else:
            window.completed(seq, f"r{seq}")


@given(st.integers(0, 40), st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**32))
def test_any_completion_order_comes_back_in_input_order(count: int, size: int, limit: int,
                                                         seed: int) -> None:
    chunks = chunks_of(count, size)
    handed, cancelled, peak = simulate(chunks, limit, random.Random(seed))
    assert handed == list(range(len(chunks))) and cancelled == []
    assert peak <= limit


@given(st.integers(1, 30), st.integers(1, 5), st.integers(0, 2**32), st.data())
def test_a_failure_surfaces_at_its_position(count: int, limit: int, seed: int,
                                            data: st.DataObject) -> None:
    chunks = chunks_of(count, 1)
    failing = data.draw(st.integers(0, count - 1))
    error = ServerError("QUEUE_FULL", "busy", status=429)
    handed: list[int] = []
    with pytest.raises(ServerError) as info:
        simulate(chunks, limit, random.Random(seed), {failing: error}, handed)
    assert info.value is error and handed == list(range(failing))
    assert any(f"items {failing}..{failing}" in note for note in error.__notes__)


def test_failure_hands_back_earlier_chunks_cancels_later_ones_and_sends_nothing_more() -> None:
    chunks = chunks_of(10, 1)
    window: OrderedWindow[str] = OrderedWindow(4)
    for chunk in chunks[:4]:
        window.sent(chunk)
    window.completed(3, "r3")
    window.failed(1, ValueError("boom"))
    assert not window.can_send()  # nothing more goes out
    assert window.cancel() == [2, 3]  # 3's result will never be handed back: dropped
    window.completed(2, "r2")  # a cancelled request that finished anyway: ignored
    assert window.pop() is None  # 0 still in flight: it comes back before the error
    window.completed(0, "r0")
    assert window.pop() == (chunks[0], "r0")
    with pytest.raises(ValueError, match="boom"):
        window.pop()
    assert not window.done and window.outstanding == 0


def test_the_earliest_failure_wins() -> None:
    window: OrderedWindow[str] = OrderedWindow(3)
    for chunk in chunks_of(3, 1):
        window.sent(chunk)
    window.failed(2, KeyError("late"))
    window.failed(0, KeyError("early"))
    with pytest.raises(KeyError, match="early"):
        window.pop()


def test_an_input_error_surfaces_after_everything_sent() -> None:
    chunks = chunks_of(2, 1)
    window: OrderedWindow[str] = OrderedWindow(4)
    for chunk in chunks:
        window.sent(chunk)
    window.end(OSError("input broke"))
    window.completed(1, "r1")
    assert window.pop() is None
    window.completed(0, "r0")
    assert [window.pop(), window.pop()] == [(chunks[0], "r0"), (chunks[1], "r1")]
    with pytest.raises(OSError, match="input broke"):
        window.pop()


def test_the_window_refuses_misuse() -> None:
    with pytest.raises(ValueError):
        OrderedWindow(0)
    window: OrderedWindow[str] = OrderedWindow(1)
    chunks = chunks_of(2, 1)
    with pytest.raises(ValueError, match="out of order"):
        window.sent(chunks[1])
    window.sent(chunks[0])
    with pytest.raises(RuntimeError, match="full"):
        window.sent(chunks[1])


def test_checked_refuses_a_reply_that_does_not_match_its_chunk() -> None:
    chunk = Chunk(0, 10, [Item("a", id="x"), Item("b")])
    assert checked(chunk, result_for(chunk)).tokens == 2
    with pytest.raises(ServerError, match="1 results for 2 items"):
        checked(chunk, result_for(Chunk(0, 10, chunk.items[:1])))
    with pytest.raises(ServerError, match="item 10 came back with id 'y'"):
        checked(chunk, result_for(chunk, ["y", None]))


def test_joined_results_are_one_result() -> None:
    parts = [result_for(c) for c in chunks_of(5, 2)]
    joined = EncodeResult.joined(parts)
    assert len(joined) == 5 and joined.tokens == 5 and joined.dense.shape == (5, 1)
    assert len(joined.raw["items"]) == 5
    with pytest.raises(ValueError):
        EncodeResult.joined([])


# ---- the drivers, with plain functions for requests ------------------------------------------
class Tracker:
    """A request that takes a random time, counting how many run at once."""

    def __init__(self, fail_at: int | None = None, seed: int = 0) -> None:
        self.lock = threading.Lock()
        self.running = self.peak = 0
        self.started: list[int] = []
        self.cancelled: list[int] = []
        self.fail_at = fail_at
        self.rng = random.Random(seed)

    def enter(self, chunk: Chunk) -> float:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.started.append(chunk.seq)
            return self.rng.uniform(0, 0.01)

    def leave(self, chunk: Chunk) -> str:
        with self.lock:
            self.running -= 1
        if chunk.seq == self.fail_at:
            raise ServerError("INTERNAL", "boom", status=500)
        return f"r{chunk.seq}"

    def send(self, chunk: Chunk) -> str:
        time.sleep(self.enter(chunk))
        return self.leave(chunk)

    async def asend(self, chunk: Chunk) -> str:
        delay = self.enter(chunk)
        if chunk.seq == 7:
            delay = 5.0  # slow: still running when the stream ends
        elif chunk.seq == self.fail_at:
            delay = 0.1  # fails once 7 has started
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(chunk.seq)
            with self.lock:
                self.running -= 1
            raise
        return self.leave(chunk)


def test_drive_sync_keeps_order_and_the_bound() -> None:
    tracker = Tracker(seed=1)
    got = list(drive_sync(iter(chunks_of(60, 3)), OrderedWindow(4), tracker.send))
    assert [c.seq for c, _ in got] == list(range(20))
    assert [r for _, r in got] == [f"r{i}" for i in range(20)]
    assert 1 < tracker.peak <= 4


def test_drive_sync_raises_at_the_failing_chunk() -> None:
    tracker = Tracker(fail_at=5, seed=2)
    handed = []
    with pytest.raises(ServerError, match="boom"):
        for chunk, _ in drive_sync(iter(chunks_of(20, 1)), OrderedWindow(3), tracker.send):
            handed.append(chunk.seq)
    assert handed == [0, 1, 2, 3, 4]
    assert max(tracker.started) <= 5 + 3  # nothing past the window was sent


async def test_drive_async_keeps_order_and_cancels_after_a_failure() -> None:
    tracker = Tracker(fail_at=5, seed=3)

    async def chunks() -> AsyncIterator[Chunk]:
        for chunk in chunks_of(20, 1):
            yield chunk

    handed = []
    with pytest.raises(ServerError, match="boom") as info:
        async for chunk, _ in drive_async(chunks(), OrderedWindow(4), tracker.asend):
            handed.append(chunk.seq)
    assert handed == [0, 1, 2, 3, 4]
    assert 7 in tracker.cancelled  # in flight past the failure: cancelled, not awaited out
    assert tracker.running == 0  # and every task has ended when the error reaches the caller
    assert any("items 5..5" in note for note in info.value.__notes__)


async def test_drive_async_stopping_early_cancels_the_rest() -> None:
    tracker = Tracker(seed=4)

    async def chunks() -> AsyncIterator[Chunk]:
        for chunk in chunks_of(20, 1):
            yield chunk

    driver = drive_async(chunks(), OrderedWindow(4), tracker.asend)
    async with contextlib.aclosing(driver):
        async for chunk, _ in driver:
            if chunk.seq == 5:
                break
    assert 7 in tracker.cancelled and tracker.running == 0  # 7 was still running
    assert max(tracker.started) <= 9


# ---- settings checked when the call is made --------------------------------------------------
def test_settings_are_checked_before_any_input_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    read = []

    def texts() -> Iterator[str]:
        read.append(1)
        yield "x"

    client = Client("http://127.0.0.1:9")
    with pytest.raises(TypeError, match="unexpected keyword"):
        client.encode_stream("m", texts(), dimz=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="over the 2048 items"):
        client.encode_stream("m", texts(), chunk_size=4096)
    with pytest.raises(ValueError, match="max_in_flight"):
        client.encode_stream("m", texts(), max_in_flight=0)
    with pytest.raises(TypeError, match="update"):
        client.encode_stream("m", texts(), progress="yes")  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"heron-sdk\[progress\]"):
        client.encode_stream("m", texts(), progress=True)
    with pytest.raises(ImportError, match=r"heron-sdk\[progress\]"):
        client.encode("m", texts(), progress=True)
    assert read == []
    client.close()


def test_progress_bar_class_and_own_bar() -> None:
    assert progress_bar_class(False) is None
    assert progress_bar_class(True) is not None  # tqdm is installed in the test env

    class Bar:
        def update(self, n: int) -> None: ...

    assert progress_bar_class(Bar()) is None  # used as given, not built
    stream = EncodeStream(Client("http://127.0.0.1:9")._b, "m", ["a", "b"], chunk_size=None,
                          max_in_flight=2, progress=True, total=None, options={})
    assert stream.total == 2  # from len(); a generator's total comes from total=
