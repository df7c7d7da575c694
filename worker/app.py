"""The worker's HTTP API: the single-node inference server (``heron serve``) and a cluster
worker's own API (``heron worker``).

``LocalBackend`` is the inference API's local backend (heron.runtime.front): it answers
from this process's models (ModelRegistry, InferenceService); the front owns the HTTP.
Errors are HeronErrors and go through the one handler in heron.runtime.http.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psutil
from starlette.applications import Starlette

from heron.runtime import telemetry
from heron.runtime.backend import (
    Answer,
    InferenceCall,
    Readiness,
    model_description,
    settle_item_errors,
)
from heron.runtime.inference_app import build_inference_app
from heron.runtime.logs import adopt_library_logs
from heron.runtime.modelconfig import Bundle, ModelConfig
from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron.worker.cluster import WorkerCluster
from heron.worker.metrics import WorkerMetrics, mark_process_dead, multiprocess_dir
from heron.worker.registry import LoadState, ModelEntry, ModelRegistry
from heron.worker.result_cache import ResultCache
from heron.worker.service import InferenceService, Outcome
from heron.worker.settings import WorkerSettings
from heron.worker.shared_results import SharedResults
from heron.worker.tokens import TokenService
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import EncodeRequest, ExtractRequest, RequestOptions, ScoreRequest

log = logging.getLogger("heron.worker")


@dataclass(frozen=True, slots=True)
class QueueMode:
    """Cluster mode: also pull work from the pool's JetStream consumer."""

    nats_url: str
    pool: str
    worker_id: str
    address: str = ""  # where this worker's own HTTP API listens (for status)
    config_url: str | None = None  # follow the config service: models added live


def _answer(outcome: Outcome) -> Answer:
    timings = outcome.timings
    return Answer(outcome.body, outcome.model, timings.phases(), timings.total)


class LocalBackend:
    """This process's models behind the inference API, and the worker's lifespan (load,
    memory watch, the NATS side in queue mode)."""

    telemetry_scope = telemetry.WORKER
    log = log

    def __init__(self, bundle: Bundle, *, device: str | None = None,
                 precision: str | None = None,
                 extra_models: list[ModelConfig] | None = None,
                 queue: QueueMode | None = None,
                 inference_cpus: frozenset[int] | None = None,
                 inference_threads: int = 1,
                 settings: WorkerSettings | None = None) -> None:
        adopt_library_logs()  # transformers is imported by now: JSON logs stay JSON
        self.metrics = WorkerMetrics()
        self.settings = settings or WorkerSettings.from_env()
        s = self.settings
        results = ResultCache(s.result_cache_bytes)
        # The shared tier needs NATS (queue mode; WorkerCluster binds its bucket) and the
        # local cache it sits behind.
        if queue is not None and s.result_cache_shared_bytes > 0 and results.enabled:
            results.shared = SharedResults(s.result_cache_shared_bytes,
                                           s.result_cache_shared_ttl_s,
                                           s.result_cache_shared_timeout_s)
        self.registry = ModelRegistry(bundle, device=device, precision=precision,
                                      extra_models=extra_models,
                                      on_batch=self.metrics.observe_batch,
                                      on_evict=self.metrics.observe_eviction,
                                      on_load=self.metrics.observe_load,
                                      inference_cpus=inference_cpus,
                                      inference_threads=inference_threads,
                                      results=results)
        self.service = InferenceService(self.registry, on_phases=self.metrics.observe_phases)
        self.tokens = TokenService(self.registry)
        self.queue = queue
        self.cluster: WorkerCluster | None = None
        self._load_task: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.queue is not None:  # first: a bad setting fails start-up before any work
            self.cluster = WorkerCluster(self.queue, self.registry, self.service,
                                         self.metrics, self.settings)
        # Load in the background: /healthz answers at once, /readyz once models are warm.
        loop = asyncio.get_running_loop()
        self._load_task = loop.create_task(self.registry.load_all())
        self.registry.start_memory_watch()
        # With several processes, a scrape reaches one: the others publish their gauges.
        gauges = loop.create_task(self._publish_gauges()) if multiprocess_dir() else None
        if self.cluster is not None:
            await self.cluster.start(self._load_task)
        try:
            yield
        finally:
            if self.cluster is not None:
                await self.cluster.stop()  # drain: finish and ack what it holds
            self._load_task.cancel()
            if gauges is not None:
                gauges.cancel()
            await self.registry.close()
            mark_process_dead()

    @property
    def ready(self) -> bool:
        # In queue mode, ready means consuming the pool's work, as the heartbeat says: a
        # worker connected to NATS whose consumer cannot be created serves no one.
        return self.registry.ready and (self.cluster is None or self.cluster.consuming)

    # ---- inference ---------------------------------------------------------------------
    def _deadline(self, model: str, options: RequestOptions, call: InferenceCall) -> None:
        """The request's timeout becomes what is left of it since the server received it
        (its deadline counts from there); 504 when nothing is left (an unknown model is a
        404 first)."""
        self.registry.entry(model)
        timeout_s = options.timeout_s or self.settings.default_timeout_s
        remaining = call.remaining_s(timeout_s)
        if remaining <= 0:
            raise HeronError(ErrorCode.DEADLINE_EXCEEDED,
                             f"request did not finish within timeout_s={timeout_s:g}")
        options.timeout_s = remaining

    async def encode(self, model: str, req: EncodeRequest, call: InferenceCall) -> Answer:
        self._deadline(model, req.options, call)
        outcome = await self.service.encode(model, req)
        settle_item_errors(outcome.body, call)
        return _answer(outcome)

    async def score(self, model: str, req: ScoreRequest, call: InferenceCall) -> Answer:
        self._deadline(model, req.options, call)
        return _answer(await self.service.score(model, req))

    async def extract(self, model: str, req: ExtractRequest, call: InferenceCall) -> Answer:
        self._deadline(model, req.options, call)
        return _answer(await self.service.extract(model, req))

    async def tokenize(self, model: str, req: TokenizeRequest, call: InferenceCall
                       ) -> Answer:
        self._deadline(model, req.options, call)
        return _answer(await self.tokens.tokenize(model, req))

    async def decode(self, model: str, req: DecodeRequest, call: InferenceCall) -> Answer:
        self._deadline(model, req.options, call)
        return _answer(await self.tokens.decode(model, req))

    async def provision(self, model: str, call: InferenceCall) -> Answer:
        """The capacity probe the SDK's ``wait_for_capacity`` polls: 200 once the model is
        loaded and warm; otherwise this starts its load and answers 503 MODEL_LOADING (or
        502 MODEL_LOAD_FAILED) like an inference request would."""
        entry, _ = self.registry.runner(model)
        return Answer({"model": entry.config.id, "state": entry.state.value},
                      entry.config.id, {})

    # ---- models and health -------------------------------------------------------------
    def _describe(self, entry: ModelEntry) -> dict[str, Any]:
        known: dict[str, Any] = {"error": entry.error}
        if entry.runner is not None:  # what the loaded checkpoint says wins over its config
            known.update(entry.runner.adapter.describe(), device=entry.device,
                         dtype=entry.dtype)
        return model_description(entry.config, state=entry.state.value,
                                 bundle=self.registry.bundle.name,
                                 pool=self.queue.pool if self.queue else None, **known)

    def models(self) -> list[dict[str, Any]]:
        return [self._describe(e) for e in self.registry.entries()]

    def model(self, name: str) -> dict[str, Any]:
        return self._describe(self.registry.entry(name))

    def readiness(self) -> Readiness:
        entries = self.registry.entries()
        states = {e.config.id: e.state.value for e in entries}
        connected = None if self.cluster is None else self.cluster.connected
        if self.ready:
            status = "ready"
        elif any(e.state is LoadState.FAILED for e in entries):
            status = "failed"
        elif self.registry.ready:  # models are warm: NATS, or the consumer, is missing
            status = "disconnected"
        else:
            status = "loading"
        details = {}
        if self.cluster is not None and status == "disconnected":
            details["error"] = self.cluster.not_consuming_because()
        elif self.cluster is not None and not self.ready and self.cluster.last_error:
            details["error"] = self.cluster.last_error
        return Readiness(status, states, connected, details)

    def canonical_id(self, name: str) -> str | None:
        return self.registry.canonical_id(name)

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        metrics = self.metrics
        metrics.of(metrics.requests, route, model, str(status)).inc()
        metrics.of(metrics.latency, route, model).observe(seconds)

    # ---- metrics -----------------------------------------------------------------------
    def _set_gauges(self) -> None:
        self.metrics.models_loaded.set(sum(e.state is LoadState.READY
                                           for e in self.registry.entries()))
        self.metrics.resident_bytes.set(self.registry.resident_bytes())
        self.metrics.resident_memory.set(psutil.Process().memory_info().rss)
        self.metrics.observe_results(self.registry.results)
        if self.cluster is not None and self.cluster.config_epoch >= 0:
            self.metrics.config_epoch.set(self.cluster.config_epoch)
        for e in self.registry.entries():
            if e.runner is not None:
                self.metrics.queue_depth.labels(e.config.id).set(len(e.runner.batcher))

    async def _publish_gauges(self) -> None:
        while True:
            self._set_gauges()
            await asyncio.sleep(1.0)

    def metrics_text(self) -> bytes:
        self._set_gauges()
        return self.metrics.render()

    def build(self) -> Starlette:
        return build_inference_app(self, title="Heron", lifespan=self.lifespan,
                                   max_body_bytes=self.settings.max_body_bytes,
                                   default_model=self.settings.default_model,
                                   cors_origins=self.settings.cors_origins,
                                   image_url_hosts=self.settings.image_url_hosts,
                                   image_url_timeout_s=self.settings.image_url_timeout_s)


def create_app(bundle: Bundle, *, device: str | None = None, precision: str | None = None,
               extra_models: list[ModelConfig] | None = None,
               queue: QueueMode | None = None,
               inference_cpus: frozenset[int] | None = None, inference_threads: int = 1,
               settings: WorkerSettings | None = None) -> Starlette:
    return LocalBackend(bundle, device=device, precision=precision, extra_models=extra_models,
                        queue=queue, inference_cpus=inference_cpus,
                        inference_threads=inference_threads, settings=settings).build()
