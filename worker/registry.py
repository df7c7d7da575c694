"""ModelRegistry: the models a worker serves, their load state and their runners.

Names resolve through ids and aliases. Loading runs off the event loop (weights resolve,
the model loads, one warm-up forward pass); a request for a model that is not loaded yet
starts its load and gets 503 MODEL_LOADING with Retry-After. LRU eviction joins with #6.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import torch

from sdk.errors import ErrorCode, HeronError
from sdk.modelconfig import Bundle, ModelConfig, Profile
from worker.adapters import ADAPTERS
from worker.runner import BatchStats, ModelRunner
from worker.weights import WeightsUnavailable, resolve_weights

log = logging.getLogger("heron.worker.registry")

T = TypeVar("T")


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


def select_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise WeightsUnavailable("device cuda requested but CUDA is not available")
        return torch.device("cuda")
    return torch.device("cpu")


def select_precision(precision: str,
                     device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(weights dtype, autocast dtype). fp16 weights on CUDA; bf16 on CPU via autocast."""
    if precision == "auto":
        precision = "fp16" if device.type == "cuda" else "fp32"
    if precision == "fp16":
        if device.type != "cuda":
            raise WeightsUnavailable("precision fp16 needs CUDA; use bf16 or fp32 on CPU")
        return torch.float16, None
    if precision == "bf16":
        return (torch.bfloat16, None) if device.type == "cuda" else (torch.float32,
                                                                     torch.bfloat16)
    return torch.float32, None


class ModelRegistry:
    def __init__(self, bundle: Bundle, *, device: str | None = None,
                 extra_models: list[ModelConfig] | None = None,
                 tokenize_threads: int | None = None,
                 on_batch: Callable[[str, BatchStats], None] | None = None) -> None:
        self.bundle = bundle
        self.device_override = device
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
        # All CPU forward passes run on ONE thread. Every OS thread that runs torch ops gets
        # its own OpenMP team, whose workers spin between regions: two live teams on a small
        # CPU halve throughput (measured: MiniLM single-item forward 6.9 ms -> 14.4 ms once
        # a second thread had run one forward pass). Loads run on a fresh thread that exits.
        self._cpu_infer_pool = ThreadPoolExecutor(1, thread_name_prefix="infer-cpu")

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
        """The ready runner for a model, or 503 MODEL_LOADING (load started) / 502."""
        entry = self.entry(name)
        if entry.state is LoadState.READY and entry.runner is not None:
            entry.last_used = time.monotonic()
            return entry, entry.runner
        if entry.state is LoadState.FAILED:
            raise HeronError(ErrorCode.MODEL_LOAD_FAILED,
                             f"model {entry.config.id} failed to load: {entry.error}")
        self.start_load(entry)
        raise HeronError(ErrorCode.MODEL_LOADING, f"model {entry.config.id} is loading",
                         retry_after_s=2.0)

    @property
    def ready(self) -> bool:
        return all(self.entry(n).state is LoadState.READY for n in self._required)

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
                entry.config = config
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
                runner = await run_in_fresh_thread(self._load_blocking, entry)
                await runner.warm_up()
        except Exception as exc:
            entry.state = LoadState.FAILED
            entry.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to load: %s", config.id, entry.error)
            return
        runner.start()
        entry.runner = runner
        entry.load_seconds = time.monotonic() - started
        entry.state = LoadState.READY
        log.info("model %s ready on %s in %.1fs", config.id, entry.device, entry.load_seconds)

    def _load_blocking(self, entry: ModelEntry) -> ModelRunner:
        config = entry.config
        profile: Profile = config.profile
        device = select_device(self.device_override or profile.device)
        weights_dtype, autocast_dtype = select_precision(profile.precision, device)
        path = resolve_weights(config)
        adapter = ADAPTERS[config.adapter](config, profile)
        adapter.load(path, device, weights_dtype)
        model_id = config.id

        def on_batch(stats: BatchStats) -> None:
            if self._on_batch is not None:
                self._on_batch(model_id, stats)

        # On CUDA each model gets its own inference thread; on CPU they share one.
        runner = ModelRunner(adapter, tokenize_pool=self._tokenize_pool,
                             infer_pool=self._cpu_infer_pool if device.type == "cpu" else None,
                             autocast_dtype=autocast_dtype, on_batch=on_batch)
        entry.device = str(device)
        entry.dtype = str(autocast_dtype or weights_dtype).removeprefix("torch.")
        return runner

    async def close(self) -> None:
        for entry in self._entries.values():
            if entry.load_task is not None and not entry.load_task.done():
                entry.load_task.cancel()
            if entry.runner is not None:
                await entry.runner.stop()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._cpu_infer_pool.shutdown(wait=False, cancel_futures=True)


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
