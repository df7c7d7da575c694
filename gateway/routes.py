"""The gateway: the inference API's remote backend (heron.runtime.front serves the HTTP side)
and the gateway-only routes on top of it (gateway/app.py builds and serves the app).

Per call: the front parses and validates exactly as a worker would (bad input never reaches
NATS); the backend resolves model -> bundle -> pool (or the pool named by X-Heron-Pool:
gateway/pools.py, which also serves /v1/pools), answers 503 when NATS is away, 202 when the
pool has no healthy worker (and publishes demand), otherwise publishes the work items and
reassembles the results.

Bulk jobs (``/v1/jobs``: gateway/jobs.py) run on the same path: their shards are encode
requests made from inside (``encode_rows``), at a low priority (gateway/job_runner.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from heron.gateway.configs import ConfigServiceSource, GatewayConfigSync, model_status
from heron.gateway.demand import DemandTracker
from heron.gateway.dispatcher import Dispatcher, WorkRequest
from heron.gateway.health import WorkerHealth
from heron.gateway.jobs import GatewayJobs
from heron.gateway.metrics import GatewayMetrics, gateway_phases
from heron.gateway.pools import GatewayPools
from heron.gateway.reassembly import Reassembly, merge_items, merge_scores
from heron.gateway.registry import ModelRoute, RouteTable, check_encode_outputs, describe
from heron.gateway.settings import GatewaySettings
from heron.gateway.slicing import chunk_weights
from heron.gateway.status_page import ClusterStatusPage, subscribe_supervisor_events
from heron.runtime import api_types as api
from heron.runtime import telemetry
from heron.runtime.adapters import AUTO
from heron.runtime.backend import (
    Answer,
    InferenceCall,
    Provisioning,
    Readiness,
    settle_item_errors,
)
from heron.runtime.http import note_route, respond
from heron.runtime.inference_app import build_inference_app
from heron.runtime.logs import current_request
from heron.runtime.modelconfig import lora_source
from heron.runtime.nats_link import NatsLink
from heron.runtime.nats_names import (
    STATUS_WILDCARD,
    Lane,
    demand_subject,
    ensure_dlq_stream,
    ensure_work_stream,
    inbox_prefix,
    token,
)
from heron.runtime.openapi import ApiOperation
from heron.runtime.protocol import DemandNotice
from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.ids import new_request_id
from heron_sdk.types import EncodeRequest, ExtractRequest, Item, RequestOptions, ScoreRequest

log = logging.getLogger("heron.gateway")

# The gateway's own routes, as its OpenAPI document describes them (the inference API's are
# heron.runtime.front.INFERENCE_OPERATIONS).
_POOL_ERRORS = api.error_statuses(409, 503)
GATEWAY_OPERATIONS: tuple[ApiOperation, ...] = (
    ApiOperation("POST", "/v1/pools", "createPool", "Lease a pool of workers for a bundle",
                 "pools", request=api.PoolCreateBody,
                 responses={201: api.PoolView, **_POOL_ERRORS}, auth=True),
    ApiOperation("GET", "/v1/pools", "listPools", "Every pool, static and leased", "pools",
                 responses={200: api.PoolList}, auth=True),
    ApiOperation("GET", "/v1/pools/{name}", "getPool", "One pool and its capacity", "pools",
                 responses={200: api.PoolView}, auth=True),
    ApiOperation("DELETE", "/v1/pools/{name}", "deletePool", "End a pool's lease", "pools",
                 responses={200: api.PoolDeleted, **_POOL_ERRORS}, auth=True),
    ApiOperation("POST", "/v1/pools/{name}/renew", "renewPool", "Extend a pool's lease",
                 "pools", request=api.PoolRenewBody, request_required=False,
                 responses={200: api.PoolView, **_POOL_ERRORS}, auth=True),
    ApiOperation("POST", "/v1/jobs", "createJob", "Start a bulk job: encode every row of a "
                 "file into an output file", "jobs", request=api.JobCreateBody,
                 responses={202: api.JobView, **api.error_statuses(403, 404, 503)},
                 request_media=("application/json", "application/msgpack"), auth=True),
    ApiOperation("GET", "/v1/jobs", "listJobs", "Every bulk job", "jobs",
                 responses={200: api.JobList, **api.error_statuses(503)}, auth=True),
    ApiOperation("GET", "/v1/jobs/{job_id}", "getJob", "A bulk job's state and progress",
                 "jobs", responses={200: api.JobView, **api.error_statuses(404, 503)},
                 auth=True),
    ApiOperation("DELETE", "/v1/jobs/{job_id}", "cancelJob", "Cancel a bulk job", "jobs",
                 responses={200: api.JobView, **api.error_statuses(404, 503)}, auth=True),
    ApiOperation("GET", "/v1/configs/models/{model}/status", "getModelConfigStatus",
                 "Which workers of the model's pool applied its config", "configs",
                 auth=True),
)


class GatewayApp:
    """The remote backend: its NATS link, pools, worker health and demand, and the app."""

    telemetry_scope = telemetry.GATEWAY
    log = log

    def __init__(self, nats_url: str, registry: RouteTable, *,
                 settings: GatewaySettings | None = None, gateway_id: str | None = None,
                 config_url: str | None = None) -> None:
        self.settings = settings or GatewaySettings()
        self.gateway_id = token(gateway_id or default_gateway_id())
        self.registry = registry
        self.metrics = GatewayMetrics()
        self.health = WorkerHealth(self.settings.heartbeat_timeout_s)
        self.demand = DemandTracker(self.settings.demand_window_s,
                                    self.settings.demand_publish_interval_s)
        # With a config service the registry fills from its snapshot (gateway/configs.py).
        self.config_sync: GatewayConfigSync | None = None
        if config_url is not None:
            source = ConfigServiceSource(registry.pool_names())
            registry.source = source
            self.config_sync = GatewayConfigSync(config_url, source, registry, self.health,
                                                 declare_streams=self._declare_if_connected)
        elif not registry.loaded:
            registry.load()
        for pool, bundle in registry.pools().items():
            self.health.expect(pool, bundle, registry.bundle_hash(pool))
        self.link = NatsLink(nats_url, name=f"heron-gateway-{self.gateway_id}",
                             setup=self._set_up_nats, on_reconnect=self._after_reconnect,
                             connect_timeout_s=self.settings.connect_timeout_s)
        self.dispatcher = Dispatcher(self.link, self.gateway_id, self.settings, self.metrics)
        # Leased pools (NATS KV) and X-Heron-Pool routing.
        self.pools = GatewayPools(registry, self.health, self.settings,
                                  jetstream=self._jetstream,
                                  nats_unavailable=self.dispatcher.nats_unavailable,
                                  on_pool_ended=self._forget_pool)
        # Bulk jobs (NATS KV) and this gateway's loop that runs them.
        self.jobs = GatewayJobs(self, jetstream=self._jetstream,
                                nats_unavailable=self.dispatcher.nats_unavailable)
        self._subscribed = False
        self.status_page: ClusterStatusPage | None = None  # set by build()
        self._status_since = 0.0  # the last (re)connect's set-up: the grace runs from it

    # ---- NATS set-up ---------------------------------------------------------------------
    async def declare_streams(self, nc: NatsClient, js: JetStreamContext) -> None:
        for pool in self.pools.all_pools():
            await ensure_work_stream(js, self.settings.stream_spec(pool))
        await ensure_dlq_stream(js, self.settings.stream_file_storage)

    async def _declare_if_connected(self) -> None:
        """New pools' streams after a config change; a reconnect declares them anyway."""
        link = self.link
        if link.ready and link.nc is not None and link.js is not None:
            await self.declare_streams(link.nc, link.js)

    def _jetstream(self) -> JetStreamContext:
        """JetStream for a pools write, or 503 NATS_UNAVAILABLE while NATS is away."""
        if not self.link.ready or self.link.js is None:
            raise self.dispatcher.nats_unavailable("not connected to NATS; retry shortly")
        return self.link.js

    def _forget_pool(self, pool: str) -> None:
        """A leased pool ended: no more demand, metrics or health for it."""
        self.demand.forget(pool)
        self.metrics.forget_pool(pool)
        self.health.forget(pool)

    async def _after_reconnect(self, nc: NatsClient, js: JetStreamContext) -> None:
        # Heartbeats went stale while NATS was away: give workers time to beat again before
        # calling a warm pool cold (202). A worker reconnects on its own schedule (0.5 s
        # between tries) and then beats within a second; on a loaded host that took over
        # 3 s (202s in CI's NATS restart test with the heartbeat timeout as the grace).
        # _grace_left_s gives a pool that was warm when the connection was lost
        # reconnect_grace_s; any other pool, the heartbeat timeout.
        self._status_since = time.monotonic()
        await self.pools.start(js)  # watch the pools bucket afresh: leases may have ended
        await self.jobs.loop.watch()  # and the jobs bucket
        await self.declare_streams(nc, js)

    async def _set_up_nats(self, nc: NatsClient, js: JetStreamContext) -> None:
        await self.declare_streams(nc, js)
        await self.pools.start(js)
        if not self._subscribed:
            await nc.subscribe(inbox_prefix(self.gateway_id) + ".>",
                               cb=self.dispatcher.on_result)
            await nc.subscribe(STATUS_WILDCARD, cb=self._on_status)
            if self.status_page is not None:  # heron up's restarts, for the cluster page
                await subscribe_supervisor_events(nc, self.status_page)
            self._subscribed = True
            self._status_since = time.monotonic()
        if self.config_sync is not None:
            await self.config_sync.start(nc)
        self.jobs.loop.start()  # idempotent; it waits out NATS being away by itself
        await self.jobs.loop.watch()

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
            await self.jobs.loop.stop()
            await self.pools.stop()
            if self.config_sync is not None:
                await self.config_sync.stop()
            await self.link.close()

    # ---- the request path ------------------------------------------------------------------
    def _answer(self, body: dict[str, Any], route: ModelRoute, done: Reassembly) -> Answer:
        """The gateway's phases and the last-answered slice's worker phases (Server-Timing);
        each also goes to heron_gateway_phase_duration_seconds."""
        phases = gateway_phases(done.timings)
        model_id = route.model_id
        self.metrics.observe_phases(model_id, phases)
        return Answer(body, model_id, phases)

    def _route(self, call: InferenceCall, model: str, task: str) -> ModelRoute:
        """model -> bundle -> pool, or the pool the request names in X-Heron-Pool."""
        route = self._detected(self.pools.route(call.headers,
                                                self.registry.route_for(model, task)))
        route.check_task(task)  # again, where "auto" has turned out to be a family
        return route

    def _detected(self, route: ModelRoute) -> ModelRoute:
        """An ``auto`` model's route with the family its pool's workers loaded it as."""
        if route.config.adapter != AUTO:
            return route
        family = self.health.model_adapter(route.pool, route.model_id)
        return route if family is None else dataclasses.replace(route,
                                                                detected_adapter=family)

    async def _dispatch(self, route: ModelRoute, task: str, wire_body: dict[str, Any],
                        items: list[Item], options: RequestOptions, call: InferenceCall,
                        shared_text: str = "", partial: bool = False, bulk: bool = False,
                        weights: list[int] | None = None) -> Reassembly:
        lora_source(route.config, options.adapter)  # 404 for an adapter it does not list
        timeout_s = options.timeout_s or self.settings.default_timeout_s
        # First: with NATS away, heartbeats stop too, and the pool would look cold (202).
        await self.dispatcher.ensure_nats(timeout_s, call.received_at)
        await self._require_capacity(route, deadline=call.received_at + timeout_s)
        note_route(route.model_id, route.pool)  # the request's log lines and span name both
        context = current_request()  # bound by RequestScope: the client's X-Request-Id
        healthy = self.health.healthy(route.pool)
        return await self.dispatcher.submit(WorkRequest(
            request_id=context.request_id if context else new_request_id(),
            pool=route.pool, task=task, model_id=route.model_id, wire_body=wire_body,
            items=items, timeout_s=timeout_s, received_at=call.received_at,
            priority=options.priority, workers=len(healthy),
            shared_text=shared_text, partial=partial, bulk=bulk, weights=weights,
            low_lane=options.priority <= 0 or self.health.all_pull(healthy, Lane.LOW)))

    async def _require_capacity(self, route: ModelRoute, deadline: float | None = None
                                ) -> None:
        """Return when the pool has a healthy worker; else, once the grace after (re)connect
        has passed (or the request's ``deadline``, monotonic), 202 PROVISIONING."""
        pool = route.pool
        if not self.health.has_capacity(pool):
            grace = self._grace_left_s(pool)
            if deadline is not None:
                grace = min(grace, deadline - time.monotonic())
            if not await self.health.wait_for_capacity(pool, grace):
                await self._provisioning(route)
        self.demand.satisfied(pool)

    def _grace_left_s(self, pool: str) -> float:
        """How much longer a request for ``pool``, which has no healthy worker, waits for a
        beat. The grace runs from the last (re)connect: startup_grace_s after the first; after
        a reconnect at least the heartbeat timeout, reconnect_grace_s for a pool that was warm
        when NATS went away."""
        now = time.monotonic()
        lost = self.link.disconnected_at
        if lost is None:
            return self.settings.startup_grace_s - (now - self._status_since)
        # NATS is back (ensure_nats returned) but _after_reconnect may not have run yet: the
        # client says it is connected a round trip before it calls back. Under load 7 of 64
        # requests that waited out an outage took that window (CI) and got 202 for a warm
        # pool. A reconnect the hook has not seen starts the grace now.
        since = now if lost >= self._status_since else self._status_since
        grace = max(self.settings.startup_grace_s, self.health.timeout_s)
        if self.health.was_healthy_at(pool, lost):
            grace = max(grace, self.settings.reconnect_grace_s)
        return grace - (now - since)

    async def _provisioning(self, route: ModelRoute) -> None:
        pool, s = route.pool, self.settings
        if self.demand.record(pool) and self.link.nc is not None:
            try:
                await self.link.nc.publish(demand_subject(pool), wire.encode(
                    DemandNotice(pool, route.bundle).to_wire(), wire.MSGPACK))
            except Exception as exc:  # demand is a hint; the 202 stands regardless
                log.warning("publishing demand for pool %s failed: %r", pool, exc)
        self.metrics.pending_demand.labels(pool).set(self.demand.pending(pool))
        raise Provisioning(pool, route.bundle, self.demand.estimated_wait_s(
            pool, s.provisioning_estimate_s, s.provisioning_retry_after_s),
            s.provisioning_retry_after_s)

    # ---- the inference backend -------------------------------------------------------------
    async def encode(self, model: str, req: EncodeRequest, call: InferenceCall) -> Answer:
        route = self._route(call, model, "encode")
        check_encode_outputs(route, req)
        # All or nothing (OpenAI embeddings): any failed slice fails the call.
        partial = not call.all_or_nothing
        done = await self._dispatch(route, "encode", req.to_wire(), req.items, req.options,
                                    call, partial=partial, weights=_chunk_weights(route, req))
        failures = done.failures() if partial else ()
        body = merge_items(route.model_id, done.parts(), done.expected, failures)
        settle_item_errors(body, call)
        return self._answer(body, route, done)

    def job_route(self, model: str, req: EncodeRequest) -> ModelRoute:
        """A bulk job's model, checked as encode checks it (404, 422) when it is created."""
        route = self._route(InferenceCall(headers={}), model, "encode")
        check_encode_outputs(route, req)
        return route

    async def encode_rows(self, model: str, req: EncodeRequest) -> dict[str, Any]:
        """A bulk job's shard (gateway/job_runner.py): encode's dispatch path as an internal
        call, on the pool's bulk lane, at the request's own priority. Every item's error
        stays in its row, even when no item succeeded: the job records failed rows, it
        does not fail."""
        call = InferenceCall(headers={})
        route = self.job_route(model, req)
        done = await self._dispatch(route, "encode", req.to_wire(), req.items, req.options,
                                    call, partial=True, bulk=True,
                                    weights=_chunk_weights(route, req))
        return merge_items(route.model_id, done.parts(), done.expected, done.failures())

    async def score(self, model: str, req: ScoreRequest, call: InferenceCall) -> Answer:
        route = self._route(call, model, "score")
        wire_body = req.to_wire()
        wire_body.pop("top_k", None)  # slices rank all their items; top_k applies here
        done = await self._dispatch(route, "score", wire_body, req.items, req.options,
                                    call, shared_text=req.query)
        return self._answer(merge_scores(route.model_id, done.parts(), done.expected,
                                         req.top_k), route, done)

    async def extract(self, model: str, req: ExtractRequest, call: InferenceCall) -> Answer:
        route = self._route(call, model, "extract")
        done = await self._dispatch(route, "extract", req.to_wire(), req.items, req.options,
                                    call, partial=True)
        return self._answer(merge_items(route.model_id, done.parts(), done.expected,
                                        done.failures()), route, done)

    async def tokenize(self, model: str, req: TokenizeRequest, call: InferenceCall
                       ) -> Answer:
        """A worker of the model's pool tokenizes (a work item of task ``tokenize``): the
        gateway has no tokenizer. Every family has one, so no task is checked."""
        route = self._detected(self.pools.route(call.headers, self.registry.resolve(model)))
        done = await self._dispatch(route, "tokenize", req.to_wire(), req.items, req.options,
                                    call)
        return self._answer(merge_items(route.model_id, done.parts(), done.expected), route,
                            done)

    async def decode(self, model: str, req: DecodeRequest, call: InferenceCall) -> Answer:
        route = self._detected(self.pools.route(call.headers, self.registry.resolve(model)))
        done = await self._dispatch(route, "decode", req.to_wire(), req.size_items(),
                                    req.options, call)
        return self._answer(merge_items(route.model_id, done.parts(), done.expected), route,
                            done)

    async def provision(self, model: str, call: InferenceCall) -> Answer:
        """Is there capacity for the model in its pool (or X-Heron-Pool's)? 200 when a
        healthy worker has it ready, 503 MODEL_LOADING while the pool's workers have not,
        else the 202 of an inference request (demand published). Nothing is queued."""
        route = self.pools.route(call.headers, self.registry.resolve(model))
        if not self.link.ready:
            raise self.dispatcher.nats_unavailable("not connected to NATS; retry shortly")
        await self._require_capacity(route)
        healthy = self.health.healthy(route.pool)
        state = self.health.model_state(route.pool, route.model_id)
        if state != "ready":
            raise HeronError(ErrorCode.MODEL_LOADING, f"model {route.model_id} is {state} on "
                             f"the {len(healthy)} healthy workers of pool {route.pool}",
                             retry_after_s=self.settings.provisioning_retry_after_s)
        return Answer({"model": route.model_id, "pool": route.pool, "state": "ready",
                       "healthy_workers": len(healthy)}, route.model_id, {})

    def _describe(self, route: ModelRoute) -> dict[str, Any]:
        return describe(self._detected(route),
                        self.health.model_state(route.pool, route.model_id))

    def models(self) -> list[dict[str, Any]]:
        return [self._describe(r) for r in self.registry.models()]

    def model(self, name: str) -> dict[str, Any]:
        return self._describe(self.registry.resolve(name))

    def readiness(self) -> Readiness:
        link, loaded = self.link, self.registry.loaded
        status = ("ready" if link.ready and loaded else
                  "disconnected" if not link.connected else "loading")
        leased = self.pools.leased()
        pools = {pool: {"bundle": bundle, "kind": "lease" if pool in leased else "static",
                        "healthy_workers": len(self.health.healthy(pool)),
                        "outstanding_items": self.dispatcher.outstanding(pool)}
                 for pool, bundle in self.pools.all_pools().items()}
        models = {r.model_id: self.health.model_state(r.pool, r.model_id)
                  for r in self.registry.models()}
        details: dict[str, Any] = {"registry_loaded": loaded, "gateway_id": self.gateway_id,
                                   "pools": pools}
        if link.last_error:
            details["error"] = link.last_error
        return Readiness(status, models, link.connected, details)

    def canonical_id(self, name: str) -> str | None:
        return self.registry.canonical_id(name)

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        metrics = self.metrics
        metrics.of(metrics.requests, route, model, str(status)).inc()
        metrics.of(metrics.latency, route, model).observe(seconds)

    def metrics_text(self) -> bytes:
        self.dispatcher.show_outstanding()
        for pool in {*self.pools.all_pools(), *self.demand.pools()}:
            self.metrics.pending_demand.labels(pool).set(self.demand.pending(pool))
            self.metrics.healthy_workers.labels(pool).set(len(self.health.healthy(pool)))
        self.metrics.nats_connected.set(1 if self.link.connected else 0)
        if self.config_sync is not None and self.config_sync.epoch >= 0:
            self.metrics.config_epoch.set(self.config_sync.epoch)
        return self.metrics.render()

    # ---- gateway-only routes ---------------------------------------------------------------
    async def config_status(self, request: Request) -> Response:
        sync = self.config_sync
        return respond(request, model_status(self.registry, self.health,
                                             request.path_params["model"],
                                             sync.epoch if sync else None))

    def build(self) -> Starlette:
        page = ClusterStatusPage(
            self.gateway_id, self.health, self.registry, self.pools,
            outstanding=self.dispatcher.outstanding, pending_demand=self.demand.pending,
            nats_connected=lambda: self.link.connected,
            ready=lambda: self.link.ready and self.registry.loaded,
            # .records, not the dict itself: the mirror swaps in a new one on a resync.
            jobs=lambda: (record for record, _ in self.jobs.loop.mirror.records.values()))
        self.status_page = page
        routes = [
            Route("/v1/pools", self.pools.create, methods=["POST"]),
            Route("/v1/pools", self.pools.list_pools, methods=["GET"]),
            Route("/v1/pools/{name}", self.pools.get_pool, methods=["GET"]),
            Route("/v1/pools/{name}", self.pools.delete_pool, methods=["DELETE"]),
            Route("/v1/pools/{name}/renew", self.pools.renew_pool, methods=["POST"]),
            Route("/v1/configs/models/{model:path}/status", self.config_status,
                  methods=["GET"]),
            Route("/v1/jobs", self.jobs.create, methods=["POST"]),
            Route("/v1/jobs", self.jobs.list_jobs, methods=["GET"]),
            Route("/v1/jobs/{job_id}", self.jobs.get_job, methods=["GET"]),
            Route("/v1/jobs/{job_id}", self.jobs.cancel_job, methods=["DELETE"]),
            *page.routes(),  # the live cluster page: / and its WebSocket
        ]
        app = build_inference_app(self, title="Heron gateway", lifespan=self.lifespan,
                                  extra_routes=routes, extra_operations=GATEWAY_OPERATIONS,
                                  max_in_flight=self.settings.max_concurrent_requests,
                                  max_body_bytes=self.settings.max_body_bytes,
                                  default_model=self.settings.default_model,
                                  cors_origins=self.settings.cors_origins,
                                  image_url_hosts=self.settings.image_url_hosts,
                                  image_url_timeout_s=self.settings.image_url_timeout_s)
        app.state.gateway = self  # tests and `heron up` reach the live object through here
        return app


def _chunk_weights(route: ModelRoute, req: EncodeRequest) -> list[int] | None:
    return chunk_weights(req.items, req.chunking, route.config.profile.max_sequence_length)


def default_gateway_id() -> str:
    """Unique per process: two gateways must never share an inbox."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
