"""Worker health from heartbeats on ``heron.status.<pool>.<worker_id>``.

Every worker publishes one beat a second. A worker counts as capacity while its last beat
said ready and arrived less than ``timeout_s`` ago (measured on the gateway's own monotonic
clock, so clock skew between hosts changes nothing). Nothing here talks to NATS: the
gateway feeds ``observe`` from its subscription (heron.runtime.protocol.WorkerHeartbeat).

Recent throughput comes from the beats too: each carries counters of the items the worker
has computed, and ``throughput`` divides their growth over the last ``THROUGHPUT_WINDOW_S``
by the time between those beats. Counted where the work is done, so it includes every
gateway's traffic (and a worker's own HTTP API), not only this gateway's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from heron.runtime.nats_names import Lane
from heron.runtime.protocol import ProtocolError, WorkerHeartbeat

log = logging.getLogger("heron.gateway.health")

# A worker silent this long is forgotten entirely (it only costs memory and /v1/models noise).
FORGET_AFTER_S = 300.0
THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True, slots=True)
class ItemCount:
    """A worker's item counters as one beat reported them."""

    received: float  # gateway monotonic time
    items_done: int
    model_items: dict[str, int]


@dataclass(frozen=True, slots=True)
class Throughput:
    """Items computed per second over the recent window: all models, and per model."""

    items_per_s: float = 0.0
    model_items_per_s: dict[str, float] = field(default_factory=dict)


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
    memory_rss: int = 0
    model_memory: dict[str, int] = field(default_factory=dict)  # model id -> bytes
    model_adapters: dict[str, str] = field(default_factory=dict)  # auto model id -> family
    lanes: tuple[str, ...] = ()  # the lanes it pulls (WorkerHeartbeat.lanes)
    # This worker's counters over the throughput window, oldest first (carried from beat to
    # beat by WorkerHealth.observe).
    counts: deque[ItemCount] = field(repr=False, default_factory=deque)


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

    def observe(self, message: Mapping[str, Any] | WorkerHeartbeat) -> None:
        """Record one heartbeat, decoded or read (malformed ones are dropped with a log
        line)."""
        try:
            beat = message if isinstance(message, WorkerHeartbeat) else \
                WorkerHeartbeat.from_wire(message)
        except ProtocolError as exc:
            log.warning("dropping a malformed heartbeat (%s): %r", exc, message)
            return
        received = self.clock()
        worker = WorkerBeat(
            worker_id=beat.worker_id, pool=beat.pool, bundle=beat.bundle,
            bundle_hash=beat.bundle_hash, ready=beat.ready, models=beat.models,
            queue_depth=beat.queue_depth, in_flight=beat.in_flight, address=beat.address,
            received=received, memory_rss=beat.memory_rss, model_memory=beat.model_memory,
            model_adapters=beat.model_adapters, lanes=beat.lanes)
        count = ItemCount(received, beat.items_done, beat.model_items)
        self._add_count(worker, count)
        self._check_bundle(worker)
        self._workers[worker.worker_id] = worker
        if self.is_healthy(worker):
            for waiter in self._waiters.pop(worker.pool, []):
                if not waiter.done():
                    waiter.set_result(None)

    def _add_count(self, worker: WorkerBeat, count: ItemCount) -> None:
        previous = self._workers.get(worker.worker_id)
        counts = previous.counts if previous is not None else deque()
        if counts and count.items_done < counts[-1].items_done:
            counts.clear()  # the counters went back: a restarted worker that kept its id
        counts.append(count)
        horizon = count.received - THROUGHPUT_WINDOW_S
        while counts[0].received < horizon:
            counts.popleft()
        worker.counts = counts

    def throughput(self, worker: WorkerBeat) -> Throughput:
        """Items/s the worker computed over the recent window; zero once it stops beating
        (a dead worker computes nothing) and until a second beat gives a time span."""
        counts = worker.counts
        if self.clock() - worker.received >= self.timeout_s or len(counts) < 2:
            return Throughput()
        first, last = counts[0], counts[-1]
        span = last.received - first.received
        if span <= 0:
            return Throughput()
        per_model = {m: max(0, n - first.model_items.get(m, 0)) / span
                     for m, n in last.model_items.items()}
        return Throughput(max(0, last.items_done - first.items_done) / span,
                          {m: rate for m, rate in per_model.items() if rate > 0})

    def expected(self, pool: str) -> tuple[str, str] | None:
        """(bundle, bundle hash) this gateway routes to ``pool``; None for a pool it does
        not route to."""
        return self._expected.get(pool)

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

    def was_healthy_at(self, pool: str, moment: float) -> bool:
        """Whether a worker of ``pool`` said ready in a beat within the heartbeat timeout
        before ``moment`` (or in any beat since): the pool was warm then."""
        return any(w.ready and w.received > moment - self.timeout_s for w in self.workers(pool))

    def healthy(self, pool: str) -> list[WorkerBeat]:
        return [w for w in self.workers(pool) if self.is_healthy(w)]

    def has_capacity(self, pool: str) -> bool:
        # A loop, not any() over a generator: asked once a request.
        for worker in self._workers.values():
            if worker.pool == pool and self.is_healthy(worker):
                return True
        return False

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

    @staticmethod
    def all_pull(healthy: list[WorkerBeat], lane: Lane) -> bool:
        """Whether every one of a pool's ``healthy`` workers pulls ``lane`` (a worker from
        before the low lane beats no lanes: work for it goes on the first lane instead)."""
        return bool(healthy) and all(lane.label in w.lanes for w in healthy)

    def model_adapter(self, pool: str, model_id: str) -> str | None:
        """The family a healthy worker of the pool loaded an ``auto`` model as (None: no
        worker has loaded it yet)."""
        for beat in self.healthy(pool):
            family = beat.model_adapters.get(model_id)
            if family is not None:
                return family
        return None

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
