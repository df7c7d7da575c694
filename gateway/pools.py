"""Pools at the gateway: the ``/v1/pools`` routes and routing by the ``X-Heron-Pool`` header.

The pools named on the command line (``--pool BUNDLE=POOL``) are *static*. Leased pools
live in the ``heron_pools`` NATS KV bucket (heron/runtime/pool_store.py), one key per pool with the
lease's TTL, so every gateway replica serves them and none holds state of its own: each
mirrors the bucket with a watcher started in its NATS set-up. A leased pool serves one of
the bundles this gateway routes; when its lease is deleted or runs out, requests naming
it get 404 POOL_NOT_FOUND and its demand signal ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from starlette.requests import Request
from starlette.responses import Response

from heron.gateway.health import WorkerHealth
from heron.gateway.registry import ModelRoute, RouteTable
from heron.gateway.settings import GatewaySettings
from heron.runtime.http import read_body, read_raw, respond
from heron.runtime.nats_names import ensure_work_stream
from heron.runtime.pool_store import LeaseMirror, PoolStore, pool_not_found
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.pools import POOL_HEADER, PoolLease, PoolSpec, check_pool_name, renew_ttl
from heron_sdk.types import check_fields, check_finite

# The fields of the pools API's bodies (PoolSpec and renew_ttl read them).
POOL_CREATE_FIELDS = frozenset({"name", "bundle", "workers", "ttl_s"})
POOL_RENEW_FIELDS = frozenset({"ttl_s"})

log = logging.getLogger("heron.gateway.pools")


class GatewayPools:
    """The gateway's pools: static (its registry's) and leased (the bucket's mirror).

    ``jetstream`` gives the context for a write (or raises 503 while NATS is away),
    ``nats_unavailable`` builds that 503, and ``on_pool_ended`` drops what the gateway keeps
    per pool when a lease ends."""

    def __init__(self, registry: RouteTable, health: WorkerHealth, settings: GatewaySettings,
                 *, jetstream: Callable[[], JetStreamContext],
                 nats_unavailable: Callable[[str], HeronError],
                 on_pool_ended: Callable[[str], None]) -> None:
        self.registry = registry
        self.health = health
        self.settings = settings
        self._jetstream = jetstream
        self._nats_unavailable = nats_unavailable
        self._on_pool_ended = on_pool_ended
        self.mirror = LeaseMirror(on_change=self._on_change)

    # ---- NATS ----------------------------------------------------------------------------
    async def start(self, js: JetStreamContext) -> None:
        """Watch the bucket (again, after a reconnect)."""
        await self.mirror.start(js)

    async def stop(self) -> None:
        await self.mirror.stop()

    # ---- lookups -------------------------------------------------------------------------
    def leased(self) -> dict[str, PoolLease]:
        """Live leases, static pool names left out (a static pool wins over a lease)."""
        static = self.registry.pools()
        return {n: lease for n, lease in self.mirror.live().items() if n not in static}

    def all_pools(self) -> dict[str, str]:
        """pool -> bundle, for every pool this gateway routes to: static and leased."""
        leased = {name: lease.bundle for name, lease in self.leased().items()}
        return {**leased, **self.registry.pools()}

    def bundle_of(self, name: str) -> str:
        static = self.registry.pools().get(name)
        if static is not None:
            return static
        return self._lease(name).bundle

    def _lease(self, name: str) -> PoolLease:
        lease = self.mirror.get(name)
        if lease is None and not self.mirror.synced:
            # Just connected: the bucket's state has not arrived yet; "no such pool" could
            # be wrong for a few milliseconds.
            raise HeronError(ErrorCode.NOT_READY, "the pools table is still loading from "
                             "NATS", retry_after_s=1.0)
        if lease is None:
            raise pool_not_found(name)
        return lease

    def route(self, headers: Mapping[str, str], route: ModelRoute) -> ModelRoute:
        """The route with the request's ``X-Heron-Pool`` header applied (none: unchanged).
        The named pool must serve the model's bundle."""
        name = headers.get(POOL_HEADER)
        if name is None:
            return route
        check_pool_name(name, POOL_HEADER)
        bundle = self.bundle_of(name)
        if bundle != route.bundle:
            raise HeronError(ErrorCode.MODEL_NOT_FOUND,
                             f"model {route.model_id!r} is not in bundle {bundle!r} served "
                             f"by pool {name!r} (it is in bundle {route.bundle!r})")
        return route if name == route.pool else dataclasses.replace(route, pool=name)

    def _bundle_hash(self, bundle: str) -> str | None:
        registry = self.registry
        for pool, name in registry.pools().items():
            if name == bundle:
                return registry.bundle_hash(pool)
        return None

    def _on_change(self, name: str, lease: PoolLease | None) -> None:
        if name in self.registry.pools():
            return  # a static pool of ours: the lease changes nothing here
        if lease is None:
            log.info("leased pool %s ended: no more routing or demand for it", name)
            self._on_pool_ended(name)
            return
        bundle_hash = self._bundle_hash(lease.bundle)
        if bundle_hash is not None:
            self.health.expect(name, lease.bundle, bundle_hash)

    # ---- descriptions ------------------------------------------------------------------
    def _capacity(self, pool: str) -> dict[str, Any]:
        healthy = len(self.health.healthy(pool))
        return {"state": "ready" if healthy else "provisioning", "healthy_workers": healthy}

    def describe_lease(self, lease: PoolLease) -> dict[str, Any]:
        return {**lease.to_wire(), **self._capacity(lease.name)}

    def describe_static(self, name: str, bundle: str) -> dict[str, Any]:
        return {"name": name, "bundle": bundle, "kind": "static", **self._capacity(name)}

    # ---- routes --------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body, _ = await read_body(request)
        spec = PoolSpec.from_wire(_checked(body, POOL_CREATE_FIELDS))
        registry = self.registry
        if not registry.loaded:
            raise HeronError(ErrorCode.NOT_READY, "the model registry is not loaded yet",
                             retry_after_s=1.0)
        static = registry.pools()
        bundles = sorted(set(static.values()))
        if spec.bundle not in bundles:
            raise invalid_field("bundle", f"{spec.bundle!r} is not routed by this gateway; "
                                f"known bundles: {', '.join(bundles)}")
        if spec.name in static:
            raise HeronError(ErrorCode.POOL_CONFLICT,
                             f"{spec.name!r} is a static pool of this gateway")
        if self.mirror.get(spec.name) is not None:
            raise HeronError(ErrorCode.POOL_CONFLICT, f"pool {spec.name!r} already exists")
        js = self._jetstream()
        lease = PoolLease.new(spec)
        async with self._nats_errors():
            # The stream first: workers and requests may follow the lease at once.
            await ensure_work_stream(js, self.settings.stream_spec(spec.name))
            revision = await PoolStore(js, self.settings.publish_timeout_s).create(lease)
        self.mirror.apply(spec.name, lease, revision)
        log.info("leased pool %s created: bundle %s, %d workers, ttl %gs", spec.name,
                 spec.bundle, spec.workers, spec.ttl_s)
        return respond(request, self.describe_lease(lease), status=201)

    async def list_pools(self, request: Request) -> Response:
        data = [self.describe_lease(lease) for _, lease in sorted(self.leased().items())]
        data += [self.describe_static(name, bundle)
                 for name, bundle in sorted(self.registry.pools().items())]
        return respond(request, {"object": "list", "data": data})

    async def get_pool(self, request: Request) -> Response:
        name = request.path_params["name"]
        static = self.registry.pools().get(name)
        if static is not None:
            return respond(request, self.describe_static(name, static))
        return respond(request, self.describe_lease(self._lease(name)))

    async def delete_pool(self, request: Request) -> Response:
        name = self._leased_name(request)
        async with self._nats_errors():
            revision = await PoolStore(self._jetstream(), self.settings.publish_timeout_s
                                       ).delete(name)
        self.mirror.apply(name, None, revision)
        log.info("leased pool %s deleted", name)
        return respond(request, {"name": name, "deleted": True})

    async def renew_pool(self, request: Request) -> Response:
        name = self._leased_name(request)
        raw = await read_raw(request)
        body = wire.decode_request(raw, wire.request_format(
            request.headers.get("content-type"))) if raw.strip() else None
        renew_ttl(_checked(body, POOL_RENEW_FIELDS), 1.0)  # a bad body: 422 before any write
        async with self._nats_errors():
            lease, revision = await PoolStore(
                self._jetstream(), self.settings.publish_timeout_s
            ).renew(name, lambda current: renew_ttl(body, current.ttl_s))
        self.mirror.apply(name, lease, revision)
        return respond(request, self.describe_lease(lease))

    # ---- helpers -----------------------------------------------------------------------
    def _leased_name(self, request: Request) -> str:
        name = request.path_params["name"]
        if name in self.registry.pools():
            raise HeronError(ErrorCode.POOL_CONFLICT, f"{name!r} is a static pool of this "
                             "gateway (its command line names it); only leases change")
        return name

    @contextlib.asynccontextmanager
    async def _nats_errors(self) -> AsyncIterator[None]:
        """NATS failing under a pools write is a 503 NATS_UNAVAILABLE, like inference."""
        try:
            yield
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("pools write failed on NATS: %s", exc)
            # JetStream's own words where it gave some: a bare ServerError once hid why a
            # lease's stream (1 GiB reserved) did not fit a JetStream limited to 1.88 GB
            # by a nearly full disk.
            said = getattr(exc, "description", None)
            raise self._nats_unavailable(
                f"NATS did not complete the pools write: {type(exc).__name__}"
                + (f" ({said})" if said else "")) from exc


def _checked(body: Any, known: frozenset[str]) -> Any:
    """A pools body with every key known (422 naming the first that is not) and every
    number finite (NaN and the infinities arrive in msgpack); other shapes are the
    parser's to refuse."""
    if isinstance(body, dict):
        check_fields(body, known)
        for key, value in body.items():
            check_finite(value, key)
    return body
