"""The config service's HTTP routes (Starlette). config_service/app.py builds and serves it.

Writes (POST /v1/configs/models) and the full snapshot (GET /v1/configs/export) need the
admin token when one is set; the other GETs, /healthz and /readyz are open.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from heron.config_service.body import read_raw
from heron.config_service.service import ConfigService
from heron.runtime import config_api_types as cfg
from heron.runtime.front import NOT_READY_RETRY_AFTER_S
from heron.runtime.http import EXCEPTION_HANDLERS, respond
from heron.runtime.inference_app import api_docs_routes
from heron.runtime.openapi import ApiOperation
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError

# The config service's routes, as its OpenAPI document describes them (bodies:
# heron.runtime.config_api_types). Bodies go out in the format Accept (else the request's
# Content-Type) names; /healthz and /readyz always answer JSON.
_BODY_MEDIA = (wire.JSON, wire.MSGPACK)
CONFIG_OPERATIONS: tuple[ApiOperation, ...] = (
    ApiOperation("POST", "/v1/configs/models", "postModelConfig",
                 "Add a model config, or new profiles or bundles to one (admin token)",
                 "configs",
                 request=cfg.ModelConfigBody, responses=cfg.POST_MODEL_RESPONSES,
                 request_media=(wire.JSON, "application/yaml", wire.MSGPACK),
                 response_media=_BODY_MEDIA, auth=True,
                 description="A model config as in docs/models.md plus an optional "
                             "`bundles` list; append-only: 409 for a change to stored "
                             "content, 200 (`created: false`) for content already stored, "
                             "503 NOT_LEADER from an instance without the writer lease."),
    ApiOperation("GET", "/v1/configs/models", "listModelConfigs", "Every model config",
                 "configs", responses=cfg.LIST_MODELS_RESPONSES, response_media=_BODY_MEDIA),
    ApiOperation("GET", "/v1/configs/models/{model}", "getModelConfig",
                 "One model config and the bundles that serve it", "configs",
                 responses=cfg.GET_MODEL_RESPONSES, response_media=_BODY_MEDIA),
    ApiOperation("GET", "/v1/configs/export", "exportConfigs",
                 "The full snapshot: models and bundles at the current epoch (admin token)",
                 "configs", responses=cfg.EXPORT_RESPONSES, response_media=_BODY_MEDIA,
                 auth=True),
    ApiOperation("GET", "/v1/configs/epoch", "getConfigEpoch",
                 "The current epoch and bundles hash", "configs",
                 responses=cfg.EPOCH_RESPONSES, response_media=_BODY_MEDIA),
    ApiOperation("GET", "/v1/configs/bundles", "listBundles", "Every bundle", "configs",
                 responses=cfg.LIST_BUNDLES_RESPONSES, response_media=_BODY_MEDIA),
    ApiOperation("GET", "/v1/configs/bundles/{name}", "getBundle", "One bundle", "configs",
                 responses=cfg.GET_BUNDLE_RESPONSES, response_media=_BODY_MEDIA),
    ApiOperation("GET", "/healthz", "healthz", "The process is alive", "health",
                 responses=cfg.CONFIG_HEALTH_RESPONSES),
    ApiOperation("GET", "/readyz", "readyz",
                 "200 once the store is read and NATS is connected, else 503", "health",
                 responses=cfg.CONFIG_READY_RESPONSES),
    ApiOperation("GET", "/metrics", "metrics", "Prometheus metrics", "health",
                 responses=cfg.CONFIG_METRICS_RESPONSES, response_media=("text/plain",)),
)


class ConfigRoutes:
    def __init__(self, service: ConfigService, admin_token: str | None) -> None:
        self.service = service
        self.admin_token = admin_token or None

    def check_admin(self, request: Request) -> None:
        if self.admin_token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise HeronError(ErrorCode.UNAUTHORIZED, "this needs the admin token: "
                             "Authorization: Bearer <HERON_ADMIN_TOKEN>")
        if not hmac.compare_digest(token.strip().encode(), self.admin_token.encode()):
            raise HeronError(ErrorCode.FORBIDDEN, "the bearer token is not the admin token")

    # ---- writes -------------------------------------------------------------------------
    async def post_model(self, request: Request) -> Response:
        status = 500
        try:
            self.check_admin(request)
            if not self.service.can_write:
                raise self.service.not_leader()
            raw = await read_raw(request)
            status, answer = await self.service.post(
                raw, request.headers.get("content-type"),
                request.headers.get("idempotency-key") or None)
        except HeronError as exc:
            status = exc.status
            raise
        finally:
            self.service.metrics.posts.labels(str(status)).inc()
        return respond(request, answer, status=status)

    # ---- reads --------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        registry = self.service.registry
        return respond(request, {"epoch": registry.epoch,
                                 "models": [registry.model_summary(m) for _, m in
                                            sorted(registry.models.items())]})

    async def get_model(self, request: Request) -> Response:
        registry = self.service.registry
        name = request.path_params["model"]
        model = registry.resolve(name)
        if model is None:
            raise HeronError(ErrorCode.MODEL_NOT_FOUND,
                             f"no model {name!r}; GET /v1/configs/models lists them")
        return respond(request, {"epoch": registry.updated.get(model.id, 0),
                                 "model": model.to_dict(),
                                 "bundles": registry.model_bundles(model.id)})

    async def export(self, request: Request) -> Response:
        self.check_admin(request)
        return respond(request, self.service.registry.export())

    async def epoch(self, request: Request) -> Response:
        registry = self.service.registry
        return respond(request, {"epoch": registry.epoch,
                                 "bundles_hash": registry.bundles_hash()})

    async def list_bundles(self, request: Request) -> Response:
        registry = self.service.registry
        return respond(request, {"epoch": registry.epoch,
                                 "bundles": [registry.bundle_view(n)
                                             for n in sorted(registry.bundles)]})

    async def get_bundle(self, request: Request) -> Response:
        registry = self.service.registry
        name = request.path_params["name"]
        if name not in registry.bundles:
            raise HeronError(ErrorCode.NOT_FOUND, f"no bundle {name!r}; known: "
                             f"{sorted(registry.bundles)}")
        return respond(request, {"epoch": registry.epoch, **registry.bundle_view(name)})

    # ---- operations -----------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", **self.service.status()})

    async def readyz(self, request: Request) -> Response:
        ready = self.service.ready
        body = {"status": "ready" if ready else "not ready", **self.service.status()}
        if ready:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503,
                            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})

    async def metrics(self, request: Request) -> Response:
        self.service.update_gauges()
        return Response(self.service.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def build(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.service.start()
            try:
                yield
            finally:
                await self.service.stop()

        routes = [
            Route("/v1/configs/models", self.post_model, methods=["POST"]),
            Route("/v1/configs/models", self.list_models, methods=["GET"]),
            Route("/v1/configs/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/configs/export", self.export, methods=["GET"]),
            Route("/v1/configs/epoch", self.epoch, methods=["GET"]),
            Route("/v1/configs/bundles", self.list_bundles, methods=["GET"]),
            Route("/v1/configs/bundles/{name}", self.get_bundle, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *api_docs_routes(CONFIG_OPERATIONS, "Heron config service"),
        ]
        app = Starlette(routes=routes, exception_handlers=dict(EXCEPTION_HANDLERS),
                        lifespan=lifespan)
        app.state.config = self.service
        return app
