"""The result cache (worker/result_cache.py) and the runner's use of it (worker/runner.py):
LRU bounded in bytes, scopes dropped whole, exact keys; identical items in flight are
computed once, a waiter that gives up cancels nothing others wait on, ``cache=False``
bypasses everything, a new scope never serves an old entry."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from heron.runtime.modelconfig import Profile
from heron.worker.adapters import Tokenized
from heron.worker.result_cache import ResultCache, item_digest, value_bytes
from heron.worker.runner import ModelRunner
from heron_sdk.types import RequestOptions

# ---- ResultCache (no I/O) -------------------------------------------------------------


def test_lru_is_bounded_in_bytes_and_evicts_the_least_recently_used() -> None:
    cache = ResultCache(300, size_of=lambda v: 100)
    for n in range(3):
        assert cache.put(("s", bytes([n])), n)
    assert cache.get(("s", b"\x00")) == 0  # 0 is now the most recently used
    cache.put(("s", b"\x03"), 3)
    assert cache.get(("s", b"\x01")) is None  # the least recently used went
    assert [cache.get(("s", bytes([n]))) for n in (0, 2, 3)] == [0, 2, 3]
    assert (cache.bytes, len(cache), cache.stats.evictions) == (300, 3, 1)


def test_an_entry_larger_than_the_bound_is_not_kept_and_zero_disables() -> None:
    assert not ResultCache(50, size_of=lambda v: 100).put(("s", b"k"), 1)
    off = ResultCache(0)
    assert not off.enabled and not off.put(("s", b"k"), 1) and len(off) == 0


def test_drop_scope_forgets_one_models_entries_and_their_bytes() -> None:
    cache = ResultCache(10_000, size_of=lambda v: 10)
    for n in range(5):
        cache.put(("a#1", bytes([n])), n)
        cache.put(("b#2", bytes([n])), n)
    assert cache.drop_scope("a#1") == 5
    assert cache.get(("a#1", b"\x00")) is None and cache.get(("b#2", b"\x00")) == 0
    assert (cache.bytes, len(cache), cache.stats.invalidated) == (50, 5, 5)
    assert cache.clear() == 50 and cache.bytes == 0 and len(cache) == 0


def test_cached_arrays_are_read_only_and_sized_by_their_data() -> None:
    cache = ResultCache(1 << 20)
    value = {"dense": np.ones(384, dtype=np.float32)}
    cache.put(("s", b"k"), value)
    with pytest.raises(ValueError):
        value["dense"][0] = 2.0
    assert value_bytes(value) == 1536 + value_bytes({}) and cache.bytes == value_bytes(value)


def test_the_digest_tells_apart_everything_the_model_reads() -> None:
    base = item_digest([101, 7, 102], None, False, 0, None)
    assert base == item_digest([101, 7, 102], None, False, 0, None)
    lora = SimpleNamespace(name="legal", source="path:/a")
    others = [item_digest([101, 8, 102], None, False, 0, None),
              item_digest([101, 7, 102], [0, 0, 0], False, 0, None),
              item_digest([101, 7, 102], None, True, 0, None),
              item_digest([101, 7, 102], None, False, 1, None),
              item_digest([101, 7, 102], None, False, 0, [1, 0, 1]),
              item_digest([101, 7, 102], None, False, 0, None, lora),
              item_digest([101, 7], [102], False, 0, None)]
    assert len({base, *others}) == len(others) + 1


# ---- the runner: dedup in flight, bypass, scopes ---------------------------------------


class CountingAdapter:
    """A stand-in model: its output is its input ids as floats; counts what it computes
    and can hold a forward pass until released."""

    name, task, packed, cacheable = "fake", "encode", False, True

    def __init__(self) -> None:
        self.config = SimpleNamespace(id="m")
        self.profile = Profile(max_wait_ms=0)
        self.device = torch.device("cpu")
        self.computed: list[tuple[int, ...]] = []
        self.gate = threading.Event()
        self.gate.set()

    def collate(self, items: list[Tokenized]) -> list[Tokenized]:
        return items

    def forward(self, batch: list[Tokenized]) -> None:
        self.gate.wait(5)
        self.computed.extend(tuple(t.input_ids) for t in batch)

    def postprocess(self, batch: list[Tokenized], output: Any) -> list[dict[str, Any]]:
        return [{"dense": np.array(t.input_ids, dtype=np.float32)} for t in batch]


def tok(*ids: int) -> Tokenized:
    return Tokenized(input_ids=list(ids), token_type_ids=None, truncated=False)


@pytest.fixture
def runner() -> ModelRunner:
    return ModelRunner(CountingAdapter(), tokenize_pool=ThreadPoolExecutor(1),  # type: ignore[arg-type]
                       results=ResultCache(1 << 20))


@contextlib.asynccontextmanager
async def running(runner: ModelRunner) -> AsyncIterator[Any]:
    """The runner's loop on the test's own event loop; its adapter."""
    runner.start()
    try:
        yield runner.adapter
    finally:
        await runner.stop()


async def test_identical_concurrent_requests_compute_once(runner: ModelRunner) -> None:
    async with running(runner) as adapter:
        adapter.gate.clear()  # hold the first forward pass while the others arrive
        calls = [asyncio.create_task(runner.infer([tok(1, 2, 3)])) for _ in range(64)]
        await asyncio.sleep(0.05)
        adapter.gate.set()
        answers = await asyncio.gather(*calls)
        assert adapter.computed == [(1, 2, 3)]
        assert sum(not a[0].cached for a in answers) == 1  # the one that computed it
        assert all(np.array_equal(a[0].value["dense"], [1, 2, 3]) for a in answers)
        stats = runner.results.stats
        assert (stats.misses, stats.joins + stats.hits) == (1, 63)
        again = await runner.infer([tok(1, 2, 3)])
        assert again[0].cached and adapter.computed == [(1, 2, 3)]


async def test_duplicates_within_a_request_are_computed_once(runner: ModelRunner) -> None:
    async with running(runner) as adapter:
        out = await runner.infer([tok(5), tok(6), tok(5)])
        assert sorted(adapter.computed) == [(5,), (6,)]
        assert [r.cached for r in out] == [False, False, True]
        assert out[2].value is out[0].value


async def test_a_waiter_that_gives_up_does_not_cancel_the_others(runner: ModelRunner) -> None:
    async with running(runner) as adapter:
        adapter.gate.clear()
        first = asyncio.create_task(runner.infer([tok(9)]))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(runner.infer([tok(9)]))
        queued = asyncio.create_task(runner.infer([tok(9, 9)]))  # queued behind the pass
        await asyncio.sleep(0.01)
        joiner = asyncio.create_task(runner.infer([tok(9, 9)]))
        await asyncio.sleep(0.01)
        first.cancel()
        queued.cancel()
        await asyncio.sleep(0.01)
        adapter.gate.set()
        assert (await second)[0].cached and (await joiner)[0].cached
        assert sorted(adapter.computed) == [(9,), (9, 9)]


async def test_everyone_giving_up_leaves_nothing_to_compute(runner: ModelRunner) -> None:
    async with running(runner) as adapter:
        adapter.gate.clear()
        busy = asyncio.create_task(runner.infer([tok(1)]))
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(runner.infer([tok(2)])) for _ in range(3)]
        await asyncio.sleep(0.01)
        for w in waiting:
            w.cancel()
        await asyncio.sleep(0.01)
        adapter.gate.set()
        await busy
        await asyncio.sleep(0.05)
        assert adapter.computed == [(1,)] and not runner._flights


async def test_cache_false_neither_reads_shares_nor_stores(runner: ModelRunner) -> None:
    async with running(runner) as adapter:
        await runner.infer([tok(4)])
        out = await runner.infer([tok(4), tok(4)], cache=False)
        assert [r.cached for r in out] == [False, False]
        assert adapter.computed == [(4,), (4,), (4,)]
        assert len(runner.results) == 1


async def test_a_new_scope_never_serves_an_old_entry(runner: ModelRunner) -> None:
    async with running(runner) as adapter:
        await runner.infer([tok(3)])
        adapter.gate.clear()
        in_flight = asyncio.create_task(runner.infer([tok(7)]))
        await asyncio.sleep(0.01)
        runner.invalidate_results()  # what a config delta does (ModelRegistry.apply_bundle)
        assert len(runner.results) == 0
        late = asyncio.create_task(runner.infer([tok(7)]))  # must not join the old computation
        await asyncio.sleep(0.01)
        adapter.gate.set()
        await in_flight
        assert not (await late)[0].cached
        assert not (await runner.infer([tok(3)]))[0].cached
        assert sorted(adapter.computed) == [(3,), (3,), (7,), (7,)]
        started = time.monotonic()
        assert (await runner.infer([tok(7)]))[0].cached and time.monotonic() - started < 1


def test_cache_false_travels_on_the_wire_only_when_set() -> None:
    # The gateway coalesces only requests whose wire bodies agree outside their items
    # (gateway/dispatcher.py), so cache: false never shares a work item with cache: true.
    off = RequestOptions.from_wire({"cache": False})
    assert off.to_wire()["cache"] is False
    assert RequestOptions.from_wire(off.to_wire()).cache is False
    assert "cache" not in RequestOptions().to_wire() and RequestOptions.from_wire({}).cache
