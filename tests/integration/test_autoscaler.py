"""The local autoscaler's decisions over a real nats-server: leases (real heron_pools
bucket), demand and heartbeats (real NATS messages). The worker processes are a table
here (tests/integration/test_up_pools.py runs real ones through `heron up`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient

from heron.cli.autoscaler import Autoscaler, ScalePolicy
from heron.runtime.nats_names import demand_subject, ensure_pools_bucket, status_subject
from heron.runtime.pool_store import PoolStore
from heron.runtime.protocol import DemandNotice
from heron_sdk import wire
from heron_sdk.pools import PoolLease, PoolSpec
from tests.support.nats_server import NatsServer


class ProcessTable:
    """What LocalCluster does with processes, without processes: who runs in which pool."""

    def __init__(self) -> None:
        self.pool_of: dict[str, str] = {}
        self.bundle_of: dict[str, str] = {}
        self.exit_code: dict[str, int] = {}
        self.stopped: list[str] = []
        self._next = 0

    def alive(self, pool: str) -> list[str]:
        return [w for w, p in self.pool_of.items() if p == pool and w not in self.exit_code]

    def pools(self) -> set[str]:
        return set(self.pool_of.values())

    def reap(self) -> list[tuple[str, str, int]]:
        dead = [(w, self.pool_of.pop(w), code) for w, code in self.exit_code.items()]
        self.exit_code.clear()
        return dead

    async def start_worker(self, pool: str, bundle: str) -> str:
        self._next += 1
        worker_id = f"{pool}-{self._next}"
        self.pool_of[worker_id], self.bundle_of[worker_id] = pool, bundle
        return worker_id

    def stop_worker(self, worker_id: str) -> asyncio.Future[None]:
        if self.pool_of.pop(worker_id, None) is not None:
            self.stopped.append(worker_id)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def crash(self, worker_id: str) -> None:
        self.exit_code[worker_id] = -9


@contextlib.asynccontextmanager
async def scaler(tmp_path: Path) -> AsyncIterator[tuple[Autoscaler, ProcessTable, NatsClient]]:
    server = NatsServer(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    table = ProcessTable()
    autoscaler = Autoscaler(table, ScalePolicy(
        pool="static", bundle="default", min_workers=0, max_workers=2, idle_cooldown_s=0.5,
        interval_s=0.1, restart_backoff_s=0.3))
    try:
        await autoscaler.start(nc)
        yield autoscaler, table, nc
    finally:
        await autoscaler.stop()
        await nc.close()
        server.stop()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not true after {timeout_s}s"
        await asyncio.sleep(0.02)


async def lease(nc: NatsClient, name: str, workers: int, ttl_s: float = 30) -> None:
    await ensure_pools_bucket(nc.jetstream())
    await PoolStore(nc.jetstream()).create(PoolLease.new(PoolSpec(name, "small", workers,
                                                                   ttl_s)))


async def demand(nc: NatsClient, pool: str) -> None:
    await nc.publish(demand_subject(pool),
                     wire.encode(DemandNotice(pool, "x").to_wire(), wire.MSGPACK))


async def idle_beat(nc: NatsClient, pool: str, worker_id: str, *, ready: bool = True) -> None:
    beat = {"worker_id": worker_id, "pool": pool, "in_flight": 0, "queue_depth": 0,
            "ready": ready}
    await nc.publish(status_subject(pool, worker_id), wire.encode(beat, wire.MSGPACK))


async def test_a_lease_keeps_its_workers_and_loses_them_when_deleted(tmp_path: Path) -> None:
    async with scaler(tmp_path) as (_, table, nc):
        await lease(nc, "team-a", workers=2)
        await until(lambda: len(table.alive("team-a")) == 2)
        assert {table.bundle_of[w] for w in table.alive("team-a")} == {"small"}
        first, second = table.alive("team-a")
        await idle_beat(nc, "team-a", first)  # idle past the cooldown, but the lease asks
        await asyncio.sleep(0.8)  # for 2: they stay
        assert table.alive("team-a") == [first, second]
        table.crash(second)
        await until(lambda: len(table.alive("team-a")) == 2)  # restarted after the backoff
        assert first in table.alive("team-a") and second not in table.alive("team-a")
        assert table.stopped == []
        await PoolStore(nc.jetstream()).delete("team-a")
        await until(lambda: not table.alive("team-a"))
        assert first in table.stopped and len(table.stopped) == 2
        assert table.alive("static") == []  # nothing else was started


async def test_an_expired_lease_loses_its_workers(tmp_path: Path) -> None:
    async with scaler(tmp_path) as (_, table, nc):
        await lease(nc, "brief", workers=1, ttl_s=1)
        await until(lambda: len(table.alive("brief")) == 1)
        await until(lambda: not table.alive("brief"), timeout_s=3)
        assert len(table.stopped) == 1


async def test_a_zero_worker_lease_scales_on_demand_and_back(tmp_path: Path) -> None:
    async with scaler(tmp_path) as (_, table, nc):
        await lease(nc, "lazy", workers=0)
        await demand(nc, "nobody")  # not a lease, not the static pool: ignored
        await asyncio.sleep(0.5)
        assert table.pool_of == {}
        await demand(nc, "lazy")
        await until(lambda: len(table.alive("lazy")) == 1)
        await demand(nc, "lazy")  # one is running: no second one
        await asyncio.sleep(0.3)
        [worker] = table.alive("lazy")
        await idle_beat(nc, "lazy", worker)
        await until(lambda: table.stopped == [worker], timeout_s=3)
        assert table.alive("lazy") == []


async def test_the_static_pool_scales_from_zero_as_before(tmp_path: Path) -> None:
    async with scaler(tmp_path) as (_, table, nc):
        await demand(nc, "static")
        await until(lambda: len(table.alive("static")) == 1)
        await demand(nc, "static")
        await asyncio.sleep(0.3)
        [worker] = table.alive("static")
        assert table.bundle_of[worker] == "default"
        await idle_beat(nc, "static", worker)
        await until(lambda: table.stopped == [worker], timeout_s=3)


async def test_a_worker_still_starting_is_not_idle(tmp_path: Path) -> None:
    """Woken from zero, a worker loads its models for longer than the cooldown (0.5 s): it
    beats without work all along, and is stopped only once it was ready and idle."""
    async with scaler(tmp_path) as (_, table, nc):
        await demand(nc, "static")
        await until(lambda: len(table.alive("static")) == 1)
        [worker] = table.alive("static")
        for _ in range(10):  # 1.5 s of beats while loading
            await idle_beat(nc, "static", worker, ready=False)
            await asyncio.sleep(0.15)
        assert table.stopped == [] and table.alive("static") == [worker]
        await idle_beat(nc, "static", worker)  # ready now, and no work comes
        await until(lambda: table.stopped == [worker], timeout_s=3)


async def test_a_started_worker_is_announced_once_when_it_first_says_ready(
        tmp_path: Path) -> None:
    """The line that tells whoever runs `heron up` a worker serves: on its first ready beat,
    once; not while it loads, and not for a worker this autoscaler did not start."""
    async with scaler(tmp_path) as (autoscaler, table, nc):
        lines: list[str] = []
        autoscaler.announce = lines.append
        await demand(nc, "static")
        await until(lambda: len(table.alive("static")) == 1)
        [worker] = table.alive("static")
        await idle_beat(nc, "static", worker, ready=False)
        await idle_beat(nc, "static", "someone-else")  # a worker of another heron up
        await nc.flush()
        await asyncio.sleep(0.2)
        assert lines == []
        for _ in range(3):
            await idle_beat(nc, "static", worker)
        await until(lambda: len(lines) == 1)
        await asyncio.sleep(0.2)
        assert len(lines) == 1
        assert lines[0].startswith(f"heron up: worker {worker} ready, pool static (")
