"""--inference-threads: a model's forward passes on several threads at once (the runner's
scheduling, with a stand-in model whose passes can be held), and the gate that keeps a
change to the model's modules apart from them (PassGate). The real models, LoRA included,
are run this way in tests/integration/test_inference_threads.py."""

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
from heron.worker.pass_gate import PassGate
from heron.worker.runner import ModelRunner


class HeldAdapter:
    """A stand-in model: its output is its input ids; every forward pass waits until
    released, and the adapter records how many ran at once and on which threads."""

    name, task, packed, cacheable = "held", "encode", False, True

    def __init__(self) -> None:
        self.config = SimpleNamespace(id="m")
        self.profile = Profile(max_wait_ms=0)
        self.device = torch.device("cpu")
        self.release = threading.Event()
        self.running = 0
        self.most_at_once = 0
        self.threads: set[str] = set()
        self.batches: list[list[int]] = []
        self._lock = threading.Lock()

    def collate(self, items: list[Tokenized]) -> list[Tokenized]:
        return items

    def forward(self, batch: list[Tokenized]) -> None:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.threads.add(threading.current_thread().name)
            self.batches.append([t.input_ids[0] for t in batch])
        try:
            self.release.wait(5)
        finally:
            with self._lock:
                self.running -= 1

    def postprocess(self, batch: list[Tokenized], output: Any) -> list[dict[str, Any]]:
        return [{"dense": np.array(t.input_ids, dtype=np.float32)} for t in batch]


def tok(i: int) -> Tokenized:
    return Tokenized(input_ids=[i], token_type_ids=None, truncated=False)


@contextlib.asynccontextmanager
async def runner_with(threads: int) -> AsyncIterator[tuple[ModelRunner, HeldAdapter]]:
    """A runner on a pool of ``threads`` inference threads, as ModelRegistry builds it."""
    adapter = HeldAdapter()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="infer-cpu")
    runner = ModelRunner(adapter, tokenize_pool=ThreadPoolExecutor(1),  # type: ignore[arg-type]
                         infer_pool=pool, passes=threads)
    runner.start()
    try:
        yield runner, adapter
    finally:
        adapter.release.set()
        await runner.stop()
        pool.shutdown(wait=True)


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_second_batch_starts_while_the_first_pass_runs() -> None:
    async with runner_with(2) as (runner, adapter):
        first = asyncio.create_task(runner.infer([tok(1)]))
        await until(lambda: adapter.running == 1)
        # The first pass holds one thread; what comes now is the other thread's batch.
        second = asyncio.create_task(runner.infer([tok(2), tok(3)]))
        await until(lambda: adapter.running == 2)
        assert runner.passes_running == 2 and runner.in_forward == 3
        # Both threads are busy: a third batch waits for one of them.
        third = asyncio.create_task(runner.infer([tok(4)]))
        await asyncio.sleep(0.05)
        assert adapter.batches == [[1], [2, 3]] and adapter.most_at_once == 2
        adapter.release.set()
        answers = await asyncio.gather(first, second, third)
        assert [[int(r.value["dense"][0]) for r in a] for a in answers] == [[1], [2, 3], [4]]
        assert len(adapter.threads) == 2
        assert runner.passes_running == 0 and runner.in_forward == 0


async def test_what_is_queued_is_shared_between_free_threads() -> None:
    async with runner_with(2) as (runner, adapter):
        # Six items at once, both threads free: three each, not six on one thread and the
        # other idle.
        answer = asyncio.create_task(runner.infer([tok(i) for i in range(1, 7)]))
        await until(lambda: adapter.running == 2)
        assert sorted(len(b) for b in adapter.batches) == [3, 3]
        assert sorted(i for b in adapter.batches for i in b) == [1, 2, 3, 4, 5, 6]
        adapter.release.set()
        assert [int(r.value["dense"][0]) for r in await answer] == [1, 2, 3, 4, 5, 6]
        # One thread free: it takes all that is queued.
        adapter.release.clear()
        first = asyncio.create_task(runner.infer([tok(7)]))
        await until(lambda: adapter.running == 1)
        rest = asyncio.create_task(runner.infer([tok(i) for i in range(8, 12)]))
        await until(lambda: adapter.running == 2)
        assert adapter.batches[-1] == [8, 9, 10, 11]
        adapter.release.set()
        await asyncio.gather(first, rest)


async def test_one_thread_runs_one_pass_at_a_time() -> None:
    async with runner_with(1) as (runner, adapter):
        first = asyncio.create_task(runner.infer([tok(1)]))
        await until(lambda: adapter.running == 1)
        second = asyncio.create_task(runner.infer([tok(2)]))
        await asyncio.sleep(0.05)
        assert adapter.batches == [[1]] and runner.passes_running == 1
        adapter.release.set()
        await asyncio.gather(first, second)
        assert adapter.most_at_once == 1 and adapter.batches == [[1], [2]]


async def test_a_failed_pass_frees_its_thread_and_fails_only_its_items() -> None:
    async with runner_with(2) as (runner, adapter):
        adapter.release.set()

        def forward(batch: list[Tokenized]) -> None:
            if batch[0].input_ids[0] == 13:
                raise RuntimeError("bad batch")

        adapter.forward = forward  # type: ignore[method-assign]
        for _ in range(3):  # more failures than threads: none of them keeps a thread
            with pytest.raises(Exception, match="inference failed: bad batch"):
                await asyncio.wait_for(runner.infer([tok(13)]), 5)
        assert runner.passes_running == 0
        answer = await asyncio.wait_for(runner.infer([tok(7)]), 5)
        assert int(answer[0].value["dense"][0]) == 7


def test_a_change_waits_for_running_passes_and_holds_back_new_ones() -> None:
    gate = PassGate()
    events: list[str] = []
    in_pass = threading.Event()
    finish_pass = threading.Event()

    def a_pass(name: str, hold: threading.Event | None = None) -> None:
        with gate.forward_pass():
            events.append(f"{name} in")
            if hold is not None:
                in_pass.set()
                hold.wait(5)
            events.append(f"{name} out")

    def a_change() -> None:
        with gate.change():
            events.append("change")

    first = threading.Thread(target=a_pass, args=("p1", finish_pass))
    first.start()
    assert in_pass.wait(5)
    change = threading.Thread(target=a_change)
    change.start()
    time.sleep(0.05)
    late = threading.Thread(target=a_pass, args=("p2",))
    late.start()
    time.sleep(0.05)
    assert events == ["p1 in"]  # the change waits for p1; p2 waits behind the change
    finish_pass.set()
    for t in (first, change, late):
        t.join(5)
    assert events == ["p1 in", "p1 out", "change", "p2 in", "p2 out"]


def test_passes_share_the_gate() -> None:
    gate = PassGate()
    both_in = threading.Barrier(2, timeout=5)

    def a_pass() -> None:
        with gate.forward_pass():
            both_in.wait()  # breaks (BrokenBarrierError) unless both are inside at once

    threads = [threading.Thread(target=a_pass) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6)
    assert not both_in.broken
