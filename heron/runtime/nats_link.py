"""NatsLink: the one NATS connection of the gateway, the worker and the config service.

- ``start()`` connects in the background, so a process answers /healthz with or without
  NATS. ``servers`` is one URL, a comma-separated list or a sequence of URLs (the nodes of a
  NATS cluster): the client tries them in turn, forever, and stays on whichever answers.
- Once connected, the ``setup`` hook runs (declare streams, subscribe, watch buckets); a
  failing setup (JetStream not ready yet, a stream declared with other settings) is retried
  with a backoff until it succeeds, and ``last_error`` says why meanwhile.
- The client reconnects by itself, forever (to any node of the list). After a reconnect
  the ``on_reconnect`` hook runs in the background, retried the same way: a NATS that came
  back without its store has lost the streams and buckets, and they are declared again
  (idempotent when they survived). Subscriptions are restored by the client itself.
- ``connected``: the socket is up now. ``ready``: connected and the setup has succeeded
  once; it drops while NATS is away, so callers fail fast instead of waiting on it. It stays
  True while ``on_reconnect`` runs: a JetStream leader election after a failover is
  latency (publishes retry within their deadline), not a reason to refuse work.
- ``close()`` stops connecting and any setup under way, drains (bounded), closes.

Lines are logged under the component's logger: ``logger_name``, by default the setup hook's
package plus ``.nats`` (``heron.gateway.nats`` for the gateway's hook in heron.gateway.routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import APIError

SetupHook = Callable[[NatsClient, JetStreamContext], Awaitable[None]]

RECONNECT_WAIT_S = 0.5  # between tries of one server, while connecting and reconnecting
CONNECT_RETRY_S = 1.0  # after a connect that raised (the client gave up on its options)
SETUP_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # between failed setups; then every 5 s
# A server that vanished without closing the socket (a node lost, a partition) is noticed
# after ping_interval x max_outstanding_pings: about 30 s here, 4 min with the defaults.
PING_INTERVAL_S = 10
MAX_OUTSTANDING_PINGS = 3
ERROR_LOG_EVERY_S = 10.0  # one line per this while a server refuses: tries come each 0.5 s
CLOSE_TIMEOUT_S = 2.0  # drain() waits on a server that may be gone: bounded


def parse_servers(servers: str | Sequence[str]) -> list[str]:
    """``nats://a:4222,nats://b:4222`` (the form of ``--nats`` and HERON_NATS_URL) or a
    sequence of URLs -> the list of URLs; blanks dropped."""
    parts = servers.split(",") if isinstance(servers, str) else list(servers)
    urls = [p.strip() for p in parts if p.strip()]
    if not urls:
        raise ValueError(f"no NATS server URL in {servers!r}")
    return urls


def _default_logger_name(setup: SetupHook) -> str:
    package = getattr(setup, "__module__", "").rpartition(".")[0]
    return f"{package or 'heron'}.nats"



def describe_nats_error(exc: BaseException) -> str:
    """An error as an operator can act on it: JetStream's refusals carry their code and
    description only in ``str`` (their repr is a bare ``ServerError()``)."""
    return str(exc) if isinstance(exc, APIError) else repr(exc)


class NatsLink:
    """``NatsLink(servers, name=..., setup=..., on_reconnect=...)``, then ``start()`` in the
    running loop and ``close()`` at the end. Hooks get the client and its JetStream context
    and must be idempotent: both may run more than once."""

    def __init__(self, servers: str | Sequence[str], *, name: str, setup: SetupHook,
                 on_reconnect: SetupHook | None = None, connect_timeout_s: float = 2.0,
                 logger_name: str | None = None) -> None:
        self.servers = parse_servers(servers)
        self.name = name
        self._setup = setup
        self._on_reconnect = on_reconnect
        self.connect_timeout_s = connect_timeout_s
        self.log = logging.getLogger(logger_name or _default_logger_name(setup))
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.set_up = False
        self.last_error: str | None = None
        self.disconnected_at: float | None = None  # monotonic, the last time it was lost
        self._set_up_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._resetup: asyncio.Task[None] | None = None
        self._closing = False
        self._error_logged_at = float("-inf")

    # ---- state seen from outside --------------------------------------------------------
    @property
    def url(self) -> str:
        """The servers as one string, for messages."""
        return ",".join(self.servers)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def ready(self) -> bool:
        return self.set_up and self.connected

    @property
    def connected_url(self) -> str | None:
        """The server this connection is on now (one node of a cluster), if any."""
        if self.nc is None or not self.nc.is_connected or self.nc.connected_url is None:
            return None
        url = self.nc.connected_url
        return f"{url.scheme}://{url.hostname}:{url.port}"

    @property
    def max_payload(self) -> int:
        assert self.nc is not None
        return self.nc.max_payload

    async def wait_set_up(self) -> None:
        """Until connected and the setup hook has succeeded once."""
        await self._set_up_event.wait()

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect_and_set_up())

    async def stop_tasks(self) -> None:
        """Stop connecting and any setup under way; an open connection stays open (a worker
        drains its consumer over it before ``close()``)."""
        self._closing = True
        for task in (self._task, self._resetup):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def close(self) -> None:
        await self.stop_tasks()
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        with contextlib.suppress(Exception):
            if nc.is_connected:
                await asyncio.wait_for(nc.drain(), CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)

    # ---- connecting ------------------------------------------------------------------------
    async def _connect_and_set_up(self) -> None:
        while self.nc is None:
            client = NatsClient()
            try:
                # With max_reconnect_attempts=-1 the client itself tries every server until
                # one answers (each failure comes to _on_error); it raises only on options
                # it cannot use.
                await client.connect(
                    self.servers, name=self.name, connect_timeout=self.connect_timeout_s,
                    allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=RECONNECT_WAIT_S, ping_interval=PING_INTERVAL_S,
                    max_outstanding_pings=MAX_OUTSTANDING_PINGS, error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected, closed_cb=self._on_closed)
            except asyncio.CancelledError:
                await self._discard(client)  # closed while connecting
                raise
            except Exception as exc:
                await self._discard(client)
                self.last_error = f"cannot connect to NATS at {self.url}: {exc!r}"
                self.log.warning("%s; retrying in %.0fs", self.last_error, CONNECT_RETRY_S)
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            self.nc, self.js = client, client.jetstream()
        self.last_error = None
        self.log.info("%s connected to NATS at %s", self.name, self.connected_url)
        await self._run_hook(self._setup, "NATS setup")
        self.set_up = True
        self._set_up_event.set()
        self.log.info("%s: NATS setup done", self.name)

    async def _discard(self, client: NatsClient) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)

    async def _run_hook(self, hook: SetupHook, what: str) -> None:
        """Until it succeeds (idempotent hooks): a failure is logged, kept in
        ``last_error``, and tried again after a backoff."""
        assert self.nc is not None and self.js is not None
        failures = 0
        while True:
            try:
                await hook(self.nc, self.js)
            except Exception as exc:  # e.g. JetStream not ready yet, StreamMismatch
                wait_s = SETUP_BACKOFF_S[min(failures, len(SETUP_BACKOFF_S) - 1)]
                failures += 1
                self.last_error = f"{what} failed: {describe_nats_error(exc)}"
                self.log.error("%s; retrying in %.1fs", self.last_error, wait_s)
                await asyncio.sleep(wait_s)
                continue
            if failures:
                self.log.info("%s succeeded after %d failed tries", what, failures)
            self.last_error = None
            return

    # ---- the client's callbacks --------------------------------------------------------------
    async def _on_error(self, exc: Exception) -> None:
        if not self.connected:
            self.last_error = f"cannot reach NATS at {self.url}: {exc!r}"
        now = time.monotonic()
        if self._closing or now - self._error_logged_at < ERROR_LOG_EVERY_S:
            return
        self._error_logged_at = now
        if self.connected:
            self.log.warning("NATS error: %r", exc)
        else:
            self.log.warning("%s; trying every %.1fs", self.last_error, RECONNECT_WAIT_S)

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        self.disconnected_at = time.monotonic()
        self.last_error = f"disconnected from NATS; reconnecting to {self.url}"
        self.log.warning("%s", self.last_error)

    async def _on_closed(self) -> None:
        if self._closing or self.nc is None:
            return  # our own close(), or a client that never connected (discarded)
        # The client gives up only on a server error it treats as final (an authorization
        # violation, too many connections): nothing reconnects; /readyz says why.
        err = self.nc.last_error
        self.last_error = f"the NATS connection was closed for good: {err!r}; restart needed"
        self.log.error("%s", self.last_error)

    async def _on_reconnected(self) -> None:
        if self._closing:
            return
        self.last_error = None
        self._error_logged_at = float("-inf")
        self.log.info("%s reconnected to NATS at %s", self.name, self.connected_url)
        if not self.set_up or self._on_reconnect is None:
            return  # the first setup is still running: it does the whole job
        if self._resetup is not None and not self._resetup.done():
            self._resetup.cancel()  # a reconnect during the last re-setup: start it afresh
        self._resetup = asyncio.get_running_loop().create_task(
            self._run_hook(self._on_reconnect, "NATS re-setup after a reconnect"))
