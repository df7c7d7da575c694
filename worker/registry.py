"""ModelRegistry: the models a worker serves, their load state and their runners.

Names resolve through ids and aliases. Loading runs off the event loop (weights resolve,
the model loads, one warm-up forward pass); a request for a model that is not loaded yet
starts its load and gets 503 MODEL_LOADING with Retry-After.

Memory (worker/memory.py): every use touches a model. Before a load, and every second,
the least recently used idle model is evicted while memory is over the threshold or the
models' weights over the budget; a model with work queued or running is never evicted, and
a request for an evicted model loads it again. A load failure is permanent (bad config or
weights: FAILED, 502, no retry) or transient (memory: 503 + Retry-After, tried again).
Over the memory threshold, the result cache (worker/result_cache.py) is emptied before any
model is evicted; a model's cached outputs go when it unloads or its config changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import torch

from heron.runtime import heap
from heron.runtime.adapters import AUTO
from heron.runtime.checkpoint import CheckpointError, detect_family, read_checkpoint
from heron.runtime.modelconfig import Bundle, ModelConfig, Profile
from heron.worker.adapters import adapter_class
from heron.worker.cpus import pin_this_thread
from heron.worker.memory import (
    InsufficientMemory,
    MemoryPolicy,
    memory_used_percent,
    module_bytes,
    weights_bytes,
)
from heron.worker.result_cache import ResultCache
from heron.worker.runner import BatchStats, ModelRunner
from heron.worker.shared_results import identify, start_digest
from heron.worker.weight_cache import unpin_weights
from heron.worker.weights import (
    WeightsTemporarilyUnavailable,
    WeightsUnavailable,
    resolve_weights,
    wait_for_uploads,
)
from heron_sdk.errors import ErrorCode, HeronError

log = logging.getLogger("heron.worker.registry")

T = TypeVar("T")

# The longest a request waits for an evicted model to load again before a 503.
RELOAD_WAIT_MAX_S = 30.0
# Load failures worth another try later; anything else is permanent.
TRANSIENT_LOAD_ERRORS: tuple[type[BaseException], ...] = (
    InsufficientMemory, MemoryError, torch.OutOfMemoryError, WeightsTemporarilyUnavailable)


class LoadState(StrEnum):
    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass(slots=True)
class ModelEntry:
    config: ModelConfig
    state: LoadState = LoadState.NOT_LOADED
    runner: ModelRunner | None = None
    error: str | None = None
    load_task: asyncio.Task | None = None
    load_seconds: float | None = None
    device: str | None = None
    dtype: str | None = None
    last_used: float = 0.0
    resident_bytes: int = 0  # weights and buffers while loaded; the estimate for a reload
    loaded_once: bool = False
    retry_at: float | None = None  # a transient load failure: not before this (monotonic)
    weights_path: Any = None  # pinned in the weight cache while loaded
    items_done: int = 0  # items computed since the worker started (heartbeat counter)

    @property
    def idle(self) -> bool:
        runner = self.runner
        return runner is not None and runner.in_flight == 0 and len(runner.batcher) == 0


def select_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise WeightsUnavailable("device cuda requested but CUDA is not available")
        use_cudnn_attention(os.environ)
        return torch.device("cuda")
    return torch.device("cpu")


def use_cudnn_attention(env: Mapping[str, str]) -> bool:
    """Whether torch's attention (SDPA) may pick cuDNN's kernel on CUDA (set in torch and
    returned): not unless ``HERON_CUDNN_ATTENTION=1``. cuDNN builds a plan for each new
    (batch, length) shape, and a server's batches keep bringing new ones: on an H200
    (torch 2.11, BERT-base, fp16) a forward pass of a shape not seen before took 68 ms
    (median; up to 1.1 s) against 9 ms without cuDNN, and `heron serve` made 3,078
    against 1,248 items/s (64 texts a request, 16 clients; bench/gpu_check.py). Passes of
    shapes seen before ran the same (5.3 against 5.6 ms)."""
    allowed = env.get("HERON_CUDNN_ATTENTION", "0").strip() == "1"
    torch.backends.cuda.enable_cudnn_sdp(allowed)
    return allowed


def select_precision(precision: str,
                     device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(weights dtype, autocast dtype). ``auto``: fp16 weights on CUDA; on CPU, bf16 through
    autocast where the CPU computes bf16 natively (AMX or AVX512-BF16: measured about 2x
    MiniLM's fp32 throughput, embeddings within cosine 0.9999), else fp32."""
    if precision == "auto" and device.type == "cuda":
        precision = "fp16"
    elif precision == "auto":
        precision = "bf16" if cpu_has_native_bf16() else "fp32"
    if precision == "fp16":
        if device.type != "cuda":
            raise WeightsUnavailable("precision fp16 needs CUDA; use bf16 or fp32 on CPU")
        return torch.float16, None
    if precision == "bf16":
        return (torch.bfloat16, None) if device.type == "cuda" else (torch.float32,
                                                                     torch.bfloat16)
    return torch.float32, None


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AMX-BF16 or AVX512-BF16 (Linux /proc/cpuinfo); elsewhere, emulated bf16 is slower
    than fp32, so no."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class ModelRegistry:
    def __init__(self, bundle: Bundle, *, device: str | None = None,
                 precision: str | None = None,
                 extra_models: list[ModelConfig] | None = None,
                 tokenize_threads: int | None = None,
                 on_batch: Callable[[str, BatchStats], None] | None = None,
                 memory: MemoryPolicy | None = None,
                 on_evict: Callable[[str, str], None] | None = None,
                 on_load: Callable[[str, str, float], None] | None = None,
                 inference_cpus: frozenset[int] | None = None,
                 inference_threads: int = 1,
                 results: ResultCache | None = None) -> None:
        self.bundle = bundle
        self.results = results if results is not None else ResultCache(0)  # all models share it
        self.memory = memory or MemoryPolicy.from_env()
        self._on_evict = on_evict
        self._on_load = on_load  # (model id, "loaded" | "retry" | "failed", seconds)
        self._monitor: asyncio.Task | None = None
        self.device_override = device
        self.precision_override = precision
        self._entries: dict[str, ModelEntry] = {}
        self._names: dict[str, str] = {}
        for config in (*bundle.models, *(extra_models or [])):
            self._entries[config.id] = ModelEntry(config)
            for name in (config.id, *config.aliases):
                self._names[name] = config.id
        # Ready means these are warm; models added later load without taking readiness away.
        self._required = tuple(bundle.preload if bundle.preload is not None
                               else [m.id for m in bundle.models])
        threads = tokenize_threads or max(2, min(4, os.cpu_count() or 2))
        self._tokenize_pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._on_batch = on_batch
        # One load at a time: transformers' from_pretrained patches torch globally while it
        # builds a model (meta-device init), so concurrent loads in threads corrupt each other.
        self._load_lock = asyncio.Lock()
        # CPU forward passes run on ``inference_threads`` threads (1 by default), shared by
        # every CPU model. Every OS thread that runs torch ops gets its own OpenMP team,
        # whose workers spin between regions: two live teams of several threads on a small
        # CPU halve throughput (measured: MiniLM single-item forward 6.9 ms -> 14.4 ms once
        # a second thread had run one forward pass). So several inference threads are for
        # one torch thread each (heron up's default: one per usable CPU), where a team is
        # just the thread itself. Loads run on a fresh thread that exits.
        # inference_cpus (worker.cpus): the threads pin themselves; their teams inherit.
        self.inference_threads = max(1, inference_threads)
        self._cpu_infer_pool = ThreadPoolExecutor(
            self.inference_threads, thread_name_prefix="infer-cpu",
            initializer=None if inference_cpus is None else pin_this_thread,
            initargs=() if inference_cpus is None else (inference_cpus,))
        # Set in queue mode (WorkerCluster): False while the worker may fetch no more work.
        self.arrivals_open: Callable[[], bool] | None = None

    # ---- lookups -----------------------------------------------------------------------
    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def entry(self, name: str) -> ModelEntry:
        model_id = self._names.get(name)
        if model_id is None:
            raise HeronError(ErrorCode.MODEL_NOT_FOUND,
                             f"model {name!r} is not served here; GET /v1/models lists them")
        return self._entries[model_id]

    def canonical_id(self, name: str) -> str | None:
        """The model id behind a name or alias (None if not served here)."""
        return self._names.get(name)

    def runner(self, name: str) -> tuple[ModelEntry, ModelRunner]:
        """The ready runner for a model (touched: it is the most recently used now), or
        503 MODEL_LOADING (load started) / 503 INSUFFICIENT_MEMORY / 502."""
        entry = self.entry(name)
        entry.last_used = time.monotonic()
        if entry.state is LoadState.READY and entry.runner is not None:
            return entry, entry.runner
        if entry.state is LoadState.FAILED:
            raise HeronError(ErrorCode.MODEL_LOAD_FAILED,
                             f"model {entry.config.id} failed to load: {entry.error}")
        wait = 0.0 if entry.retry_at is None else entry.retry_at - time.monotonic()
        if wait > 0 and entry.state is LoadState.NOT_LOADED:
            raise HeronError(ErrorCode.INSUFFICIENT_MEMORY,
                             f"model {entry.config.id} cannot load now: {entry.error}",
                             retry_after_s=max(1.0, wait))
        self.start_load(entry)
        raise HeronError(ErrorCode.MODEL_LOADING, f"model {entry.config.id} is loading",
                         retry_after_s=2.0)

    async def acquire(self, name: str) -> tuple[ModelEntry, ModelRunner]:
        """``runner``, except that a request for a model evicted earlier waits for its
        reload (bounded by how long its first load took) instead of a 503: an eviction is
        the worker's business, not the caller's."""
        try:
            return self.runner(name)
        except HeronError as exc:
            entry = self.entry(name)
            task = entry.load_task
            if (exc.code is not ErrorCode.MODEL_LOADING or task is None
                    or not entry.loaded_once):
                raise
            wait_s = min(RELOAD_WAIT_MAX_S, 3 * (entry.load_seconds or 1.0) + 1.0)
            try:
                await asyncio.wait_for(asyncio.shield(task), wait_s)
            except TimeoutError:
                raise exc from None
            return self.runner(name)

    @property
    def ready(self) -> bool:
        """Every required model warmed up once (an evicted one loads again on demand)."""
        return all(self.entry(n).loaded_once and self.entry(n).state is not LoadState.FAILED
                   for n in self._required)

    def resident_bytes(self) -> int:
        """Loaded models' weights, their LoRA adapters' included."""
        return sum(e.resident_bytes + (e.runner.loras.resident_bytes if e.runner else 0)
                   for e in self._entries.values() if e.state is LoadState.READY)

    def apply_bundle(self, bundle: Bundle) -> list[str]:
        """The bundle as the config service now has it: models it gained are added and
        start loading at once (no restart); known ones take the new config (profiles are
        only ever added). Returns the ids added."""
        added = []
        for config in bundle.models:
            entry = self._entries.get(config.id)
            if entry is None:
                self._entries[config.id] = ModelEntry(config)
                added.append(config.id)
            else:
                if entry.config != config and entry.runner is not None:
                    # never an answer of the old config, here or from the shared tier
                    entry.runner.invalidate_results(config)
                entry.config = config  # its runner's LoRA adapters read it from here
            for name in (config.id, *config.aliases):
                self._names.setdefault(name, config.id)
        self.bundle = bundle
        for model_id in added:
            self.start_load(self._entries[model_id])
        return added

    # ---- loading -----------------------------------------------------------------------
    def start_load(self, entry: ModelEntry) -> asyncio.Task:
        if entry.load_task is None:
            entry.state = LoadState.LOADING
            entry.load_task = asyncio.get_running_loop().create_task(self._load(entry))
        return entry.load_task

    async def load_all(self) -> None:
        wanted = self.bundle.preload if self.bundle.preload is not None else list(self._entries)
        await asyncio.gather(*(self.start_load(self.entry(n)) for n in wanted))

    async def _load(self, entry: ModelEntry) -> None:
        config = entry.config
        started = time.monotonic()
        try:
            async with self._load_lock:
                # Pinned: the weight cache's own cleanup leaves a loaded model's files alone.
                entry.weights_path = await run_in_fresh_thread(
                    functools.partial(resolve_weights, config, pin=True))
                path = entry.weights_path
                # The shared result cache's key needs the weights' digest: hashed meanwhile.
                digest = start_digest(path) if self.results.shared is not None else None
                await self._make_room(entry, entry.resident_bytes or weights_bytes(path))
                runner = await run_in_fresh_thread(self._load_blocking, entry, path)
                await runner.warm_up()
                if digest is not None and (identity := await identify(
                        digest, config.id, runner.adapter.profile, runner.adapter.name,
                        entry.device or "", entry.dtype or "")) is not None:
                    runner.share(identity, entry.config)
        except TRANSIENT_LOAD_ERRORS as exc:
            # Memory comes back (other models go idle, a neighbour exits), a throttled store
            # answers again: try again later, on demand.
            self._unpin(entry)
            retry_s = getattr(exc, "retry_after_s", None) or self.memory.retry_after_s
            entry.state, entry.load_task = LoadState.NOT_LOADED, None
            entry.error = f"{type(exc).__name__}: {exc}"
            entry.retry_at = time.monotonic() + retry_s
            log.warning("model %s cannot load now (retrying on demand in %.0fs): %s",
                        config.id, retry_s, entry.error)
            self._loaded(config.id, "retry", started)
            gc.collect()
            return
        except Exception as exc:
            self._unpin(entry)
            entry.state = LoadState.FAILED
            entry.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to load: %s", config.id, entry.error)
            self._loaded(config.id, "failed", started)
            return
        runner.start()
        entry.runner, entry.retry_at, entry.error = runner, None, None
        entry.resident_bytes = module_bytes(runner.adapter.model)
        entry.load_seconds = time.monotonic() - started
        entry.last_used = time.monotonic()
        entry.state, entry.loaded_once = LoadState.READY, True
        heap.settle()  # the model's objects leave the collector's full walks
        log.info("model %s ready on %s in %.1fs (%.0f MB)", config.id, entry.device,
                 entry.load_seconds, entry.resident_bytes / 1e6)
        self._loaded(config.id, "loaded", started)

    def _loaded(self, model: str, result: str, started: float) -> None:
        if self._on_load is not None:
            self._on_load(model, result, time.monotonic() - started)

    def _load_blocking(self, entry: ModelEntry, path: Any) -> ModelRunner:
        config = entry.config
        profile: Profile = config.profile
        device = select_device(self.device_override or profile.device)
        weights_dtype, autocast_dtype = select_precision(
            self.precision_override or profile.precision, device)
        checkpoint = read_checkpoint(path)
        family = detect_family(checkpoint) if config.adapter == AUTO else config.adapter
        if family not in self.bundle.adapters:
            raise CheckpointError(f"the checkpoint is a {family} model, which bundle "
                                  f"{self.bundle.name} does not serve (it serves "
                                  f"{', '.join(self.bundle.adapters)})")
        adapter = adapter_class(family)(config, profile, checkpoint)
        adapter.load(path, device, weights_dtype)
        if adapter.supports_packing and adapter.packing_refused:
            log.info("model %s: batches padded, not packed: %s", config.id,
                     adapter.packing_refused)
        if autocast_dtype is not None:
            adapter.store_matmul_weights(autocast_dtype)
        model_id = config.id

        def on_batch(stats: BatchStats) -> None:
            entry.items_done += stats.items  # on the event loop (ModelRunner._deliver)
            if self._on_batch is not None:
                self._on_batch(model_id, stats)

        # On CUDA each model gets its own inference thread; on CPU they share the pool.
        runner = ModelRunner(adapter, tokenize_pool=self._tokenize_pool,
                             infer_pool=self._cpu_infer_pool if device.type == "cpu" else None,
                             passes=self.inference_threads,
                             autocast_dtype=autocast_dtype, on_batch=on_batch,
                             arrivals_open=self._arrivals_open, results=self.results)
        # LoRA adapters: the entry's config as deltas update it, and a load evicts other
        # idle models if memory needs it.
        runner.loras.config_of = lambda: entry.config
        runner.loras.make_room = functools.partial(self._make_room, entry)
        entry.device = str(device)
        entry.dtype = str(autocast_dtype or weights_dtype).removeprefix("torch.")
        return runner

    def _arrivals_open(self) -> bool:
        return self.arrivals_open is None or self.arrivals_open()

    # ---- eviction ----------------------------------------------------------------------
    def _over(self, extra_bytes: int = 0) -> str | None:
        """Why memory is over its limits with ``extra_bytes`` more loaded (None: it is not)."""
        budget = self.memory.budget_bytes
        if budget is not None and self.resident_bytes() + extra_bytes > budget:
            return "budget"
        if memory_used_percent(self._device()) >= self.memory.threshold_percent:
            return "memory"
        return None

    def _device(self) -> str:
        return self.device_override if self.device_override not in (None, "auto") else (
            "cuda" if torch.cuda.is_available() else "cpu")

    def _shed_results(self) -> bool:
        """Over the memory threshold on CPU: empty the result cache first (host memory:
        it frees nothing on a GPU). Outputs are cheaper to compute again than a model is
        to load again."""
        if not self.results.bytes or self._device() != "cpu":
            return False
        log.info("memory over the threshold: result cache emptied (%.0f MB)",
                 self.results.clear() / 1e6)
        return True

    def _lru_idle(self, keep: ModelEntry | None = None) -> ModelEntry | None:
        idle = [e for e in self._entries.values()
                if e is not keep and e.state is LoadState.READY and e.idle]
        return min(idle, key=lambda e: e.last_used, default=None)

    async def _make_room(self, entry: ModelEntry, needed_bytes: int) -> None:
        """Evict LRU idle models until ``needed_bytes`` more fit; InsufficientMemory if
        they cannot (every other model is busy)."""
        while (reason := self._over(needed_bytes)) is not None:
            if reason == "memory" and self._shed_results():
                continue
            victim = self._lru_idle(keep=entry)
            if victim is None:
                raise InsufficientMemory(
                    f"over the {self._limit_text(reason)} with no idle model to evict "
                    f"(needs about {needed_bytes / 1e6:.0f} MB)")
            await self.evict(victim, reason)

    def _limit_text(self, reason: str) -> str:
        if reason == "budget":
            return f"model memory budget ({self.memory.budget_bytes / 1e6:.0f} MB)"
        return f"memory threshold ({self.memory.threshold_percent:g}% used)"

    @staticmethod
    def _unpin(entry: ModelEntry) -> None:
        if entry.weights_path is not None:
            unpin_weights(entry.weights_path)
            entry.weights_path = None

    async def evict(self, entry: ModelEntry, reason: str) -> None:
        """Unload an idle model; its next request loads it again."""
        runner = entry.runner
        entry.state, entry.runner, entry.load_task = LoadState.NOT_LOADED, None, None
        if runner is not None:
            await runner.stop()
            runner.adapter.release()
        self._unpin(entry)
        heap.release()  # the model's objects were frozen when it loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("evicted model %s (%s; %.0f MB)", entry.config.id, reason,
                 entry.resident_bytes / 1e6)
        if self._on_evict is not None:
            self._on_evict(entry.config.id, reason)

    async def _watch_memory(self) -> None:
        """Every second: evict LRU idle models while over the threshold or budget, and
        models idle past HERON_IDLE_EVICT_S."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if self.results.bytes and self._over() == "memory":
                    self._shed_results()
                while (reason := self._over()) is not None and (
                        victim := self._lru_idle()) is not None:
                    await self.evict(victim, reason)
                idle_s = self.memory.idle_evict_s
                if idle_s is not None:
                    now = time.monotonic()
                    for e in list(self._entries.values()):
                        if e.state is LoadState.READY and e.idle and now - e.last_used > idle_s:
                            await self.evict(e, "idle")
            except Exception:  # the watcher must outlive any one failure
                log.exception("memory watch failed")

    def start_memory_watch(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_memory())

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for entry in self._entries.values():
            if entry.load_task is not None and not entry.load_task.done():
                entry.load_task.cancel()
            if entry.runner is not None:
                await entry.runner.stop()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._cpu_infer_pool.shutdown(wait=False, cancel_futures=True)
        # A read-through upload to the S3 weight cache in progress gets a moment to finish.
        await asyncio.get_running_loop().run_in_executor(None, wait_for_uploads, 10.0)


async def run_in_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` on a new thread that ends with it (so no OpenMP team outlives the call)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=target, name="load", daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
