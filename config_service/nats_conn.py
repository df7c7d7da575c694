"""The config service's NATS connection: connect in the background, declare the config
stream and the lease bucket, reconnect forever (and declare again after a reconnect, in
case NATS came back without its store)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from heron.config_service.leader import LeaderLease, leader_bucket
from heron.runtime.nats_names import ensure_config_stream

log = logging.getLogger("heron.config.nats")

RETRY_S = 1.0


class NatsConn:
    def __init__(self, url: str, *, name: str, lease: LeaderLease) -> None:
        self.url = url
        self.name = name
        self.lease = lease
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.set_up = False
        self.last_error: str | None = None

    @property
    def connected(self) -> bool:
        return self.set_up and self.nc is not None and self.nc.is_connected

    async def connect(self) -> KeyValue:
        """Until it works: connect, declare; returns the lease bucket."""
        while self.nc is None:
            try:
                self.nc = await nats.connect(
                    self.url, name=self.name, connect_timeout=2, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                    error_cb=self._on_error, reconnected_cb=self._on_reconnected)
            except Exception as exc:
                self.last_error = f"cannot connect to NATS at {self.url}: {exc!r}"
                log.warning("%s; retrying", self.last_error)
                await asyncio.sleep(RETRY_S)
        self.js = self.nc.jetstream()
        while True:
            try:
                kv = await self._declare()
                self.set_up, self.last_error = True, None
                log.info("connected to NATS at %s", self.url)
                return kv
            except Exception as exc:
                self.last_error = f"NATS set-up failed: {exc!r}"
                log.error("%s; retrying", self.last_error)
                await asyncio.sleep(RETRY_S * 5)

    async def _declare(self) -> KeyValue:
        assert self.nc is not None and self.js is not None
        await ensure_config_stream(self.js)
        # Lease calls time out well inside the lease, so a stuck one cannot outlive it.
        kv_js = self.nc.jetstream(timeout=max(0.5, self.lease.interval_s))
        return await leader_bucket(kv_js, self.lease.ttl_s)

    async def _on_error(self, exc: Exception) -> None:
        log.debug("NATS error: %r", exc)

    async def _on_reconnected(self) -> None:
        if self.set_up:
            try:
                self.lease.kv = await self._declare()
            except Exception as exc:
                log.error("re-declaring after a NATS reconnect failed: %r", exc)

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 2.0)
