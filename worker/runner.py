"""ModelRunner: one loaded model, its batcher, and the inference thread(s) that run its
forward passes.

Data path of an item: ``tokenize`` (shared thread pool) -> ``TokenBudgetBatcher`` ->
``_serve`` loop (one task) -> ``Adapter.collate/forward/postprocess`` on an inference
thread -> the caller's future. The event loop never blocks on the model. On CPU, with
``--inference-threads N`` (``passes``), up to N batches of the model compute at once, each
on its own thread; the next batch forms when one of them is free.

Before the batcher, ``infer`` answers items from the worker's result cache and lets
identical items share one computation (worker/result_cache.py): an item whose key is
cached is answered at once, one whose key is queued or computing for anyone (another
request, or an earlier item of the same request) waits on that computation's future.
With the shared tier on (worker/shared_results.py), the items left are first looked up in
the NATS KV bucket, in one batch on a task of its own (``_look_up_shared``), and only its
misses go to the batcher; what is computed is written there in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from heron.runtime.modelconfig import ModelConfig
from heron.worker.adapters import Adapter, TextInput, Tokenized
from heron.worker.batcher import TokenBudgetBatcher, WorkItem
from heron.worker.images import ImageInput
from heron.worker.lora import LoraSet
from heron.worker.memory import HeapTrimmer
from heron.worker.pass_gate import PassGate
from heron.worker.result_cache import Key, ResultCache, item_digest
from heron.worker.shared_results import SharedIdentity, SharedResults, shared_key
from heron_sdk.errors import ErrorCode, HeronError

log = logging.getLogger("heron.worker.runner")

# Small requests tokenize on the event loop (tens of microseconds); bigger ones on the pool.
INLINE_TOKENIZE_ITEMS = 64
INLINE_TOKENIZE_CHARS = 16384
# A new number per load and per config change of a model: its result-cache scope.
_SCOPES = itertools.count(1)


@dataclass(slots=True)
class ItemResult:
    value: Any
    queue_s: float
    inference_s: float
    # Not computed for this item: served from the result cache, or shared with an
    # identical item's computation (another request's, or this request's own).
    cached: bool = False


@dataclass(slots=True, eq=False)
class _Flight:
    """One computation in flight that identical items wait on; ``waiters`` counts the
    ``infer`` calls waiting, and the last to give up cancels it (no compute for nobody)."""

    work: WorkItem
    waiters: int = 1
    shared_key: str | None = None  # its key in the shared tier, where it is looked up


@dataclass(slots=True)
class BatchStats:
    items: int
    padded_tokens: int
    real_tokens: int
    inference_s: float


class ModelRunner:
    def __init__(self, adapter: Adapter, *, tokenize_pool: ThreadPoolExecutor,
                 infer_pool: ThreadPoolExecutor | None = None, passes: int = 1,
                 autocast_dtype: torch.dtype | None = None,
                 on_batch: Callable[[BatchStats], None] | None = None,
                 arrivals_open: Callable[[], bool] | None = None,
                 results: ResultCache | None = None) -> None:
        self.adapter = adapter
        profile = adapter.profile
        self.batcher = TokenBudgetBatcher(
            max_batch_tokens=profile.max_batch_tokens, max_batch_items=profile.max_batch_items,
            max_wait_s=profile.max_wait_ms / 1000.0, max_queue_items=profile.max_queue_items,
            packed=adapter.packed, arrivals_open=arrivals_open)
        self._tokenize_pool = tokenize_pool
        # ``infer_pool``: the CPU models' shared inference threads (ModelRegistry says why
        # they are few), ``passes`` of them; else (CUDA) a thread of the model's own.
        self._own_pool = infer_pool is None
        self._infer_pool = infer_pool or ThreadPoolExecutor(
            1, thread_name_prefix=f"infer-{adapter.name}")
        self.passes = 1 if infer_pool is None else max(1, passes)
        self._autocast_dtype = autocast_dtype
        self._on_batch = on_batch
        # Passes share the model; a LoRA adapter's install changes it, alone (the gate).
        self._gate = PassGate()
        self.loras = LoraSet(adapter, self._infer_pool, self._gate)
        self._trimmer = HeapTrimmer()
        self._task: asyncio.Task | None = None
        self._finishing: set[asyncio.Task[None]] = set()  # passes > 1: their deliveries
        self.in_flight = 0
        self.in_forward = 0  # items of the batches on the inference threads now
        self.passes_running = 0
        # The worker's result cache (None or disabled: every item is computed). Extract is
        # not cached: its items carry labels and character offsets beyond their tokens.
        self.results = results if results is not None and results.enabled and \
            adapter.task != "extract" and adapter.cacheable else None
        self.cache_scope = f"{adapter.config.id}#{next(_SCOPES)}"
        self._flights: dict[Key, _Flight] = {}
        # The shared tier's key prefix (``share``): None while this model does not use it.
        self.shared_identity: SharedIdentity | None = None
        self.shared_scope: str | None = None
        self._lookups: set[asyncio.Task[None]] = set()

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
        for task in list(self._finishing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.invalidate_results()  # unloaded: its outputs are no use to anyone
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
                    deadline: float | None = None, lora: Any = None,
                    cache: bool = True) -> list[ItemResult]:
        """``lora``: the LoRA adapter (``LoraSet.use``) every item is computed with.
        ``cache`` False (the request's ``cache`` option): no lookup, no sharing, no store.

        An item that joins a computation in flight waits for that item's batch (at that
        item's priority); the computation's deadline becomes the latest of its waiters'
        (each caller still times out on its own deadline, service.py)."""
        if self._task is None:  # evicted between picking this runner and now
            raise HeronError(ErrorCode.MODEL_LOADING, f"model {self.adapter.config.id} was "
                             "unloaded to free memory and is loading again",
                             retry_after_s=2.0)
        loop = asyncio.get_running_loop()
        results = self.results if cache else None
        # Per item: its answer now (a cache hit), or the future it waits on, and whether
        # that future is another item's computation (then the item says cached).
        slots: list[ItemResult | asyncio.Future] = []
        shared: list[bool] = []
        work: list[WorkItem] = []
        new: dict[Key, _Flight] = {}
        joined: set[_Flight] = set()  # flights this call waits on (its own new ones too)
        self.in_flight += 1
        try:
            for t in items:
                key = self._key(t, lora) if results is not None else None
                if key is not None and results is not None:
                    value = results.get(key)
                    if value is not None:
                        results.stats.hits += 1
                        slots.append(ItemResult(value, 0.0, 0.0, cached=True))
                        shared.append(True)
                        continue
                    flight = new.get(key) or self._flights.get(key)
                    if flight is not None:
                        results.stats.joins += 1
                        if flight not in joined and key not in new:
                            flight.waiters += 1
                            joined.add(flight)
                            w = flight.work
                            w.deadline = None if w.deadline is None or deadline is None \
                                else max(w.deadline, deadline)
                        slots.append(flight.work.future)
                        shared.append(True)
                        continue
                w = WorkItem(payload=t, length=t.length, priority=priority, deadline=deadline,
                             future=loop.create_future(), lora=lora)
                work.append(w)
                slots.append(w.future)
                shared.append(False)
                if key is not None:
                    new[key] = _Flight(w)
            tier = results.shared if results is not None and lora is None else None
            scope = self.shared_scope
            if new and tier is not None and scope is not None:
                # In flight before the lookup: identical items arriving meanwhile join it.
                for key, flight in new.items():
                    flight.shared_key = shared_key(scope, key[1])
                    self._fly(key, flight, joined)
                task = loop.create_task(self._look_up_shared(tier, list(new.values()), work))
                self._lookups.add(task)
                task.add_done_callback(self._lookups.discard)
            else:
                if work:
                    self.batcher.submit(work)  # 429 QUEUE_FULL: nothing of this call queued
                for key, flight in new.items():
                    self._fly(key, flight, joined)
                if results is not None:
                    results.stats.misses += len(new)
            return await self._gather(slots, shared)
        finally:
            self.in_flight -= 1
            flying = {id(f.work) for f in joined}
            for w in work:  # a caller that gave up (timeout) leaves nothing to compute
                if id(w) not in flying and not w.future.done():
                    w.future.cancel()
            for flight in joined:  # ... unless another caller still waits for it
                flight.waiters -= 1
                if flight.waiters == 0 and not flight.work.future.done():
                    flight.work.future.cancel()

    def _fly(self, key: Key, flight: _Flight, joined: set[_Flight]) -> None:
        self._flights[key] = flight
        joined.add(flight)
        flight.work.future.add_done_callback(
            lambda future, k=key, f=flight: self._landed(k, f, future))

    async def _look_up_shared(self, tier: SharedResults, flights: list[_Flight],
                              work: list[WorkItem]) -> None:
        """Answer what the shared tier has (``cached``), then queue the rest of ``work``.
        A task of its own, not the caller's: a caller that gives up mid-lookup must not
        leave the items others joined meanwhile with nothing computing them. ``get_many``
        never raises and returns within the tier's timeout."""
        hits = 0
        try:
            found = await tier.get_many([f.shared_key or "" for f in flights])
            for flight, value in zip(flights, found, strict=True):
                if value is not None and not flight.work.future.done():
                    flight.work.future.set_result(ItemResult(value, 0.0, 0.0, cached=True))
                    hits += 1
        finally:
            if self.results is not None:
                self.results.stats.shared += hits
                self.results.stats.misses += len(flights) - hits
            rest = [w for w in work if not w.future.done()]  # not given up, not found
            try:
                if rest:
                    self.batcher.submit(rest)
            except Exception as exc:  # 429 QUEUE_FULL: for every waiter of these items
                for w in rest:
                    w.future.set_exception(exc)

    @staticmethod
    async def _gather(slots: list[ItemResult | asyncio.Future], shared: list[bool]
                      ) -> list[ItemResult]:
        """The items' results in order; the first error raises. ``asyncio.wait``, not
        ``gather``: a caller cancelled here must not cancel futures others wait on."""
        pending = {s for s in slots if isinstance(s, asyncio.Future) and not s.done()}
        if pending:
            await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for s in slots:
            if isinstance(s, asyncio.Future) and s.done() and s.exception() is not None:
                raise s.exception()  # type: ignore[misc]
        out = []
        for s, joined in zip(slots, shared, strict=True):
            if isinstance(s, ItemResult):
                out.append(s)
                continue
            r: ItemResult = s.result()
            out.append(ItemResult(r.value, r.queue_s, r.inference_s, cached=True)
                       if joined else r)
        return out

    def _key(self, item: Tokenized, lora: Any) -> Key | None:
        """The item's result-cache key; None for what tokens alone do not describe (an
        image's pixels, a refused item: subclasses of Tokenized)."""
        if type(item) is not Tokenized:
            return None
        return self.cache_scope, item_digest(item.input_ids, item.token_type_ids, item.query,
                                             item.prompt_tokens, item.special_mask, lora)

    def _landed(self, key: Key, flight: _Flight, future: asyncio.Future) -> None:
        """A computation others could wait on finished: keep its output (unless the model
        was reconfigured or unloaded meanwhile: its scope is gone)."""
        if self._flights.get(key) is flight:
            del self._flights[key]
        if future.cancelled() or future.exception() is not None or self.results is None:
            return
        if key[0] == self.cache_scope:
            result: ItemResult = future.result()
            self.results.put(key, result.value)
            tier = self.results.shared
            if tier is not None and flight.shared_key is not None and not result.cached:
                tier.store(flight.shared_key, result.value)  # in the background

    def share(self, identity: SharedIdentity, config: ModelConfig) -> None:
        """Use the shared tier for this model (ModelRegistry, once its weights' digest is
        known), with keys for ``config``."""
        self.shared_identity = identity
        self.shared_scope = identity.scope(config)

    def invalidate_results(self, config: ModelConfig | None = None) -> None:
        """The model's config changed (to ``config``), or it unloads (None): its cached
        outputs can never be served again (a new scope), and their bytes are freed now.
        Computations in flight still answer their callers, but nothing new joins them and
        they are not kept. The shared tier's keys follow the new config (another worker
        with the same config and weights shares them); without one, it is not used."""
        old, self.cache_scope = self.cache_scope, f"{self.adapter.config.id}#{next(_SCOPES)}"
        identity = self.shared_identity
        self.shared_scope = None if identity is None or config is None \
            else identity.scope(config)
        self._flights.clear()
        if self.results is not None:
            self.results.drop_scope(old)

    # ---- the one task that owns the queue ----------------------------------------------
    async def _serve(self) -> None:
        """Form a batch from everything queued while the previous one ran, run it, deliver.
        (Forming the next batch early, while one runs, was measured: smaller batches, 10%
        fewer items/s at 32 clients. Waiting for the model to be free batches better.)
        With ``passes`` > 1, "free" is one of the model's threads: a batch forms as soon as
        one is, and its delivery runs on a task of its own while the next batch forms."""
        loop = asyncio.get_running_loop()
        free = asyncio.Semaphore(self.passes)
        while True:
            await free.acquire()
            try:
                batch = await self.batcher.next_batch(
                    None if self.passes == 1 else self._free_passes)
            except BaseException:
                free.release()
                raise
            self.in_forward += len(batch)
            self.passes_running += 1
            future = loop.run_in_executor(self._infer_pool, self._run_batch,
                                          [w.payload for w in batch], [w.lora for w in batch])
            if self.passes == 1:  # no task a pass where passes cannot overlap
                await self._finish(batch, future, free)
                continue
            task = loop.create_task(self._finish(batch, future, free))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    def _free_passes(self) -> int:
        """Passes that could start now, the one forming included."""
        return max(1, self.passes - self.passes_running)

    async def _finish(self, batch: list[WorkItem], future: asyncio.Future,
                      free: asyncio.Semaphore) -> None:
        try:
            await self._deliver(batch, future)
        finally:
            self.in_forward -= len(batch)
            self.passes_running -= 1
            free.release()

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
        with self._gate.forward_pass(), torch.inference_mode():
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
