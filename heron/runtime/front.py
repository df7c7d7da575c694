"""The public inference API, defined once, over a backend: ``heron serve`` and a worker's own
HTTP API answer it with the local backend (heron.worker.app), the gateway with the remote
one (heron.gateway.routes), and both answer it the same way.

The front owns everything about HTTP: routes, content negotiation, the body limit, the one
HeronError -> response mapping (heron.runtime.http), request ids, Server-Timing, API keys
(heron.runtime.auth), per-request metrics through the backend's hook, the request's
server span and summary log line, and cancelling the work when the client goes away. A
backend only computes answers (``InferenceBackend``); the API's OpenAPI description is
declared here next to the handlers (``INFERENCE_OPERATIONS``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from heron import __version__
from heron.runtime import api_types as api
from heron.runtime.adapters import adapter_family
from heron.runtime.auth import api_key_middleware
from heron.runtime.http import (
    CLIENT_CLOSED_STATUS,
    EXCEPTION_HANDLERS,
    ClientDisconnected,
    RequestScope,
    error_handler,
    read_body,
    respond,
    server_timing,
    unless_disconnected,
)
from heron.runtime.modelconfig import ModelConfig
from heron.runtime.openai_compat import embeddings_response, parse_embeddings_request
from heron.runtime.openapi import ApiOperation, docs_routes, openapi_document
from heron.runtime.received import received_at
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import MAX_BODY_BYTES, EncodeRequest, ExtractRequest, Item, ScoreRequest

log = logging.getLogger("heron.front")

PROMETHEUS_TEXT = "text/plain; version=0.0.4"
# A server that is not ready yet is usually a few seconds from it (models warming, NATS
# reconnecting): callers and probes come back then.
NOT_READY_RETRY_AFTER_S = 2
# A server at its bound of requests in flight: most finish within a second or two.
OVERLOADED_RETRY_AFTER_S = 1.0


# ---- what a backend deals in ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class InferenceCall:
    """What a backend may need of the HTTP request beyond its parsed body."""

    headers: Mapping[str, str]  # the request's headers (a gateway routes by X-Heron-Pool)
    # Every item must succeed: an item's failure fails the call, and the answer carries no
    # per-item errors (an OpenAI embeddings body has nowhere to put them).
    all_or_nothing: bool = False
    # time.monotonic() when the server received the request: its deadline counts from here
    # (heron.runtime.received), not from when the handler ran.
    received_at: float = field(default_factory=time.monotonic)

    def remaining_s(self, timeout_s: float) -> float:
        """What is left of ``timeout_s`` counted from the request's arrival."""
        return timeout_s - (time.monotonic() - self.received_at)


@dataclass(slots=True)
class Answer:
    """A backend's answer to one call: the body to send, the model's id (metric label), and
    the phases it took, in order, for Server-Timing."""

    body: dict[str, Any]
    model_id: str
    phases: Mapping[str, float]  # phase -> seconds
    total_s: float | None = None  # the backend's own total; None: measured by the front


class Provisioning(Exception):
    """No capacity for the model yet, and some is coming: answered 202 with Retry-After
    (not an error: the caller retries, and the SDK waits for it)."""

    def __init__(self, pool: str, bundle: str, estimated_wait_s: float,
                 retry_after_s: float) -> None:
        super().__init__(f"pool {pool} is provisioning")
        self.body = {"status": "provisioning", "pool": pool, "bundle": bundle,
                     "estimated_wait_s": estimated_wait_s}
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Readiness:
    """A server's /readyz verdict; its body is the same shape on every server."""

    status: str  # "ready", "loading", "failed" (a preloaded model), "disconnected" (NATS)
    models: dict[str, str]  # model id -> state
    nats_connected: bool | None = None  # None: this server uses no NATS (`heron serve`)
    details: dict[str, Any] = field(default_factory=dict)  # what only this server knows

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "models": self.models}
        if self.nats_connected is not None:
            out["nats_connected"] = self.nats_connected
        return {**out, **self.details}


class InferenceBackend(Protocol):
    """What serves the inference API behind the front: the worker's local model registry,
    or the gateway's pools over NATS. Errors are HeronErrors (the front maps them)."""

    telemetry_scope: str  # heron.runtime.telemetry.GATEWAY or .WORKER: spans are named so
    log: logging.Logger  # the request's summary line goes here

    async def encode(self, model: str, req: EncodeRequest, call: InferenceCall) -> Answer: ...

    async def score(self, model: str, req: ScoreRequest, call: InferenceCall) -> Answer: ...

    async def extract(self, model: str, req: ExtractRequest, call: InferenceCall
                      ) -> Answer: ...

    async def provision(self, model: str, call: InferenceCall) -> Answer:
        """200 once the model can serve; else start getting it there (load, or workers)."""
        ...

    def models(self) -> list[dict[str, Any]]:
        """Every model, as ``model_description`` builds it."""
        ...

    def model(self, name: str) -> dict[str, Any]:
        """One model by id or alias (404 MODEL_NOT_FOUND)."""
        ...

    def readiness(self) -> Readiness: ...

    def canonical_id(self, name: str) -> str | None:
        """The model id a name or alias stands for; None for a name not served here."""
        ...

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        """Per-request metrics: ``model`` is an id or ``_unknown``, never a client's name."""
        ...

    def metrics_text(self) -> bytes:
        """The Prometheus exposition for GET /metrics."""
        ...


def model_description(config: ModelConfig, *, state: str, bundle: str, pool: str | None,
                      **known: Any) -> dict[str, Any]:
    """A model as GET /v1/models shows it, on every server: its configuration, where it is
    served, its state, and what only a loaded model knows (``known``: device, dtype,
    dimensions, ...; None values are left out)."""
    family = adapter_family(config.adapter)
    tasks = family.tasks
    out: dict[str, Any] = {"id": config.id, "object": "model", "owned_by": "heron",
                           "adapter": config.adapter, "aliases": list(config.aliases),
                           "task": tasks[0], "tasks": list(tasks), "bundle": bundle,
                           "state": state}
    if pool is not None:
        out["pool"] = pool
    if family.output_types:
        out["output_types"] = sorted(family.output_types)
    if config.profile.max_sequence_length is not None:
        out["max_sequence_length"] = config.profile.max_sequence_length
    if config.description:
        out["description"] = config.description
    out.update((key, value) for key, value in known.items() if value is not None)
    return out


# ---- the API's description ----------------------------------------------------------------
_BODY_MEDIA = (wire.JSON, wire.MSGPACK)  # what the route reads, and answers by Accept
ENCODE_OPERATION = ApiOperation(
    "POST", "/v1/encode/{model}", "encode", "Embed texts (dense, sparse, multi-vector)",
    "inference", request=api.EncodeBody, responses=api.ENCODE_RESPONSES,
    request_media=_BODY_MEDIA, response_media=_BODY_MEDIA, auth=True)
SCORE_OPERATION = ApiOperation(
    "POST", "/v1/score/{model}", "score", "Rank documents against a query", "inference",
    request=api.ScoreBody, responses=api.SCORE_RESPONSES, request_media=_BODY_MEDIA,
    response_media=_BODY_MEDIA, auth=True)
EXTRACT_OPERATION = ApiOperation(
    "POST", "/v1/extract/{model}", "extract", "Extract entities from texts", "inference",
    request=api.ExtractBody, responses=api.EXTRACT_RESPONSES, request_media=_BODY_MEDIA,
    response_media=_BODY_MEDIA, auth=True)
EMBEDDINGS_OPERATION = ApiOperation(  # JSON only, like OpenAI's
    "POST", "/v1/embeddings", "createEmbeddings", "OpenAI-compatible embeddings",
    "inference", request=api.EmbeddingsBody, responses=api.EMBEDDINGS_RESPONSES, auth=True)
LIST_MODELS_OPERATION = ApiOperation(
    "GET", "/v1/models", "listModels", "Every model served, with its state", "models",
    responses=api.MODEL_LIST_RESPONSES, response_media=_BODY_MEDIA, auth=True)
GET_MODEL_OPERATION = ApiOperation(
    "GET", "/v1/models/{model}", "getModel", "One model by id or alias", "models",
    responses=api.MODEL_RESPONSES, response_media=_BODY_MEDIA, auth=True)
PROVISION_OPERATION = ApiOperation(
    "POST", "/v1/models/{model}/provision", "provisionModel",
    "200 once the model can serve; starts its load (or a worker) if not", "models",
    responses=api.PROVISION_RESPONSES, response_media=_BODY_MEDIA, auth=True)
HEALTHZ_OPERATION = ApiOperation("GET", "/healthz", "healthz", "The process is alive",
                                 "health", responses=api.HEALTH_RESPONSES)
READYZ_OPERATION = ApiOperation("GET", "/readyz", "readyz",
                                "200 once the server can take inference requests", "health",
                                responses=api.READY_RESPONSES)
METRICS_OPERATION = ApiOperation("GET", "/metrics", "metrics", "Prometheus metrics", "health",
                                 responses=api.METRICS_RESPONSES,
                                 response_media=("text/plain",))

INFERENCE_OPERATIONS: tuple[ApiOperation, ...] = (
    ENCODE_OPERATION, SCORE_OPERATION, EXTRACT_OPERATION, EMBEDDINGS_OPERATION,
    LIST_MODELS_OPERATION, GET_MODEL_OPERATION, PROVISION_OPERATION, HEALTHZ_OPERATION,
    READYZ_OPERATION, METRICS_OPERATION)


def api_docs_routes(operations: Sequence[ApiOperation], title: str) -> list[BaseRoute]:
    """``GET /openapi.json`` and ``GET /docs`` for ``operations`` (heron.runtime.openapi)."""
    frozen = tuple(operations)

    @cache  # the routes never change while the process runs: build the document once
    def document() -> dict[str, Any]:
        return openapi_document(frozen, title=title, version=__version__)

    return docs_routes(document)


# ---- the front ----------------------------------------------------------------------------
class InferenceFront:
    """The HTTP handlers of the inference API over one backend."""

    def __init__(self, backend: InferenceBackend, max_in_flight: int | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.backend = backend
        self.max_body_bytes = max_body_bytes  # 413 PAYLOAD_TOO_LARGE past it
        # Inference requests in this process at once; past it, 429 before the body is read
        # (a flood is refused in well under a millisecond a request, not queued).
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def _serve(self, request: Request, route_name: str,
                     handle: Callable[[Any], Awaitable[Answer]], *, json_only: bool = False,
                     read: bool = True) -> Response:
        """Read the body, run ``handle``, answer; metrics, logs, span and timing headers for
        every route."""
        backend = self.backend
        started = received_at(request.scope)
        status, label = 500, request.path_params.get("model", "_unknown")
        scope = RequestScope(request, backend.telemetry_scope, route_name, backend.log)
        self.in_flight += 1
        try:
            if self.max_in_flight is not None and self.in_flight > self.max_in_flight:
                raise HeronError(ErrorCode.QUEUE_FULL,
                                 f"{self.in_flight - 1} requests in flight on this server "
                                 f"(bound {self.max_in_flight}); retry shortly",
                                 retry_after_s=OVERLOADED_RETRY_AFTER_S)
            body, fmt = (await read_body(request, self.max_body_bytes) if read
                         else (None, None))
            # A client that disconnects stops the wait: its work is cancelled or skipped
            # (queued items are dropped; a gateway's stop counting against the backlog).
            answer = await unless_disconnected(request, handle(body))
            status, label = 200, answer.model_id
            phases = dict(answer.phases)
            phases["total"] = (time.monotonic() - started if answer.total_s is None
                               else answer.total_s)
            headers = {"Server-Timing": server_timing(phases),
                       "X-Request-Id": scope.request_id}
            if json_only:  # OpenAI clients speak JSON only, whatever they send in Accept
                return Response(wire.encode(answer.body, wire.JSON), media_type=wire.JSON,
                                headers=headers)
            return respond(request, answer.body, request_fmt=fmt, headers=headers)
        except Provisioning as wait:
            status = 202
            headers = {"Retry-After": str(max(1, round(wait.retry_after_s))),
                       "X-Request-Id": scope.request_id}
            return respond(request, wait.body, status=202, headers=headers)
        except ClientDisconnected:
            status = CLIENT_CLOSED_STATUS
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except HeronError as exc:
            status = exc.status
            raise
        finally:
            self.in_flight -= 1
            # Labels use model ids; unknown names must not mint new label values.
            model = backend.canonical_id(label) or "_unknown"
            backend.observe_request(route_name, model, status, time.monotonic() - started)
            scope.finish(status, None if model == "_unknown" else model)

    @staticmethod
    def _call(request: Request, all_or_nothing: bool = False) -> InferenceCall:
        return InferenceCall(request.headers, all_or_nothing, received_at(request.scope))

    # ---- inference --------------------------------------------------------------------
    async def encode(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)
        return await self._serve(request, "encode", lambda body: self.backend.encode(
            model, EncodeRequest.from_wire(body), call))

    async def score(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)
        return await self._serve(request, "score", lambda body: self.backend.score(
            model, ScoreRequest.from_wire(body), call))

    async def extract(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)
        return await self._serve(request, "extract", lambda body: self.backend.extract(
            model, ExtractRequest.from_wire(body), call))

    async def embeddings(self, request: Request) -> Response:
        call = self._call(request, all_or_nothing=True)

        async def handle(body: Any) -> Answer:
            model, texts, encoding, dims = parse_embeddings_request(body)
            out = await self.backend.encode(
                model, EncodeRequest(items=[Item(t) for t in texts], dims=dims), call)
            vectors = [row["dense"] for row in out.body["items"]]
            return Answer(embeddings_response(out.model_id, vectors,
                                              out.body["usage"]["tokens"], encoding),
                          out.model_id, out.phases, out.total_s)

        return await self._serve(request, "embeddings", handle, json_only=True)

    async def provision(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)
        return await self._serve(request, "provision",
                                 lambda _: self.backend.provision(model, call), read=False)

    # ---- models, health, metrics --------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        return respond(request, {"object": "list", "data": self.backend.models()})

    async def get_model(self, request: Request) -> Response:
        return respond(request, self.backend.model(request.path_params["model"]))

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        verdict = self.backend.readiness()
        if verdict.ready:
            return JSONResponse(verdict.body())
        return JSONResponse(verdict.body(), status_code=503,
                            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})

    async def metrics(self, request: Request) -> Response:
        return Response(self.backend.metrics_text(), media_type=PROMETHEUS_TEXT)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/encode/{model:path}", self.encode, methods=["POST"]),
            Route("/v1/score/{model:path}", self.score, methods=["POST"]),
            Route("/v1/extract/{model:path}", self.extract, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            # Before /v1/models/{model:path}, whose path would swallow "/provision".
            Route("/v1/models/{model:path}/provision", self.provision, methods=["POST"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]


Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]


def build_inference_app(backend: InferenceBackend, *, title: str,
                        lifespan: Lifespan | None = None,
                        extra_routes: Sequence[BaseRoute] = (),
                        extra_operations: Sequence[ApiOperation] = (),
                        max_in_flight: int | None = None,
                        max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The app of a server with the inference API: the front's routes, then the server's
    own (``extra_routes``, described by ``extra_operations``), /openapi.json and /docs, API
    keys from HERON_API_KEYS, and the one error mapping. ``max_in_flight``: inference
    requests at once before 429 QUEUE_FULL (None: no bound here); ``max_body_bytes``: the
    largest request body before 413."""
    front = InferenceFront(backend, max_in_flight, max_body_bytes)
    routes = [*front.routes(), *extra_routes,
              *api_docs_routes((*INFERENCE_OPERATIONS, *extra_operations), title)]
    middleware = api_key_middleware()
    app = InferenceApp(routes=routes, exception_handlers=dict(EXCEPTION_HANDLERS),
                       lifespan=lifespan, middleware=middleware)
    if not middleware:  # API keys are checked by middleware: then every route goes there
        app.hot_routes = {"/v1/encode/": front.encode, "/v1/score/": front.score,
                          "/v1/extract/": front.extract}
        app.hot_exact = {"/v1/embeddings": front.embeddings}
    return app


class InferenceApp(Starlette):
    """Starlette, with the inference POSTs taken straight to their handlers: past the
    router's matching of every route and three middleware layers, which cost a gateway about
    10% of its CPU a request (py-spy, one-text requests). The handlers' errors get the same
    responses as through the stack (heron.runtime.http's handlers); every other request,
    and every request while API keys are set, goes through Starlette as before."""

    hot_routes: dict[str, Callable[[Request], Awaitable[Response]]] = {}  # path prefix ->
    hot_exact: dict[str, Callable[[Request], Awaitable[Response]]] = {}  # exact path ->

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            handler = self.hot_exact.get(path)
            model = None
            if handler is None and path.startswith("/v1/"):
                prefix = path[:path.find("/", 4) + 1]
                handler = self.hot_routes.get(prefix)
                model = path[len(prefix):] if handler is not None else None
                if not model:
                    handler = None
            if handler is not None:
                scope["app"] = self
                if model is not None:
                    scope["path_params"] = {"model": model}
                request = Request(scope, receive, send)
                try:
                    response = await handler(request)
                except Exception as exc:
                    response = await error_handler(exc)(request, exc)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

