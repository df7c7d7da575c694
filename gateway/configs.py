"""The gateway's side of the config control plane.

``ConfigServiceSource`` feeds the registry from the config service's snapshot instead of
bundle files; ``GatewayConfigSync`` follows the service (heron.runtime.configsync) and re-loads the
registry on every change, so a POSTed model routes within about a second without a
restart. ``model_status`` is the body of GET /v1/configs/models/{id}/status, from heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from nats.aio.client import Client as NatsClient

from heron.gateway.health import WorkerHealth
from heron.gateway.registry import PoolBundle, RouteTable
from heron.runtime.configsync import ConfigFollower, Snapshot
from heron.runtime.modelconfig import Bundle, ConfigError, parse_model_config

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
    """Applies the config service's snapshots to ``registry`` (fed by ``source``), tells
    ``health`` which bundle hash each pool should beat, and has new pools' streams declared
    (``declare_streams``: a no-op while NATS is away)."""

    def __init__(self, config_url: str, source: ConfigServiceSource, registry: RouteTable,
                 health: WorkerHealth, *,
                 declare_streams: Callable[[], Awaitable[None]]) -> None:
        self.source = source
        self.registry = registry
        self.health = health
        self._declare_streams = declare_streams
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
        registry = self.registry
        try:
            registry.load()
        except ConfigError as exc:  # keep routing with what we had
            log.error("config epoch %s not applied: %s", snapshot.get("epoch"), exc)
            self.source.snapshot = previous
            return
        for pool, bundle in registry.pools().items():
            self.health.expect(pool, bundle, registry.bundle_hash(pool))
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
            try:
                await self._declare_streams()
            except Exception as exc:
                # the latest epoch: a rerun covers every epoch applied while one ran
                log.warning("declaring streams after config epoch %s failed: %s",
                            self.epoch, exc)
            if not self._declare_again:
                return

    @property
    def epoch(self) -> int:
        return self.follower.epoch


def model_status(registry: RouteTable, health: WorkerHealth, name: str,
                 epoch: int | None) -> dict[str, Any]:
    """Which workers of the model's pool have it, in which state, and whether their bundle
    hash matches the gateway's (they applied the same config)."""
    route = registry.resolve(name)
    expected_hash = registry.bundle_hash(route.pool)
    workers: list[dict[str, Any]] = []
    for beat in health.workers(route.pool):
        workers.append({"worker_id": beat.worker_id, "state": beat.models.get(route.model_id,
                                                                           "absent"),
                        "applied": route.model_id in beat.models,
                        "bundle_hash_matches": beat.bundle_hash == expected_hash,
                        "healthy": health.is_healthy(beat)})
    body = {"id": route.model_id, "bundle": route.bundle, "pool": route.pool,
            "bundle_hash": expected_hash, "epoch": epoch, "workers": workers,
            "applied_by": sum(1 for w in workers if w["applied"])}
    if not workers:
        body["note"] = "no worker of this pool is beating"
    return body
