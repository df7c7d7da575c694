"""The result cache's shared tier (worker/shared_results.py) on a real nats-server of its
own: the bucket is declared bounded in bytes, discarding the oldest entries, with its TTL,
and a second worker uses it as it is; values written by one tier are read by another; a
full bucket keeps the newest; a frozen server (SIGSTOP: connected, silent) costs a lookup
its timeout and a stopped one nothing, and neither raises."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import numpy as np
import psutil
import pytest
from nats.js.api import DiscardPolicy, StorageType

from heron.runtime.nats_names import RESULTS_BUCKET
from heron.worker.shared_results import SharedResults
from tests.support.nats_server import NatsServer

STREAM = f"KV_{RESULTS_BUCKET}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    own = NatsServer(tmp_path / "nats").start()
    yield own
    if own.proc is not None:
        os.kill(own.proc.pid, signal.SIGCONT)  # a test may have frozen it
    own.stop()


@contextlib.asynccontextmanager
async def connected(server: NatsServer) -> AsyncIterator[nats.NATS]:
    """A client on the test's own event loop (async fixtures run on the session's)."""
    nc = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    try:
        yield nc
    finally:
        await nc.close()


async def bound(nc: nats.NATS, max_bytes: int = 1 << 20, ttl_s: float = 3600.0,
                timeout_s: float = 0.5) -> SharedResults:
    tier = SharedResults(max_bytes, ttl_s, timeout_s)
    tier.attach(nc, nc.jetstream())
    deadline = time.monotonic() + 10
    while not tier.bound:
        assert time.monotonic() < deadline, "the bucket was not declared"
        await asyncio.sleep(0.02)
    return tier


def vector(n: int, size: int = 1024) -> dict[str, np.ndarray]:
    return {"dense": np.full(size, n, dtype=np.float32)}


async def test_the_bucket_is_bounded_and_shared_between_workers(server: NatsServer) -> None:
    async with connected(server) as conn:
        await bucket_checks(conn)


async def bucket_checks(conn: nats.NATS) -> None:
    first = await bound(conn, max_bytes=1 << 20, ttl_s=3600.0)
    second = await bound(conn, max_bytes=8 << 20, ttl_s=60.0)  # another worker's settings
    info = await conn.jetstream().stream_info(STREAM)
    c = info.config
    assert (c.max_bytes, c.max_age, c.discard, c.max_msgs_per_subject, c.storage) == (
        1 << 20, 3600.0, DiscardPolicy.OLD, 1, StorageType.FILE)  # the first one's
    assert c.allow_direct and c.max_msg_size >= 256 * 1024

    first.store("m.s.k1", vector(1, 384))
    first.store("m.s.k2", 0.25)
    await first.flush()
    found = await second.get_many(["m.s.k1", "m.s.k2", "m.s.none"])
    np.testing.assert_array_equal(found[0]["dense"], vector(1, 384)["dense"])
    assert found[1] == 0.25 and found[2] is None
    assert (second.stats.hits, second.stats.misses, second.stats.errors) == (2, 1, 0)

    # Full: the oldest entries go, the newest stay (4 KiB values, 1.5 MiB into 1 MiB).
    for start in range(0, 384, 48):
        for n in range(start, start + 48):
            first.store(f"m.s.v{n}", vector(n))
        await first.flush()
    oldest, newest = await second.get_many(["m.s.v0", "m.s.v383"])
    assert oldest is None and newest is not None and newest["dense"][0] == 383
    assert (await conn.jetstream().stream_info(STREAM)).state.bytes <= 1 << 20
    assert first.stats.store_errors == 0 and first.stats.dropped == 0


async def test_nats_frozen_or_away_costs_the_timeout_and_fails_nothing(
        server: NatsServer) -> None:
    async with connected(server) as conn:
        await outage_checks(server, conn)


async def outage_checks(server: NatsServer, conn: nats.NATS) -> None:
    tier = await bound(conn, timeout_s=0.1)
    tier.store("m.s.k", vector(7))
    await tier.flush()
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)  # connected, and silent
    while psutil.Process(server.proc.pid).status() != psutil.STATUS_STOPPED:
        await asyncio.sleep(0.001)  # the signal is delivered when the process is scheduled
    started = time.monotonic()
    assert await tier.get_many(["m.s.k", "m.s.other"]) == [None, None]
    assert time.monotonic() - started < 0.6 and tier.stats.errors == 2
    os.kill(server.proc.pid, signal.SIGCONT)
    assert (await tier.get_many(["m.s.k"]))[0] is not None  # back: found again

    server.stop()
    deadline = time.monotonic() + 10
    while conn.is_connected:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    started = time.monotonic()
    assert await tier.get_many(["m.s.k"]) == [None]
    # Not even tried: under the 0.1 s a try would wait (timeout_s above); 50 ms left little
    # room for a loaded 2-core host's scheduling.
    assert time.monotonic() - started < 0.1 and tier.stats.errors == 3
    tier.store("m.s.k2", vector(8))
    assert tier.stats.dropped == 1
    await tier.close()
