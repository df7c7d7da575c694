"""The gateway's HTTP routes: the worker's inference API, served by routing each request's
work through its pool's JetStream stream (gateway/app.py builds and serves the app).

Per request: parse and validate exactly as a worker would (bad input never reaches NATS),
resolve model -> bundle -> pool (or the pool named by X-Heron-Pool: gateway/pools.py, which
also serves /v1/pools), answer 503 when NATS is away, 202 when the pool has no
healthy worker (and publish demand), otherwise publish the work items, reassemble the
results and answer in the client's format.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from heron.gateway.auth import ApiKeyMiddleware, api_keys_from_env
from heron.gateway.configs import ConfigServiceSource, GatewayConfigSync, model_status
from heron.gateway.demand import DemandTracker
from heron.gateway.dispatcher import Dispatcher, WorkRequest
from heron.gateway.health import WorkerHealth
from heron.gateway.metrics import GatewayMetrics, gateway_phases
from heron.gateway.nats_link import NatsLink
from heron.gateway.pools import GatewayPools
from heron.gateway.reassembly import Reassembly, merge_items, merge_scores
from heron.gateway.registry import ModelRoute, RouteTable, check_encode_outputs, describe
from heron.gateway.settings import GatewaySettings
from heron.gateway.status_page import ClusterStatusPage
from heron.runtime import telemetry
from heron.runtime.http import (
    CLIENT_CLOSED_STATUS,
    EXCEPTION_HANDLERS,
    ClientDisconnected,
    RequestScope,
    note_route,
    read_body,
    respond,
    server_timing,
    unless_disconnected,
)
from heron.runtime.logs import current_request
from heron.runtime.nats_names import (
    STATUS_WILDCARD,
    demand_message,
    demand_subject,
    ensure_dlq_stream,
    ensure_work_stream,
    inbox_prefix,
    token,
)
from heron.runtime.openai_compat import embeddings_response, parse_embeddings_request
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.ids import new_request_id
from heron_sdk.types import EncodeRequest, ExtractRequest, Item, RequestOptions, ScoreRequest

log = logging.getLogger("heron.gateway")


@dataclass(slots=True)
class Answer:
    body: dict[str, Any]
    model_id: str
    timings: dict[str, float]


class Provisioning(Exception):
    """No healthy worker for the pool: answered 202 with Retry-After, not an error."""

    def __init__(self, pool: str, bundle: str, estimated_wait_s: float,
                 retry_after_s: float) -> None:
        super().__init__(f"pool {pool} is provisioning")
        self.body = {"status": "provisioning", "pool": pool, "bundle": bundle,
                     "estimated_wait_s": estimated_wait_s}
        self.retry_after_s = retry_after_s


class GatewayApp:
    def __init__(self, nats_url: str, registry: RouteTable, *,
                 settings: GatewaySettings | None = None, gateway_id: str | None = None,
                 config_url: str | None = None) -> None:
        self.settings = settings or GatewaySettings()
        self.gateway_id = token(gateway_id or default_gateway_id())
        self.registry = registry
        # With a config service the registry fills from its snapshot (gateway/configs.py).
        self.config_sync: GatewayConfigSync | None = None
        if config_url is not None:
            source = ConfigServiceSource(registry.pool_names())
            registry.source = source
            self.config_sync = GatewayConfigSync(self, config_url, source)
        elif not registry.loaded:
            registry.load()
        self.metrics = GatewayMetrics()
        self.health = WorkerHealth(self.settings.heartbeat_timeout_s)
        self.demand = DemandTracker(self.settings.demand_window_s,
                                    self.settings.demand_publish_interval_s)
        for pool, bundle in registry.pools().items():
            self.health.expect(pool, bundle, registry.bundle_hash(pool))
        self.link = NatsLink(nats_url, name=f"heron-gateway-{self.gateway_id}",
                             setup=self._set_up_nats, on_reconnect=self._after_reconnect,
                             connect_timeout_s=self.settings.connect_timeout_s)
        self.dispatcher = Dispatcher(self.link, self.gateway_id, self.settings, self.metrics)
        self.pools = GatewayPools(self)  # leased pools (NATS KV) and X-Heron-Pool routing
        self._subscribed = False
        self._status_since = 0.0

    # ---- NATS set-up ---------------------------------------------------------------------
    async def declare_streams(self, nc: NatsClient, js: JetStreamContext) -> None:
        for pool in self.pools.all_pools():
            await ensure_work_stream(js, self.settings.stream_spec(pool))
        await ensure_dlq_stream(js, self.settings.stream_file_storage)

    async def _after_reconnect(self, nc: NatsClient, js: JetStreamContext) -> None:
        # Heartbeats went stale while NATS was away: give workers the start-up grace to
        # beat again before calling a warm pool cold (202).
        self._status_since = time.monotonic()
        await self.pools.start(js)  # watch the pools bucket afresh: leases may have ended
        await self.declare_streams(nc, js)

    async def _set_up_nats(self, nc: NatsClient, js: JetStreamContext) -> None:
        await self.declare_streams(nc, js)
        await self.pools.start(js)
        if not self._subscribed:
            await nc.subscribe(inbox_prefix(self.gateway_id) + ".>",
                               cb=self.dispatcher.on_result)
            await nc.subscribe(STATUS_WILDCARD, cb=self._on_status)
            self._subscribed = True
            self._status_since = time.monotonic()
        if self.config_sync is not None:
            await self.config_sync.start(nc)

    async def _on_status(self, msg: Msg) -> None:
        try:
            beat = wire.decode(msg.data, wire.MSGPACK)
        except HeronError as exc:
            log.warning("dropping an undecodable heartbeat on %s: %s", msg.subject, exc)
            return
        if isinstance(beat, Mapping):
            self.health.observe(beat)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.link.start()
        try:
            yield
        finally:
            await self.pools.stop()
            if self.config_sync is not None:
                await self.config_sync.stop()
            await self.link.close()

    # ---- the request path ------------------------------------------------------------------
    async def _inference(self, request: Request, route_name: str,
                         handle: Callable[[Any], Awaitable[Answer]], *,
                         json_only: bool = False, read: bool = True) -> Response:
        started = time.monotonic()
        status, label = 500, request.path_params.get("model", "_unknown")
        scope = RequestScope(request, telemetry.GATEWAY, route_name, log)
        try:
            body, fmt = await read_body(request) if read else (None, None)
            # A client that disconnects stops the wait: its items stop counting against the
            # pool's backlog at once (workers drop them when their deadline passes).
            answer = await unless_disconnected(request, handle(body))
            status, label = 200, answer.model_id
            headers = self._headers(scope.request_id, answer, started)
            if json_only:  # OpenAI clients speak JSON only, whatever they send in Accept
                return Response(wire.encode(answer.body, wire.JSON), media_type=wire.JSON,
                                headers=headers)
            return respond(request, answer.body, request_fmt=fmt, headers=headers)
        except Provisioning as wait:
            status = 202
            headers = {"Retry-After": str(max(1, round(wait.retry_after_s))),
                       "X-Request-Id": scope.request_id}
            return respond(request, wait.body, status=202, headers=headers)
        except HeronError as exc:
            status = exc.status
            raise
        except ClientDisconnected:
            status = CLIENT_CLOSED_STATUS
            return Response(status_code=CLIENT_CLOSED_STATUS)
        finally:
            # Labels use model ids; unknown names must not mint new label values.
            model = self.registry.canonical_id(label) or "_unknown"
            self.metrics.requests.labels(route_name, model, str(status)).inc()
            self.metrics.latency.labels(route_name, model).observe(time.monotonic() - started)
            scope.finish(status, None if model == "_unknown" else model)

    def _headers(self, request_id: str, answer: Answer, started: float) -> dict[str, str]:
        """Server-Timing: the gateway's phases, the last-answered slice's worker phases, and the
        gateway's total; each phase also goes to heron_gateway_phase_duration_seconds."""
        phases = gateway_phases(answer.timings)
        for phase, seconds in phases.items():
            self.metrics.phase.labels(phase, answer.model_id).observe(seconds)
        phases["total"] = time.monotonic() - started
        return {"Server-Timing": server_timing(phases), "X-Request-Id": request_id}

    def _route(self, request: Request, model: str, task: str) -> ModelRoute:
        """model -> bundle -> pool, or the pool the request names in X-Heron-Pool."""
        return self.pools.route(request, self.registry.route_for(model, task))

    async def _dispatch(self, route: ModelRoute, task: str, wire_body: dict[str, Any],
                        items: list[Item], options: RequestOptions,
                        shared_text: str = "", partial: bool = False) -> Reassembly:
        if not self.link.ready:
            raise self.dispatcher.nats_unavailable("not connected to NATS; retry shortly")
        await self._require_capacity(route)
        note_route(route.model_id, route.pool)  # the request's log lines and span name both
        context = current_request()  # bound by RequestScope: the client's X-Request-Id
        return await self.dispatcher.submit(WorkRequest(
            request_id=context.request_id if context else new_request_id(),
            pool=route.pool, task=task, model_id=route.model_id, wire_body=wire_body,
            items=items, timeout_s=options.timeout_s or self.settings.default_timeout_s,
            priority=options.priority, shared_text=shared_text, partial=partial))

    async def _require_capacity(self, route: ModelRoute) -> None:
        pool = route.pool
        if not self.health.has_capacity(pool):
            grace = self.settings.startup_grace_s - (time.monotonic() - self._status_since)
            if not await self.health.wait_for_capacity(pool, grace):
                await self._provisioning(route)
        self.demand.satisfied(pool)

    async def _provisioning(self, route: ModelRoute) -> None:
        pool, s = route.pool, self.settings
        if self.demand.record(pool) and self.link.nc is not None:
            try:
                await self.link.nc.publish(demand_subject(pool), wire.encode(
                    demand_message(pool, route.bundle), wire.MSGPACK))
            except Exception as exc:  # demand is a hint; the 202 stands regardless
                log.warning("publishing demand for pool %s failed: %r", pool, exc)
        self.metrics.pending_demand.labels(pool).set(self.demand.pending(pool))
        raise Provisioning(pool, route.bundle, self.demand.estimated_wait_s(
            pool, s.provisioning_estimate_s, s.provisioning_retry_after_s),
            s.provisioning_retry_after_s)

    # ---- inference routes ------------------------------------------------------------------
    async def encode(self, request: Request) -> Response:
        async def handle(body: Any) -> Answer:
            req = EncodeRequest.from_wire(body)
            route = self._route(request, request.path_params["model"], "encode")
            check_encode_outputs(route, req)
            done = await self._dispatch(route, "encode", req.to_wire(), req.items, req.options,
                                        partial=True)
            return Answer(merge_items(route.model_id, done.parts(), done.expected,
                                      done.failures()), route.model_id, done.timings)

        return await self._inference(request, "encode", handle)

    async def score(self, request: Request) -> Response:
        async def handle(body: Any) -> Answer:
            req = ScoreRequest.from_wire(body)
            route = self._route(request, request.path_params["model"], "score")
            wire_body = req.to_wire()
            wire_body.pop("top_k", None)  # slices rank all their items; top_k applies here
            done = await self._dispatch(route, "score", wire_body, req.items, req.options,
                                        shared_text=req.query)
            return Answer(merge_scores(route.model_id, done.parts(), done.expected, req.top_k),
                          route.model_id, done.timings)

        return await self._inference(request, "score", handle)

    async def extract(self, request: Request) -> Response:
        async def handle(body: Any) -> Answer:
            req = ExtractRequest.from_wire(body)
            route = self._route(request, request.path_params["model"], "extract")
            done = await self._dispatch(route, "extract", req.to_wire(), req.items,
                                        req.options, partial=True)
            return Answer(merge_items(route.model_id, done.parts(), done.expected,
                                      done.failures()), route.model_id, done.timings)

        return await self._inference(request, "extract", handle)

    async def embeddings(self, request: Request) -> Response:
        async def handle(body: Any) -> Answer:
            model, texts, encoding, dims = parse_embeddings_request(body)
            route = self._route(request, model, "encode")
            req = EncodeRequest(items=[Item(t) for t in texts], dims=dims)
            check_encode_outputs(route, req)
            done = await self._dispatch(route, "encode", req.to_wire(), req.items, req.options)
            merged = merge_items(route.model_id, done.parts(), done.expected)
            vectors = [row["dense"] for row in merged["items"]]
            return Answer(embeddings_response(route.model_id, vectors,
                                              merged["usage"]["tokens"], encoding),
                          route.model_id, done.timings)

        return await self._inference(request, "embeddings", handle, json_only=True)

    # ---- models, health, metrics -----------------------------------------------------------
    def _describe(self, route: ModelRoute) -> dict[str, Any]:
        return describe(route, self.health.model_state(route.pool, route.model_id))

    async def list_models(self, request: Request) -> Response:
        data = [self._describe(r) for r in self.registry.models()]
        return respond(request, {"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        return respond(request, self._describe(self.registry.resolve(
            request.path_params["model"])))

    async def provision(self, request: Request) -> Response:
        """Is there capacity for the model in its pool (or X-Heron-Pool's)? 200 when a
        healthy worker has it ready, 503 MODEL_LOADING while the pool's workers have not,
        else the 202 of an inference request (demand published). Nothing is queued."""
        async def handle(_: Any) -> Answer:
            route = self.pools.route(request, self.registry.resolve(
                request.path_params["model"]))
            if not self.link.ready:
                raise self.dispatcher.nats_unavailable("not connected to NATS; retry shortly")
            await self._require_capacity(route)
            healthy = self.health.healthy(route.pool)
            state = self.health.model_state(route.pool, route.model_id)
            if state != "ready":
                raise HeronError(ErrorCode.MODEL_LOADING, f"model {route.model_id} is "
                                 f"{state} on the {len(healthy)} healthy workers of pool "
                                 f"{route.pool}", retry_after_s=self.settings
                                 .provisioning_retry_after_s)
            return Answer({"model": route.model_id, "pool": route.pool, "state": "ready",
                           "healthy_workers": len(healthy)}, route.model_id, {})

        return await self._inference(request, "provision", handle, read=False)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        ready = self.link.ready and self.registry.loaded
        leased = self.pools.leased()
        pools = {pool: {"bundle": bundle, "kind": "lease" if pool in leased else "static",
                        "healthy_workers": len(self.health.healthy(pool)),
                        "outstanding_items": self.dispatcher.outstanding(pool)}
                 for pool, bundle in self.pools.all_pools().items()}
        body: dict[str, Any] = {"status": "ready" if ready else "not_ready",
                                "nats_connected": self.link.connected,
                                "registry_loaded": self.registry.loaded,
                                "gateway_id": self.gateway_id, "pools": pools}
        if self.link.last_error:
            body["error"] = self.link.last_error
        return JSONResponse(body, status_code=200 if ready else 503,
                            headers=None if ready else {"Retry-After": "2"})

    async def metrics_endpoint(self, request: Request) -> Response:
        for pool in {*self.pools.all_pools(), *self.demand.pools()}:
            self.metrics.pending_demand.labels(pool).set(self.demand.pending(pool))
            self.metrics.healthy_workers.labels(pool).set(len(self.health.healthy(pool)))
        self.metrics.nats_connected.set(1 if self.link.connected else 0)
        if self.config_sync is not None and self.config_sync.epoch >= 0:
            self.metrics.config_epoch.set(self.config_sync.epoch)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def config_status(self, request: Request) -> Response:
        return await model_status(self, request)

    def build(self) -> Starlette:
        routes = [
            Route("/v1/encode/{model:path}", self.encode, methods=["POST"]),
            Route("/v1/score/{model:path}", self.score, methods=["POST"]),
            Route("/v1/extract/{model:path}", self.extract, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            # Before /v1/models/{model:path}, whose path would swallow "/provision".
            Route("/v1/models/{model:path}/provision", self.provision, methods=["POST"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/pools", self.pools.create, methods=["POST"]),
            Route("/v1/pools", self.pools.list_pools, methods=["GET"]),
            Route("/v1/pools/{name}", self.pools.get_pool, methods=["GET"]),
            Route("/v1/pools/{name}", self.pools.delete_pool, methods=["DELETE"]),
            Route("/v1/pools/{name}/renew", self.pools.renew_pool, methods=["POST"]),
            Route("/v1/configs/models/{model:path}/status", self.config_status,
                  methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            *ClusterStatusPage(self).routes(),  # the live cluster page: / and its WebSocket
        ]
        app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS,
                        lifespan=self.lifespan,
                        middleware=[Middleware(ApiKeyMiddleware, keys=api_keys_from_env())])
        app.state.gateway = self  # tests and `heron up` reach the live object through here
        return app


def default_gateway_id() -> str:
    """Unique per process: two gateways must never share an inbox."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
