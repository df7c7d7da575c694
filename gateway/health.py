"""Worker health from heartbeats on ``heron.status.<pool>.<worker_id>``.

Every worker publishes one beat a second. A worker counts as capacity while its last beat
said ready and arrived less than ``timeout_s`` ago (measured on the gateway's own monotonic
clock, so clock skew between hosts changes nothing). Nothing here talks to NATS: the
gateway feeds ``observe`` from its subscription.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("heron.gateway.health")

# A worker silent this long is forgotten entirely (it only costs memory and /v1/models noise).
FORGET_AFTER_S = 300.0


@dataclass(slots=True)
class WorkerBeat:
    """The latest heartbeat of one worker."""

    worker_id: str
    pool: str
    bundle: str
    bundle_hash: str
    ready: bool
    models: dict[str, str]
    queue_depth: int
    in_flight: int
    address: str
    received: float  # gateway monotonic time
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


class WorkerHealth:
    def __init__(self, timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._workers: dict[str, WorkerBeat] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._expected: dict[str, tuple[str, str]] = {}  # pool -> (bundle, bundle hash)
        self._warned: set[str] = set()

    def expect(self, pool: str, bundle: str, bundle_hash: str) -> None:
        """What the registry says the pool serves; a worker saying otherwise is logged."""
        self._expected[pool] = (bundle, bundle_hash)

    def forget(self, pool: str) -> None:
        """The pool is gone (a lease ended): expect nothing of it. Its workers' beats,
        while they drain, are still recorded like any other."""
        self._expected.pop(pool, None)

    def observe(self, beat: Mapping[str, Any]) -> None:
        """Record one decoded heartbeat (malformed ones are dropped with a log line)."""
        try:
            worker = WorkerBeat(
                worker_id=str(beat["worker_id"]), pool=str(beat["pool"]),
                bundle=str(beat.get("bundle", "")), bundle_hash=str(beat.get("bundle_hash", "")),
                ready=bool(beat.get("ready")), models=dict(beat.get("models") or {}),
                queue_depth=int(beat.get("queue_depth") or 0),
                in_flight=int(beat.get("in_flight") or 0),
                address=str(beat.get("address") or ""), received=self.clock(), raw=dict(beat))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("dropping a malformed heartbeat (%s): %r", exc, beat)
            return
        self._check_bundle(worker)
        self._workers[worker.worker_id] = worker
        if self.is_healthy(worker):
            for waiter in self._waiters.pop(worker.pool, []):
                if not waiter.done():
                    waiter.set_result(None)

    def _check_bundle(self, worker: WorkerBeat) -> None:
        expected = self._expected.get(worker.pool)
        if expected is None or worker.worker_id in self._warned:
            return
        bundle, bundle_hash = expected
        if worker.bundle_hash and worker.bundle_hash != bundle_hash:
            self._warned.add(worker.worker_id)
            log.warning("worker %s in pool %s serves bundle %s (hash %s); this gateway routes "
                        "bundle %s (hash %s) there: their model configs differ",
                        worker.worker_id, worker.pool, worker.bundle, worker.bundle_hash[:12],
                        bundle, bundle_hash[:12])

    def is_healthy(self, worker: WorkerBeat) -> bool:
        return worker.ready and self.clock() - worker.received < self.timeout_s

    def workers(self, pool: str | None = None) -> list[WorkerBeat]:
        """Every worker heard from recently enough to remember (healthy or not)."""
        now = self.clock()
        for worker_id in [w for w, b in self._workers.items()
                          if now - b.received > FORGET_AFTER_S]:
            del self._workers[worker_id]
        return [w for w in self._workers.values() if pool is None or w.pool == pool]

    def healthy(self, pool: str) -> list[WorkerBeat]:
        return [w for w in self.workers(pool) if self.is_healthy(w)]

    def has_capacity(self, pool: str) -> bool:
        return any(self.is_healthy(w) for w in self._workers.values() if w.pool == pool)

    async def wait_for_capacity(self, pool: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a healthy beat from ``pool``; True if one came."""
        if self.has_capacity(pool):
            return True
        if timeout_s <= 0:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(pool, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            waiters = self._waiters.get(pool, [])
            if waiter in waiters:
                waiters.remove(waiter)

    def model_state(self, pool: str, model_id: str) -> str:
        """A model's state across the pool's healthy workers: the best any reports."""
        healthy = self.healthy(pool)
        if not healthy:
            return "no_workers"
        states = {w.models.get(model_id, "not_loaded") for w in healthy}
        for state in ("ready", "loading", "not_loaded", "failed"):
            if state in states:
                return state
        return sorted(states)[0]
