"""WorkerCluster: a worker's life on NATS: connect, beat, consume, drain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import nats
import torch
from nats.aio.client import Client as NATS

from heron.runtime.configsync import ConfigFollower, Snapshot
from heron.runtime.modelconfig import parse_model_config
from heron.runtime.nats_names import WorkStreamSpec
from heron.worker.consumer import WorkConsumer, fetch_lookahead_from_env
from heron.worker.metrics import WorkerMetrics
from heron.worker.registry import ModelRegistry
from heron.worker.service import InferenceService
from heron.worker.status import StatusPublisher

if TYPE_CHECKING:
    from heron.worker.app import QueueMode

log = logging.getLogger("heron.worker.cluster")


async def connect_nats(url: str, name: str) -> NATS:
    """Connect, and keep reconnecting forever: a NATS restart must not kill a worker."""
    return await nats.connect(url, name=name, max_reconnect_attempts=-1,
                              reconnect_time_wait=0.5, connect_timeout=2,
                              allow_reconnect=True)


class WorkerCluster:
    def __init__(self, queue: QueueMode, registry: ModelRegistry,
                 service: InferenceService, metrics: WorkerMetrics | None = None) -> None:
        self.queue = queue
        self.metrics = metrics
        self.registry = registry
        self.service = service
        self.nc: NATS | None = None
        self.consumer: WorkConsumer | None = None
        self.status: StatusPublisher | None = None
        self._start_task: asyncio.Task | None = None
        self.follower: ConfigFollower | None = None
        self.config_epoch = -1
        self.lookahead_items = fetch_lookahead_from_env(
            on_gpu=registry.device_override != "cpu" and torch.cuda.is_available())

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def start(self, models_loaded: asyncio.Task) -> None:
        self._start_task = asyncio.get_running_loop().create_task(self._start(models_loaded))

    async def _start(self, models_loaded: asyncio.Task) -> None:
        while self.nc is None:
            try:
                self.nc = await connect_nats(self.queue.nats_url, self.queue.worker_id)
            except Exception as exc:  # NATS not up yet: keep trying, stay not-ready
                log.warning("cannot reach NATS at %s: %s", self.queue.nats_url, exc)
                await asyncio.sleep(1.0)
        self.status = StatusPublisher(self.nc, pool=self.queue.pool,
                                      worker_id=self.queue.worker_id, snapshot=self.snapshot)
        await self.status.start()
        if self.queue.config_url:
            self.follower = ConfigFollower(self.queue.config_url,
                                           bundle=self.registry.bundle.name,
                                           on_change=self._on_config)
            await self.follower.start(self.nc)
        # Consume only once the preloaded models are warm: every nak spends a delivery.
        await asyncio.shield(models_loaded)
        self.consumer = WorkConsumer(self.nc, self.service, WorkStreamSpec(pool=self.queue.pool),
                                     lookahead_items=self.lookahead_items,
                                     metrics=self.metrics)
        await self.consumer.start()
        self.registry.arrivals_open = self.consumer.can_fetch
        log.info("worker %s consuming pool %s", self.queue.worker_id, self.queue.pool)

    def _on_config(self, snapshot: Snapshot) -> None:
        """A new epoch from the config service: serve what our bundle now lists."""
        name = self.registry.bundle.name
        entry = snapshot["bundles"].get(name)
        if entry is None:
            log.warning("the config service has no bundle %r", name)
            return
        models = tuple(parse_model_config(snapshot["models"][m], f"config service: {m}")
                       for m in entry["models"])
        added = self.registry.apply_bundle(dataclasses.replace(self.registry.bundle,
                                                               models=models))
        self.config_epoch = int(snapshot["epoch"])
        if added:
            log.info("config epoch %d: loading %s", self.config_epoch, ", ".join(added))

    def snapshot(self) -> dict[str, Any]:
        entries = self.registry.entries()
        return {
            "bundle": self.registry.bundle.name,
            "bundle_hash": self.registry.bundle.config_hash,
            "models": {e.config.id: e.state.value for e in entries},
            "queue_depth": sum(len(e.runner.batcher) for e in entries if e.runner),
            "in_flight": self.consumer.in_flight if self.consumer else 0,
            "ready": self.registry.ready and self.consumer is not None and self.connected,
            "address": self.queue.address,
            "items_done": sum(e.items_done for e in entries),
            "model_items": {e.config.id: e.items_done for e in entries if e.items_done},
            "model_memory": {e.config.id: e.resident_bytes for e in entries if e.runner},
        }

    async def stop(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._start_task
        if self.follower is not None:
            await self.follower.stop()
        if self.status is not None:
            await self.status.stop()
        if self.consumer is not None:
            self.registry.arrivals_open = None
            await self.consumer.drain()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            await self.nc.close()
