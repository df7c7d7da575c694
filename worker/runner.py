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

from heron.worker.adapters import Adapter, TextInput, Tokenized
from heron.worker.batcher import TokenBudgetBatcher, WorkItem
from heron.worker.images import ImageInput
from heron.worker.lora import LoraSet
from heron.worker.memory import HeapTrimmer
from heron_sdk.errors import ErrorCode, HeronError

log = logging.getLogger("heron.worker.runner")

# Small requests tokenize on the event loop (tens of microseconds); bigger ones on the pool.
INLINE_TOKENIZE_ITEMS = 64
INLINE_TOKENIZE_CHARS = 16384


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
                 infer_pool: ThreadPoolExecutor | None = None,
                 autocast_dtype: torch.dtype | None = None,
                 on_batch: Callable[[BatchStats], None] | None = None,
                 arrivals_open: Callable[[], bool] | None = None) -> None:
        self.adapter = adapter
        profile = adapter.profile
        self.batcher = TokenBudgetBatcher(
            max_batch_tokens=profile.max_batch_tokens, max_batch_items=profile.max_batch_items,
            max_wait_s=profile.max_wait_ms / 1000.0, max_queue_items=profile.max_queue_items,
            packed=adapter.packed, arrivals_open=arrivals_open)
        self._tokenize_pool = tokenize_pool
        # Must be a single thread: see ModelRegistry for why CPU models share one.
        self._own_pool = infer_pool is None
        self._infer_pool = infer_pool or ThreadPoolExecutor(
            1, thread_name_prefix=f"infer-{adapter.name}")
        self._autocast_dtype = autocast_dtype
        self._on_batch = on_batch
        # The model's LoRA adapters; they change the model only on the inference thread.
        self.loras = LoraSet(adapter, self._infer_pool)
        self._trimmer = HeapTrimmer()
        self._task: asyncio.Task | None = None
        self.in_flight = 0
        self.in_forward = 0  # items of the batch on the inference thread now

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
        if self._own_pool:
            self._infer_pool.shutdown(wait=False, cancel_futures=True)

    async def warm_up(self) -> None:
        """One real forward pass on the inference thread; ready only after it."""
        items = self.adapter.tokenize([("warm up", "warm up")] if self.adapter.task == "score"
                                      else ["warm up"])
        await asyncio.get_running_loop().run_in_executor(self._infer_pool, self._run_batch,
                                                         items)

    # ---- request side ------------------------------------------------------------------
    async def tokenize(self, inputs: list[TextInput | ImageInput], query: bool = False,
                       prompt: str = "") -> list[Tokenized]:
        # Images always decode on the pool (milliseconds each: never on the event loop).
        if len(inputs) <= INLINE_TOKENIZE_ITEMS and not any(
                isinstance(x, ImageInput) for x in inputs) and sum(
                len(x) if isinstance(x, str) else len(x[0]) + len(x[1])
                if isinstance(x, tuple) else len(getattr(x, "text", ""))  # token ids: 0
                for x in inputs
        ) <= INLINE_TOKENIZE_CHARS:
            tokens = self.adapter.tokenize_now(inputs, query, prompt)
            if tokens is not None:
                return tokens
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.adapter.tokenize, inputs,
                                          query, prompt)

    async def clip(self, texts: list[str], max_tokens: int) -> tuple[list[str], set[int]]:
        """``adapter.clip`` on the tokenizer pool (documents may be long)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self.adapter.clip, texts, max_tokens)

    async def infer(self, items: list[Tokenized], *, priority: int = 0,
                    deadline: float | None = None, lora: Any = None) -> list[ItemResult]:
        """``lora``: the LoRA adapter (``LoraSet.use``) every item is computed with."""
        if self._task is None:  # evicted between picking this runner and now
            raise HeronError(ErrorCode.MODEL_LOADING, f"model {self.adapter.config.id} was "
                             "unloaded to free memory and is loading again",
                             retry_after_s=2.0)
        loop = asyncio.get_running_loop()
        work = [WorkItem(payload=t, length=t.length, priority=priority, deadline=deadline,
                         future=loop.create_future(), lora=lora) for t in items]
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
        """Form a batch from everything queued while the previous one ran, run it, deliver.
        (Forming the next batch early, while one runs, was measured: smaller batches, 10%
        fewer items/s at 32 clients. Waiting for the model to be free batches better.)"""
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.batcher.next_batch()
            self.in_forward = len(batch)
            future = loop.run_in_executor(self._infer_pool, self._run_batch,
                                          [w.payload for w in batch], [w.lora for w in batch])
            try:
                await self._deliver(batch, future)
            finally:
                self.in_forward = 0

    async def _deliver(self, batch: list[WorkItem], future: asyncio.Future) -> None:
        try:
            values, started, ended = await future
        except Exception as exc:  # one bad batch must not kill the loop
            log.exception("batch of %d items failed", len(batch))
            error = HeronError(ErrorCode.INTERNAL, f"inference failed: {exc}")
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(error)
            return
        inference_s = ended - started
        real = sum(w.length for w in batch)
        computed = real if self.adapter.packed else max(w.length for w in batch) * len(batch)
        self.batcher.cost.observe(computed, inference_s)
        self.batcher.drain.observe(real, inference_s)
        for w, value in zip(batch, values, strict=True):
            if not w.future.done():
                w.future.set_result(ItemResult(value, started - w.enqueued_at, inference_s))
        if self._on_batch is not None:
            self._on_batch(BatchStats(len(batch), computed, real, inference_s))

    def _run_batch(self, items: list[Tokenized], loras: list[Any] | None = None
                   ) -> tuple[list[Any], float, float]:
        """Collate, forward, postprocess: on the inference thread. Times are measured here
        so that time spent queued behind the previous batch counts as queue time.
        ``loras``: each item's LoRA adapter (None: the base model)."""
        started = time.monotonic()
        with torch.inference_mode():
            # One pass, unless the items' LoRA adapters cannot share one (worker/lora.py).
            values = self.loras.run(items, loras, self._compute)
        ended = time.monotonic()
        self._trimmer.maybe_trim(ended)  # on this thread: between batches, off the loop
        return values, started, ended

    def _compute(self, items: list[Tokenized], loras: list[Any] | None) -> list[Any]:
        adapter = self.adapter
        batch = adapter.collate(items)
        with self.loras.applied(batch, loras):
            if self._autocast_dtype is not None:
                with torch.autocast(device_type=adapter.device.type,
                                    dtype=self._autocast_dtype):
                    output = adapter.forward(batch)
            else:
                output = adapter.forward(batch)
        return adapter.postprocess(batch, output)
