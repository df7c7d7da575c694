"""The worker's HTTP API (Starlette): the single-node inference server.

Routes are thin: parse the body into an sdk request type, call the InferenceService,
encode the answer in the client's format, record metrics. Errors are HeronErrors and go
through the one handler in heron.runtime.http.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psutil
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from heron.runtime import telemetry
from heron.runtime.http import (
    CLIENT_CLOSED_STATUS,
    EXCEPTION_HANDLERS,
    ClientDisconnected,
    RequestScope,
    read_body,
    respond,
    unless_disconnected,
)
from heron.runtime.logs import adopt_library_logs
from heron.runtime.modelconfig import Bundle, ModelConfig
from heron.runtime.openai_compat import embeddings_response, parse_embeddings_request
from heron.worker.cluster import WorkerCluster
from heron.worker.metrics import WorkerMetrics, mark_process_dead, multiprocess_dir
from heron.worker.registry import LoadState, ModelEntry, ModelRegistry
from heron.worker.service import InferenceService, Outcome
from heron_sdk import wire
from heron_sdk.errors import HeronError
from heron_sdk.types import EncodeRequest, ExtractRequest, Item, ScoreRequest

log = logging.getLogger("heron.worker")


@dataclass(frozen=True, slots=True)
class QueueMode:
    """Cluster mode: also pull work from the pool's JetStream consumer."""

    nats_url: str
    pool: str
    worker_id: str
    address: str = ""  # where this worker's own HTTP API listens (for status)
    config_url: str | None = None  # follow the config service: models added live


class WorkerApp:
    def __init__(self, bundle: Bundle, *, device: str | None = None,
                 precision: str | None = None,
                 extra_models: list[ModelConfig] | None = None,
                 queue: QueueMode | None = None,
                 inference_cpus: frozenset[int] | None = None) -> None:
        adopt_library_logs()  # transformers is imported by now: JSON logs stay JSON
        self.metrics = WorkerMetrics()
        self.registry = ModelRegistry(bundle, device=device, precision=precision,
                                      extra_models=extra_models,
                                      on_batch=self.metrics.observe_batch,
                                      on_evict=self.metrics.observe_eviction,
                                      on_load=self.metrics.observe_load,
                                      inference_cpus=inference_cpus)
        self.service = InferenceService(self.registry, on_phases=self.metrics.observe_phases)
        self.queue = queue
        self.cluster: WorkerCluster | None = None
        self._load_task: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.queue is not None:  # first: a bad setting fails start-up before any work
            self.cluster = WorkerCluster(self.queue, self.registry, self.service,
                                         self.metrics)
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
        return self.registry.ready and (self.cluster is None or self.cluster.connected)

    # ---- inference routes ------------------------------------------------------------------
    async def _inference(self, request: Request, route: str,
                         handle: Callable[[Any], Awaitable[Outcome]], *,
                         json_only: bool = False) -> Response:
        """Read the body, run ``handle``, answer; metrics and timing headers for every route."""
        started = time.monotonic()
        status, model = 500, request.path_params.get("model", "_unknown")
        scope = RequestScope(request, telemetry.WORKER, route, log)
        try:
            body, fmt = await read_body(request)
            outcome = await unless_disconnected(request, handle(body))
            status, model = 200, outcome.model
            headers = {"Server-Timing": outcome.timings.server_timing(),
                       "X-Request-Id": scope.request_id}
            if json_only:  # OpenAI clients speak JSON only, whatever they send in Accept
                return Response(wire.encode(outcome.body, wire.JSON), media_type=wire.JSON,
                                headers=headers)
            return respond(request, outcome.body, request_fmt=fmt, headers=headers)
        except HeronError as exc:
            status = exc.status
            raise
        except ClientDisconnected:
            status = CLIENT_CLOSED_STATUS
            return Response(status_code=CLIENT_CLOSED_STATUS)
        finally:
            # Labels use model ids; unknown names must not mint new label values.
            label = self.registry.canonical_id(model) or "_unknown"
            self.metrics.requests.labels(route, label, str(status)).inc()
            self.metrics.latency.labels(route, label).observe(time.monotonic() - started)
            scope.finish(status, None if label == "_unknown" else label)

    async def encode(self, request: Request) -> Response:
        model = request.path_params["model"]
        return await self._inference(
            request, "encode", lambda b: self.service.encode(model, EncodeRequest.from_wire(b)))

    async def score(self, request: Request) -> Response:
        model = request.path_params["model"]
        return await self._inference(
            request, "score", lambda b: self.service.score(model, ScoreRequest.from_wire(b)))

    async def extract(self, request: Request) -> Response:
        model = request.path_params["model"]
        return await self._inference(
            request, "extract",
            lambda b: self.service.extract(model, ExtractRequest.from_wire(b)))

    async def embeddings(self, request: Request) -> Response:
        async def handle(body: Any) -> Outcome:
            model, texts, encoding, dims = parse_embeddings_request(body)
            out = await self.service.encode(
                model, EncodeRequest(items=[Item(t) for t in texts], dims=dims))
            vectors = [row["dense"] for row in out.body["items"]]
            return Outcome(embeddings_response(out.model, vectors, out.body["usage"]["tokens"],
                                               encoding), out.timings, out.model)

        return await self._inference(request, "embeddings", handle, json_only=True)

    # ---- models and health -----------------------------------------------------------------
    @staticmethod
    def _describe(entry: ModelEntry) -> dict[str, Any]:
        config = entry.config
        out: dict[str, Any] = {"id": config.id, "object": "model", "owned_by": "heron",
                               "adapter": config.adapter, "aliases": list(config.aliases),
                               "state": entry.state.value}
        if entry.runner is not None:
            adapter = entry.runner.adapter
            out.update(task=adapter.task, output_types=sorted(adapter.output_types),
                       max_sequence_length=adapter.max_length, device=entry.device,
                       dtype=entry.dtype)
            if adapter.name in ("dense", "multi_vector"):
                out["dimensions"] = adapter.hidden_size
        if entry.error:
            out["error"] = entry.error
        return out

    async def list_models(self, request: Request) -> Response:
        data = [self._describe(e) for e in self.registry.entries()]
        return respond(request, {"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        entry = self.registry.entry(request.path_params["model"])
        return respond(request, self._describe(entry))

    async def provision(self, request: Request) -> Response:
        """The capacity probe the SDK's ``wait_for_capacity`` polls: 200 once the model is
        loaded and warm; otherwise this starts its load and answers 503 MODEL_LOADING (or
        502 MODEL_LOAD_FAILED) like an inference request would."""
        entry, _ = self.registry.runner(request.path_params["model"])
        return respond(request, {"model": entry.config.id, "state": entry.state.value})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        states = {e.config.id: e.state.value for e in self.registry.entries()}
        ready = self.ready
        failed = any(e.state is LoadState.FAILED for e in self.registry.entries())
        body: dict[str, Any] = {
            "status": "ready" if ready else ("failed" if failed else "loading"),
            "models": states}
        if self.cluster is not None:
            body["nats"] = "connected" if self.cluster.connected else "disconnected"
            if self.registry.ready and not self.cluster.connected:
                body["status"] = "disconnected"
        return JSONResponse(body, status_code=200 if ready else 503,
                            headers=None if ready else {"Retry-After": "2"})

    def _set_gauges(self) -> None:
        self.metrics.models_loaded.set(sum(e.state is LoadState.READY
                                           for e in self.registry.entries()))
        self.metrics.resident_bytes.set(self.registry.resident_bytes())
        self.metrics.resident_memory.set(psutil.Process().memory_info().rss)
        if self.cluster is not None and self.cluster.config_epoch >= 0:
            self.metrics.config_epoch.set(self.cluster.config_epoch)
        for e in self.registry.entries():
            if e.runner is not None:
                self.metrics.queue_depth.labels(e.config.id).set(len(e.runner.batcher))

    async def _publish_gauges(self) -> None:
        while True:
            self._set_gauges()
            await asyncio.sleep(1.0)

    async def metrics_endpoint(self, request: Request) -> Response:
        self._set_gauges()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def build(self) -> Starlette:
        routes = [
            Route("/v1/encode/{model:path}", self.encode, methods=["POST"]),
            Route("/v1/score/{model:path}", self.score, methods=["POST"]),
            Route("/v1/extract/{model:path}", self.extract, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}/provision", self.provision, methods=["POST"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS,
                         lifespan=self.lifespan)


def create_app(bundle: Bundle, *, device: str | None = None, precision: str | None = None,
               extra_models: list[ModelConfig] | None = None,
               queue: QueueMode | None = None,
               inference_cpus: frozenset[int] | None = None) -> Starlette:
    return WorkerApp(bundle, device=device, precision=precision, extra_models=extra_models,
                     queue=queue, inference_cpus=inference_cpus).build()
