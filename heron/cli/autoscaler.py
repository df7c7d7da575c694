"""The local autoscaler of ``heron up``: how many workers each pool gets.

- The static pool (``--bundle``/``--pool``): at least ``min_workers``; a worker is started
  when the gateway publishes demand and none is running (scale from zero); a worker whose
  heartbeats show nothing queued and nothing in flight for ``idle_cooldown_s`` is stopped,
  down to ``min_workers``. At most ``max_workers``.
- Leased pools (``POST /v1/pools``, the ``heron_pools`` bucket): ``lease.workers`` workers
  of ``lease.bundle`` while the lease lives, dead ones restarted. A lease with
  ``workers: 0`` gets one worker on its first demand and loses it after the idle cooldown.
  When the lease is deleted or expires, every worker of the pool is stopped (SIGTERM:
  they drain what they hold).

The processes themselves belong to ``heron.cli.up.LocalCluster``; this module only decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from heron.runtime.nats_names import DEMAND_WILDCARD, STATUS_WILDCARD, ensure_pools_bucket
from heron.runtime.pool_store import LeaseMirror
from heron.runtime.protocol import DemandNotice, PoolLease, ProtocolError, WorkerHeartbeat
from heron_sdk import wire
from heron_sdk.errors import HeronError

log = logging.getLogger("heron.up.autoscaler")


class Workers(Protocol):
    """The worker processes the autoscaler starts and stops (LocalCluster)."""

    def alive(self, pool: str) -> list[str]: ...

    def pools(self) -> set[str]: ...

    def reap(self) -> list[tuple[str, str, int]]:
        """Forget the workers that exited: (worker_id, pool, exit code) of each."""
        ...

    async def start_worker(self, pool: str, bundle: str) -> str: ...

    def stop_worker(self, worker_id: str) -> Awaitable[None]:
        """Out of its pool at once; awaiting the result waits for it to drain and exit."""
        ...


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    pool: str  # the static pool
    bundle: str
    min_workers: int = 1
    max_workers: int = 4
    idle_cooldown_s: float = 60.0
    interval_s: float = 1.0  # how often pools are reconciled
    restart_backoff_s: float = 5.0  # after a worker died, before its pool gets another


class Autoscaler:
    def __init__(self, workers: Workers, policy: ScalePolicy) -> None:
        self.workers = workers
        self.policy = policy
        self.leases = LeaseMirror()
        self._idle_since: dict[str, float] = {}  # worker_id -> since when it was idle
        self._died_at: dict[str, float] = {}  # pool -> when a worker of it last died
        self._lock = asyncio.Lock()  # one scaling decision at a time
        self._stopping: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self, nc: NatsClient) -> None:
        await nc.subscribe(DEMAND_WILDCARD, cb=self._on_demand)
        await nc.subscribe(STATUS_WILDCARD, cb=self._on_beat)
        js = nc.jetstream()
        await ensure_pools_bucket(js)
        await self.leases.start(js)
        self._loop_task = asyncio.get_running_loop().create_task(self._reconcile_forever())

    async def watch_again(self, nc: NatsClient) -> None:
        """After a reconnect: leases may have ended while NATS was away."""
        await self.leases.start(nc.jetstream())

    async def stop(self) -> None:
        """Stop deciding (workers stay up: ``heron up`` stops them itself)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self.leases.stop()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    # ---- signals -----------------------------------------------------------------------
    async def _on_demand(self, msg: Msg) -> None:
        try:
            pool = DemandNotice.from_wire(_decode(msg)).pool
        except ProtocolError as exc:
            log.warning("ignoring a malformed demand notice on %s: %s", msg.subject, exc)
            return
        async with self._lock:
            if self.workers.alive(pool):
                return
            if pool == self.policy.pool:
                if self.policy.max_workers > 0:
                    await self.workers.start_worker(pool, self.policy.bundle)
                return
            lease = self.leases.get(pool)
            if lease is not None and self._may_start(pool):
                await self.workers.start_worker(pool, lease.bundle)

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = WorkerHeartbeat.from_wire(_decode(msg))
        except ProtocolError:  # the gateway logs malformed beats; one line per beat is enough
            return
        if beat.in_flight or beat.queue_depth:
            self._idle_since.pop(beat.worker_id, None)
        else:
            self._idle_since.setdefault(beat.worker_id, time.monotonic())

    # ---- the loop ------------------------------------------------------------------------
    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                async with self._lock:
                    await self.reconcile()
            except Exception:  # keep scaling whatever one round hit
                log.exception("autoscaler round failed")

    async def reconcile(self) -> None:
        now = time.monotonic()
        for worker_id, pool, code in self.workers.reap():
            print(f"heron up: worker {worker_id} exited ({code})", flush=True)
            self._idle_since.pop(worker_id, None)
            self._died_at[pool] = now
        p = self.policy
        self._scale_down_idle(p.pool, floor=p.min_workers)
        leases = self.leases.live()
        for name, lease in leases.items():
            if name != p.pool:
                await self._keep_lease(lease)
        for pool in self.workers.pools() - {p.pool, *leases}:
            for worker_id in self.workers.alive(pool):  # its lease ended
                self._stop(worker_id)

    async def _keep_lease(self, lease: PoolLease) -> None:
        alive = self.workers.alive(lease.name)
        if lease.workers == 0:  # on demand only (see _on_demand)
            self._scale_down_idle(lease.name, floor=0)
            return
        for worker_id in alive[lease.workers:]:
            self._stop(worker_id)
        for _ in range(lease.workers - len(alive)):
            if not self._may_start(lease.name):
                break
            await self.workers.start_worker(lease.name, lease.bundle)

    def _scale_down_idle(self, pool: str, floor: int) -> None:
        alive = self.workers.alive(pool)
        now = time.monotonic()
        for worker_id in alive:
            if len(alive) <= floor:
                return
            idle = self._idle_since.get(worker_id)
            if idle is not None and now - idle > self.policy.idle_cooldown_s:
                alive.remove(worker_id)
                self._stop(worker_id)

    def _may_start(self, pool: str) -> bool:
        died = self._died_at.get(pool)
        return died is None or time.monotonic() - died > self.policy.restart_backoff_s

    def _stop(self, worker_id: str) -> None:
        """Stop a worker in the background: draining takes a while, scaling goes on."""
        self._idle_since.pop(worker_id, None)
        stopped = self.workers.stop_worker(worker_id)

        async def wait() -> None:
            await stopped

        task = asyncio.get_running_loop().create_task(wait())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)


def _decode(msg: Msg) -> Any:
    """The message's msgpack content; None when it is not msgpack (from_wire refuses it)."""
    try:
        return wire.decode(msg.data, wire.MSGPACK)
    except HeronError:
        return None
