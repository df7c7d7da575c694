"""ModelRunner: one loaded model, its batcher, and the one thread that runs its forward.

Data path of an item: ``tokenize`` (shared thread pool) -> ``TokenBudgetBatcher`` ->
``_serve`` loop (one task) -> ``Adapter.collate/forward/postprocess`` on the model's own
inference thread -> the caller's future. The event loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from sdk.errors import ErrorCode, HeronError
from worker.adapters import Adapter, TextInput, Tokenized
from worker.batcher import TokenBudgetBatcher, WorkItem

log = logging.getLogger("heron.worker.runner")


@dataclass(slots=True)
class ItemResult:
    value: Any
    queue_s: float
    inference_s: float


@dataclass(slots=True)
class BatchStats:
    items: int
    padded_tokens: int
    real_tokens: int
    inference_s: float


class ModelRunner:
    def __init__(self, adapter: Adapter, *, tokenize_pool: ThreadPoolExecutor,
                 autocast_dtype: torch.dtype | None = None,
                 on_batch: Callable[[BatchStats], None] | None = None) -> None:
        self.adapter = adapter
        profile = adapter.profile
        self.batcher = TokenBudgetBatcher(
            max_batch_tokens=profile.max_batch_tokens, max_batch_items=profile.max_batch_items,
            max_wait_s=profile.max_wait_ms / 1000.0, max_queue_items=profile.max_queue_items)
        self._tokenize_pool = tokenize_pool
        self._infer_pool = ThreadPoolExecutor(1, thread_name_prefix=f"infer-{adapter.name}")
        self._autocast_dtype = autocast_dtype
        self._on_batch = on_batch
        self._task: asyncio.Task | None = None
        self.in_flight = 0

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._infer_pool.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """One real forward pass (blocking); the worker is ready only after it."""
        items = self.adapter.tokenize([("warm up", "warm up")] if self.adapter.task == "score"
                                      else ["warm up"])
        self._run_batch(items)

    # ---- request side ------------------------------------------------------------------
    async def tokenize(self, inputs: list[TextInput]) -> list[Tokenized]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.adapter.tokenize, inputs)

    async def infer(self, items: list[Tokenized], *, priority: int = 0,
                    deadline: float | None = None) -> list[ItemResult]:
        loop = asyncio.get_running_loop()
        work = [WorkItem(payload=t, length=t.length, priority=priority, deadline=deadline,
                         future=loop.create_future()) for t in items]
        self.batcher.submit(work)
        self.in_flight += 1
        try:
            return list(await asyncio.gather(*(w.future for w in work)))
        finally:
            self.in_flight -= 1
            for w in work:  # a caller that gave up (timeout) leaves nothing to compute
                if not w.future.done():
                    w.future.cancel()

    # ---- the one task that owns the queue ----------------------------------------------
    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.batcher.next_batch()
            started = time.monotonic()
            try:
                values = await loop.run_in_executor(self._infer_pool, self._run_batch,
                                                    [w.payload for w in batch])
            except Exception as exc:  # one bad batch must not kill the loop
                log.exception("batch of %d items failed", len(batch))
                error = HeronError(ErrorCode.INTERNAL, f"inference failed: {exc}")
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(error)
                continue
            inference_s = time.monotonic() - started
            for w, value in zip(batch, values, strict=True):
                if not w.future.done():
                    w.future.set_result(ItemResult(value, started - w.enqueued_at,
                                                   inference_s))
            if self._on_batch is not None:
                width = max(w.length for w in batch)
                self._on_batch(BatchStats(len(batch), width * len(batch),
                                          sum(w.length for w in batch), inference_s))

    def _run_batch(self, items: list[Tokenized]) -> list[Any]:
        adapter = self.adapter
        with torch.inference_mode():
            batch = adapter.collate(items)
            if self._autocast_dtype is not None:
                with torch.autocast(device_type=adapter.device.type,
                                    dtype=self._autocast_dtype):
                    output = adapter.forward(batch)
            else:
                output = adapter.forward(batch)
            return adapter.postprocess(batch, output)
