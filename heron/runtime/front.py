"""The public inference API, defined once, over a backend: ``heron serve`` and a worker's own
HTTP API answer it with the local backend (heron.worker.app), the gateway with the remote
one (heron.gateway.routes), and both answer it the same way.

The front owns everything about HTTP: routes, content negotiation, the body limit, the one
HeronError -> response mapping (heron.runtime.http), request ids, Server-Timing, API keys
(heron.runtime.auth), per-request metrics through the backend's hook, the request's
server span and summary log line, cancelling the work when the client goes away, and
fetching image URLs from the hosts the operator allows (heron.runtime.image_urls) before
the backend sees the request, so every backend gets image bytes. A
backend only computes answers (``InferenceBackend``); the API's OpenAPI description is
declared here next to the handlers (``INFERENCE_OPERATIONS``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from heron.runtime import api_types as api
from heron.runtime.backend import (
    Answer,
    InferenceBackend,
    InferenceCall,
    Provisioning,
)
from heron.runtime.http import (
    CLIENT_CLOSED_STATUS,
    ClientDisconnected,
    RequestScope,
    read_body,
    respond,
    server_timing,
    unless_disconnected,
)
from heron.runtime.image_urls import ImageFetcher
from heron.runtime.modelconfig import split_adapter
from heron.runtime.openai_compat import (
    embeddings_response,
    openai_error,
    parse_embeddings_request,
)
from heron.runtime.openapi import ApiOperation
from heron.runtime.received import received_at
from heron.runtime.rerank_api import RERANK_OPERATIONS
from heron.runtime.tei_api import TEI_OPERATIONS
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import MAX_BODY_BYTES, EncodeRequest, ExtractRequest, ScoreRequest

log = logging.getLogger("heron.front")

PROMETHEUS_TEXT = "text/plain; version=0.0.4"
# A server that is not ready yet is usually a few seconds from it (models warming, NATS
# reconnecting): callers and probes come back then.
NOT_READY_RETRY_AFTER_S = 2
# A server at its bound of requests in flight: most finish within a second or two.
OVERLOADED_RETRY_AFTER_S = 1.0


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
    "inference", request=api.EmbeddingsBody, responses=api.EMBEDDINGS_RESPONSES, auth=True,
    dialect_error=api.OpenAIErrorBody)
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
    READYZ_OPERATION, METRICS_OPERATION, *RERANK_OPERATIONS, *TEI_OPERATIONS)


# ---- the front ----------------------------------------------------------------------------
# How a route that speaks another API (OpenAI's, Cohere's, TEI's) writes an error: the
# status and JSON body for a HeronError, in that API's own shape, so its clients raise their
# own exception classes. Headers (X-Request-Id, Retry-After) are the front's.
ErrorShape = Callable[[HeronError], tuple[int, dict[str, Any]]]


class InferenceFront:
    """The HTTP handlers of the inference API over one backend."""

    def __init__(self, backend: InferenceBackend, max_in_flight: int | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 image_urls: ImageFetcher | None = None) -> None:
        self.backend = backend
        self.max_body_bytes = max_body_bytes  # 413 PAYLOAD_TOO_LARGE past it
        # Image URLs: fetched from the allowed hosts, else refused (none allowed: default).
        self.image_urls = image_urls or ImageFetcher(max_total_bytes=max_body_bytes)
        # Inference requests in this process at once; past it, 429 before the body is read
        # (a flood is refused in well under a millisecond a request, not queued).
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def _serve(self, request: Request, route_name: str,
                     handle: Callable[[Any], Awaitable[Answer]], *, json_only: bool = False,
                     read: bool = True, errors: ErrorShape | None = None) -> Response:
        """Read the body, run ``handle``, answer; metrics, logs, span and timing headers for
        every route. ``errors``: the route speaks another API; its errors take that API's
        shape, and "provisioning" is a 503 with Retry-After (its clients know no 202)."""
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
            if errors is not None:
                status, response = self._dialect_error(scope, errors, HeronError(
                    ErrorCode.NOT_READY, f"{wait}: no worker is ready yet; retry after "
                    f"{max(1, round(wait.retry_after_s))} s", retry_after_s=wait.retry_after_s))
                return response
            status = 202
            headers = {"Retry-After": str(max(1, round(wait.retry_after_s))),
                       "X-Request-Id": scope.request_id}
            return respond(request, wait.body, status=202, headers=headers)
        except ClientDisconnected:
            status = CLIENT_CLOSED_STATUS
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except HeronError as exc:
            status = exc.status
            if errors is None:
                raise
            status, response = self._dialect_error(scope, errors, exc)
            return response
        finally:
            self.in_flight -= 1
            # Labels use model ids; unknown names must not mint new label values.
            model = backend.canonical_id(label) or "_unknown"
            backend.observe_request(route_name, model, status, time.monotonic() - started)
            scope.finish(status, None if model == "_unknown" else model)

    @staticmethod
    def _dialect_error(scope: RequestScope, errors: ErrorShape,
                       exc: HeronError) -> tuple[int, Response]:
        status, body = errors(exc)
        headers = {"X-Request-Id": scope.request_id}
        if exc.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return status, Response(wire.encode(body, wire.JSON), status_code=status,
                                media_type=wire.JSON, headers=headers)

    def _images_first(self, req: EncodeRequest | ScoreRequest, call: InferenceCall,
                      compute: Callable[[], Awaitable[Answer]]) -> Awaitable[Answer]:
        """``compute()``, after the request's image URLs are fetched into their items (a
        request without any goes straight on)."""
        if not self.image_urls.pending(req):
            return compute()

        async def fetched_then() -> Answer:
            seconds = await self.image_urls.fetch(req, call)
            answer = await compute()
            answer.phases = {"image_fetch": seconds, **answer.phases}
            if answer.total_s is not None:
                answer.total_s += seconds
            return answer

        return fetched_then()

    @staticmethod
    def _call(request: Request, all_or_nothing: bool = False) -> InferenceCall:
        return InferenceCall(request.headers, all_or_nothing, received_at(request.scope))

    # ---- for the routes of other APIs (heron.runtime.rerank_api, heron.runtime.tei_api) --
    def call_of(self, request: Request) -> InferenceCall:
        """The backend's view of ``request``; every item must succeed (another API's answer
        has nowhere to put one item's error)."""
        return self._call(request, all_or_nothing=True)

    async def serve_json(self, request: Request, route_name: str,
                         handle: Callable[[Any], Awaitable[Answer]],
                         errors: ErrorShape) -> Response:
        """``handle``'s answer as JSON, its errors in ``errors``' shape; everything else
        (metrics, logs, span, Server-Timing, disconnects) as on Heron's own routes."""
        return await self._serve(request, route_name, handle, json_only=True, errors=errors)

    # ---- inference --------------------------------------------------------------------
    async def encode(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)

        def handle(body: Any) -> Awaitable[Answer]:
            req = EncodeRequest.from_wire(body)
            # model@adapter: the model's route, with the LoRA adapter in the request
            target = split_adapter(model, req.options)
            return self._images_first(req, call,
                                      lambda: self.backend.encode(target, req, call))

        return await self._serve(request, "encode", handle)

    async def score(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)

        def handle(body: Any) -> Awaitable[Answer]:
            req = ScoreRequest.from_wire(body)
            # model@adapter: the model's route, with the LoRA adapter in the request
            target = split_adapter(model, req.options)
            return self._images_first(req, call,
                                      lambda: self.backend.score(target, req, call))

        return await self._serve(request, "score", handle)

    async def extract(self, request: Request) -> Response:
        model, call = request.path_params["model"], self._call(request)

        def handle(body: Any) -> Awaitable[Answer]:
            req = ExtractRequest.from_wire(body)
            # model@adapter: the model's route, with the LoRA adapter in the request
            return self.backend.extract(split_adapter(model, req.options), req, call)

        return await self._serve(request, "extract", handle)

    async def embeddings(self, request: Request) -> Response:
        call = self._call(request, all_or_nothing=True)

        async def handle(body: Any) -> Answer:
            model, req, encoding = parse_embeddings_request(body)
            out = await self.backend.encode(model, req, call)
            vectors = [row["dense"] for row in out.body["items"]]
            return Answer(embeddings_response(out.model_id, vectors,
                                              out.body["usage"]["tokens"], encoding),
                          out.model_id, out.phases, out.total_s)

        return await self._serve(request, "embeddings", handle, json_only=True,
                                 errors=openai_error)

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
