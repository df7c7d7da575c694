"""The gateway's side of the config control plane.

``ConfigServiceSource`` feeds the registry from the config service's snapshot instead of
bundle files; ``GatewayConfigSync`` follows the service (heron.runtime.configsync) and re-loads the
registry on every change, so a POSTed model routes within about a second without a
restart. ``model_status`` answers GET /v1/configs/models/{id}/status from heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient
from starlette.requests import Request
from starlette.responses import Response

from heron.gateway.registry import PoolBundle
from heron.runtime.configsync import ConfigFollower, Snapshot
from heron.runtime.http import respond
from heron.runtime.modelconfig import Bundle, ConfigError, parse_model_config

if TYPE_CHECKING:
    from heron.gateway.routes import GatewayApp

log = logging.getLogger("heron.gateway.configs")


class ConfigServiceSource:
    """Bundles as the config service's latest snapshot has them; ``pools`` maps bundle
    name -> pool. Not ready until the first snapshot arrives."""

    def __init__(self, pools: Mapping[str, str]) -> None:
        self.pools = dict(pools)
        self.snapshot: Snapshot | None = None

    @property
    def ready(self) -> bool:
        return self.snapshot is not None

    def load(self) -> list[PoolBundle]:
        if self.snapshot is None:
            return []
        out = []
        for name, pool in self.pools.items():
            entry = self.snapshot["bundles"].get(name)
            if entry is None:
                log.warning("the config service has no bundle %r (pool %s)", name, pool)
                continue
            models = tuple(parse_model_config(self.snapshot["models"][model_id],
                                              f"config service: {model_id}")
                           for model_id in entry["models"])
            out.append(PoolBundle(Bundle(name=name, models=models,
                                         adapters=tuple(entry.get("adapters") or ()) or
                                         Bundle.__dataclass_fields__["adapters"].default,
                                         source=f"config service, bundle {name}"), pool))
        return out


class GatewayConfigSync:
    def __init__(self, gateway: GatewayApp, config_url: str,
                 source: ConfigServiceSource) -> None:
        self.gateway = gateway
        self.source = source
        self.follower = ConfigFollower(config_url, on_change=self._on_change)
        self._started = False
        self._declaring: asyncio.Task | None = None
        self._declare_again = False

    async def start(self, nc: NatsClient) -> None:
        if not self._started:
            self._started = True
            await self.follower.start(nc)

    async def stop(self) -> None:
        await self.follower.stop()
        if self._declaring is not None:
            self._declaring.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._declaring

    async def _on_change(self, snapshot: Snapshot) -> None:
        previous = self.source.snapshot
        self.source.snapshot = snapshot
        registry = self.gateway.registry
        try:
            registry.load()
        except ConfigError as exc:  # keep routing with what we had
            log.error("config epoch %s not applied: %s", snapshot.get("epoch"), exc)
            self.source.snapshot = previous
            return
        for pool, bundle in registry.pools().items():
            self.gateway.health.expect(pool, bundle, registry.bundle_hash(pool))
        self._declare_streams_soon()
        log.info("config epoch %s applied: %d models", snapshot.get("epoch"),
                 len(registry.models()))

    def _declare_streams_soon(self) -> None:
        """New pools' streams, in a task of their own: while NATS is away (and before the
        client has noticed), JetStream calls wait out their timeouts, and the config
        follower must keep applying epochs meanwhile. Best effort: a reconnect declares
        them again."""
        if self._declaring is not None and not self._declaring.done():
            self._declare_again = True
            return
        self._declaring = asyncio.get_running_loop().create_task(self._declare())

    async def _declare(self) -> None:
        while True:
            self._declare_again = False
            link = self.gateway.link
            if link.ready and link.nc is not None:
                try:
                    await self.gateway.declare_streams(link.nc, link.js)
                except Exception as exc:
                    # the latest epoch: a rerun covers every epoch applied while one ran
                    log.warning("declaring streams after config epoch %s failed: %s",
                                self.epoch, exc)
            if not self._declare_again:
                return

    @property
    def epoch(self) -> int:
        return self.follower.epoch


async def model_status(gateway: GatewayApp, request: Request) -> Response:
    """Which workers of the model's pool have it, in which state, and whether their bundle
    hash matches the gateway's (they applied the same config)."""
    route = gateway.registry.resolve(request.path_params["model"])
    expected_hash = gateway.registry.bundle_hash(route.pool)
    workers: list[dict[str, Any]] = []
    for beat in gateway.health.workers(route.pool):
        workers.append({"worker_id": beat.worker_id, "state": beat.models.get(route.model_id,
                                                                           "absent"),
                        "applied": route.model_id in beat.models,
                        "bundle_hash_matches": beat.bundle_hash == expected_hash,
                        "healthy": gateway.health.is_healthy(beat)})
    sync = gateway.config_sync
    body = {"id": route.model_id, "bundle": route.bundle, "pool": route.pool,
            "bundle_hash": expected_hash, "epoch": sync.epoch if sync else None,
            "workers": workers,
            "applied_by": sum(1 for w in workers if w["applied"])}
    if not workers:
        body["note"] = "no worker of this pool is beating"
    return respond(request, body)
