"""The local autoscaler of ``heron up``: how many workers each pool gets.

- The static pool (``--bundle``/``--pool``): at least ``min_workers`` (one that dies is
  replaced); a worker is started when the gateway publishes demand and none is running
  (scale from zero); a worker whose heartbeats show nothing queued and nothing in flight
  for ``idle_cooldown_s`` is stopped, down to ``min_workers``. At most ``max_workers``.
- Leased pools (``POST /v1/pools``, the ``heron_pools`` bucket): ``lease.workers`` workers
  of ``lease.bundle`` while the lease lives, dead ones restarted. A lease with
  ``workers: 0`` gets one worker on its first demand and loses it after the idle cooldown.
  When the lease is deleted or expires, every worker of the pool is stopped (SIGTERM:
  they drain what they hold).

A worker that dies on its own (one the autoscaler did not stop) is reported like any child
of ``heron up`` (a ``SupervisorEvent``), and its pool gets a replacement after the
exponential backoff of heron/cli/supervisor.py, counted per pool: a worker that crashes at
start-up costs a start every 30 s at most, not a busy loop.

The processes themselves belong to ``heron.cli.local_cluster.LocalCluster``; this module
only decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from heron.cli.supervisor import (
    EXITED,
    RESTARTED,
    BackoffPolicy,
    Clock,
    RestartBackoff,
    SupervisorEvent,
)
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
    # After a worker died, before its pool gets another: doubling on each death that follows
    # within restart_reset_after_s of the pool's last start, at most restart_backoff_max_s.
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    restart_reset_after_s: float = 60.0

    def backoff(self) -> BackoffPolicy:
        return BackoffPolicy(initial_s=self.restart_backoff_s, max_s=self.restart_backoff_max_s,
                             reset_after_s=self.restart_reset_after_s)


def print_event(event: SupervisorEvent) -> None:
    print(event.console_line(), flush=True)


def print_line(line: str) -> None:
    print(line, flush=True)


class Autoscaler:
    """``report`` hears of every worker death and replacement (default: printed);
    ``announce`` gets a line when a worker it started first says it is ready (default:
    printed), so whoever runs ``heron up`` knows when requests will be served."""

    def __init__(self, workers: Workers, policy: ScalePolicy,
                 report: Callable[[SupervisorEvent], None] = print_event,
                 clock: Clock = time.monotonic,
                 announce: Callable[[str], None] = print_line) -> None:
        self.workers = workers
        self.policy = policy
        self.report = report
        self.announce = announce
        self.clock = clock
        self._starting: dict[str, float] = {}  # worker_id -> when it was started, until ready
        self.leases = LeaseMirror()
        self._idle_since: dict[str, float] = {}  # worker_id -> since when it was idle
        self._backoff: dict[str, RestartBackoff] = {}  # pool -> its restart schedule
        self._replacing: dict[str, int] = {}  # pool -> deaths not replaced yet
        self._lock = asyncio.Lock()  # one scaling decision at a time
        self._stopping: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self, nc: NatsClient, initial_workers: int = 0,
                    replicas: int | None = None) -> None:
        """Listen, start ``initial_workers`` of the static pool, then reconcile every
        ``interval_s``. ``replicas``: of the pools bucket, if it must be created."""
        await nc.subscribe(DEMAND_WILDCARD, cb=self._on_demand)
        await nc.subscribe(STATUS_WILDCARD, cb=self._on_beat)
        js = nc.jetstream()
        await ensure_pools_bucket(js, replicas)
        await self.leases.start(js)
        async with self._lock:
            for _ in range(initial_workers):
                await self._start(self.policy.pool, self.policy.bundle)
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
                if self.policy.max_workers > 0 and self._may_start(pool):
                    await self._start(pool, self.policy.bundle)
                return
            lease = self.leases.get(pool)
            if lease is not None and self._may_start(pool):
                await self._start(pool, lease.bundle)

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = WorkerHeartbeat.from_wire(_decode(msg))
        except ProtocolError:  # the gateway logs malformed beats; one line per beat is enough
            return
        if beat.ready and (started := self._starting.pop(beat.worker_id, None)) is not None:
            self.announce(f"heron up: worker {beat.worker_id} ready, pool {beat.pool} "
                          f"({self.clock() - started:.1f} s after its start)")
        if not beat.ready or beat.in_flight or beat.queue_depth:
            # A worker still starting has no work because it cannot take any yet: counted
            # idle, a worker whose start outlasted the cooldown was stopped before it could
            # serve the request that woke its pool, and the next 202 started another
            # (heron up --idle-cooldown 3 on 2 busy cores: 100-140 s to a first answer).
            self._idle_since.pop(beat.worker_id, None)
        else:
            self._idle_since.setdefault(beat.worker_id, self.clock())

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
        for worker_id, pool, code in self.workers.reap():
            self._idle_since.pop(worker_id, None)
            self._starting.pop(worker_id, None)
            self._died(worker_id, pool, code)
        p = self.policy
        self._scale_down_idle(p.pool, floor=p.min_workers)
        for _ in range(self._wanted(p.pool) - len(self.workers.alive(p.pool))):
            if not self._may_start(p.pool):
                break
            await self._start(p.pool, p.bundle)
        leases = self.leases.live()
        for pool in [q for q in self._replacing if self._wanted(q) == 0]:
            del self._replacing[pool]  # its lease ended: nothing left to replace
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
            await self._start(lease.name, lease.bundle)

    def _wanted(self, pool: str) -> int:
        """The workers a pool keeps whatever its demand (a dead one is replaced)."""
        if pool == self.policy.pool:
            return min(self.policy.min_workers, self.policy.max_workers)
        lease = self.leases.live().get(pool)
        return lease.workers if lease is not None else 0

    def _died(self, worker_id: str, pool: str, code: int) -> None:
        backoff = self._backoff.setdefault(pool, RestartBackoff(self.policy.backoff(),
                                                                self.clock))
        delay = backoff.exited()
        replaced = len(self.workers.alive(pool)) + self._replacing.get(pool, 0) \
            < self._wanted(pool)
        if replaced:
            self._replacing[pool] = self._replacing.get(pool, 0) + 1
        self.report(SupervisorEvent(f"worker {worker_id}", EXITED, code, backoff.restarts,
                                    time.time(), restart_in_s=delay if replaced else None))

    async def _start(self, pool: str, bundle: str) -> str:
        worker_id = await self.workers.start_worker(pool, bundle)
        self._starting[worker_id] = self.clock()
        backoff = self._backoff.get(pool)
        if backoff is not None:
            backoff.started()
            if self._replacing.get(pool, 0) > 0:
                self._replacing[pool] -= 1
                self.report(SupervisorEvent(f"worker {worker_id}", RESTARTED, None,
                                            backoff.restarts, time.time(),
                                            f"replaces a worker of pool {pool} that died"))
        return worker_id

    def _scale_down_idle(self, pool: str, floor: int) -> None:
        alive = self.workers.alive(pool)
        now = self.clock()
        for worker_id in alive:
            if len(alive) <= floor:
                return
            idle = self._idle_since.get(worker_id)
            if idle is not None and now - idle > self.policy.idle_cooldown_s:
                alive.remove(worker_id)
                self._stop(worker_id)

    def _may_start(self, pool: str) -> bool:
        backoff = self._backoff.get(pool)
        return backoff is None or backoff.may_start()

    def _stop(self, worker_id: str) -> None:
        """Stop a worker in the background: draining takes a while, scaling goes on."""
        self._idle_since.pop(worker_id, None)
        self._starting.pop(worker_id, None)
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
