"""The gateway's NATS connection: connect in the background, set up, reconnect forever.

The gateway starts (and answers /healthz) with or without NATS; /readyz turns 200 once the
connection is up and ``setup`` (stream declarations, subscriptions) has run. While NATS is
away, ``connected`` is False and requests fail fast with 503 instead of waiting on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

log = logging.getLogger("heron.gateway.nats")

SetupHook = Callable[[NatsClient, JetStreamContext], Awaitable[None]]
RETRY_S = 1.0  # between failed connects/setups; NATS's own reconnects use RECONNECT_WAIT_S
RECONNECT_WAIT_S = 0.5


class NatsLink:
    def __init__(self, url: str, *, name: str, setup: SetupHook, on_reconnect: SetupHook,
                 connect_timeout_s: float = 2.0) -> None:
        self.url = url
        self.name = name
        self._setup = setup
        self._on_reconnect = on_reconnect
        self.connect_timeout_s = connect_timeout_s
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.set_up = False
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def ready(self) -> bool:
        return self.set_up and self.connected

    @property
    def max_payload(self) -> int:
        assert self.nc is not None
        return self.nc.max_payload

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect_and_set_up())

    async def _connect_and_set_up(self) -> None:
        while self.nc is None:
            try:
                self.nc = await nats.connect(
                    self.url, name=self.name, connect_timeout=self.connect_timeout_s,
                    allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=RECONNECT_WAIT_S, error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected)
            except Exception as exc:  # any failure means: retry shortly
                self.last_error = f"cannot connect to NATS at {self.url}: {exc!r}"
                log.warning("%s; retrying in %.0fs", self.last_error, RETRY_S)
                await asyncio.sleep(RETRY_S)
        self.js = self.nc.jetstream()
        while not self.set_up:
            try:
                await self._setup(self.nc, self.js)
                self.set_up, self.last_error = True, None
                log.info("connected to NATS at %s", self.url)
            except Exception as exc:  # e.g. StreamMismatch: report and retry
                self.last_error = f"NATS setup failed: {exc}"
                log.error("%s; retrying in %.0fs", self.last_error, RETRY_S * 5)
                await asyncio.sleep(RETRY_S * 5)

    async def _on_error(self, exc: Exception) -> None:
        log.debug("NATS error: %r", exc)

    async def _on_disconnected(self) -> None:
        if self.set_up and not self._closing:
            log.warning("disconnected from NATS; requests answer 503 until it is back")

    async def _on_reconnected(self) -> None:
        log.info("reconnected to NATS")
        # A NATS that came back without its store has lost the streams: declare them again
        # (idempotent). Subscriptions are restored by the client itself.
        if self.set_up and self.nc is not None and self.js is not None:
            task = asyncio.get_running_loop().create_task(self._redeclare())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _redeclare(self) -> None:
        assert self.nc is not None and self.js is not None
        try:
            await self._on_reconnect(self.nc, self.js)
        except Exception as exc:  # logged; the next reconnect tries again
            log.error("re-declaring streams after reconnect failed: %s", exc)

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._background):
            task.cancel()
        if self.nc is not None and not self.nc.is_closed:
            # drain() flushes what is in flight, but waits on a server that is gone: bound it.
            with contextlib.suppress(Exception):
                if self.nc.is_connected:
                    await asyncio.wait_for(self.nc.drain(), 2.0)
            with contextlib.suppress(Exception):
                await self.nc.close()
