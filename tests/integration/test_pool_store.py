"""The heron_pools bucket on a real nats-server: idempotent declaration, compare-and-set
creates and renewals, names free again after expiry or delete, and a mirror that sees
leases come and go."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StorageType

from heron.runtime.nats_names import POOLS_MARKER_TTL_S, ensure_pools_bucket
from heron.runtime.pool_store import POOLS_STREAM, LeaseMirror, PoolStore
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.pools import PoolLease, PoolSpec
from tests.support.nats_server import NatsServer


@contextlib.asynccontextmanager
async def jetstream(server: NatsServer) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(server.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


def new_lease(ttl_s: float = 30.0) -> PoolLease:
    return PoolLease.new(PoolSpec(f"t-{uuid.uuid4().hex[:8]}", "default", 1, ttl_s))


async def until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not true after {timeout_s}s"
        await asyncio.sleep(0.05)


async def test_the_bucket_is_declared_once_with_expiry_markers(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await ensure_pools_bucket(js)
        await ensure_pools_bucket(js)  # a second gateway starting: no error
        config = (await js.stream_info(POOLS_STREAM)).config
        assert config.max_msgs_per_subject == 1 and config.storage == StorageType.FILE
        assert config.allow_msg_ttl and config.subject_delete_marker_ttl == POOLS_MARKER_TTL_S


async def test_create_is_compare_and_set(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await ensure_pools_bucket(js)
        lease = new_lease()
        stores = [PoolStore(js) for _ in range(6)]
        results = await asyncio.gather(*(s.create(lease) for s in stores), return_exceptions=True)
        created = [r for r in results if isinstance(r, int)]
        conflicts = [r for r in results if isinstance(r, HeronError)]
        assert len(created) == 1 and len(conflicts) == 5
        assert {c.code for c in conflicts} == {ErrorCode.POOL_CONFLICT}
        stored = await stores[0].read(lease.name)
        assert stored.lease == lease and stored.revision == created[0]
        await stores[0].delete(lease.name)


async def test_a_name_is_free_again_after_expiry_and_after_delete(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await ensure_pools_bucket(js)
        store = PoolStore(js)
        lease = new_lease(ttl_s=1)
        await store.create(lease)
        # the server removes the key after its TTL and leaves a marker in its place
        await until(lambda: _marker_left(js, lease.name), timeout_s=5)
        assert (await store.read(lease.name)).lease is None
        with pytest.raises(HeronError) as gone:
            await store.renew(lease.name, lambda current: 30)
        assert gone.value.code == ErrorCode.POOL_NOT_FOUND  # expired is never renewed
        again = PoolLease.new(PoolSpec(lease.name, "default", 0, 30))
        await store.create(again)  # over the marker
        renewed, _ = await store.renew(lease.name, lambda current: current.ttl_s + 10)
        assert renewed.ttl_s == 40 and renewed.renewed_at >= again.renewed_at
        await store.delete(lease.name)
        with pytest.raises(HeronError) as deleted:
            await store.delete(lease.name)
        assert deleted.value.code == ErrorCode.POOL_NOT_FOUND
        await store.create(PoolLease.new(PoolSpec(lease.name, "default", 1, 30)))
        await store.delete(lease.name)


async def _marker_left(js: JetStreamContext, name: str) -> bool:
    msg = await js.get_msg(POOLS_STREAM, subject=f"$KV.heron_pools.{name}")
    return bool(msg.headers and msg.headers.get("Nats-Marker-Reason"))


async def test_the_mirror_sees_leases_come_and_go(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await ensure_pools_bucket(js)
        events: list[tuple[str, bool]] = []
        mirror = LeaseMirror(on_change=lambda name, lease: events.append((name, lease is not None)))
        store = PoolStore(js)
        existing, short, deleted = new_lease(), new_lease(ttl_s=1), new_lease()
        await store.create(existing)  # before the mirror starts: it comes with the snapshot
        await mirror.start(js)
        try:
            await until(lambda: _async(mirror.synced and mirror.get(existing.name) is not None))
            await store.create(short)
            await store.create(deleted)
            await until(lambda: _async(mirror.get(deleted.name) is not None))
            await store.delete(deleted.name)
            await until(lambda: _async(mirror.get(deleted.name) is None))
            await until(lambda: _async(short.name not in mirror.live()), timeout_s=3)
            assert (short.name, False) in events and (deleted.name, False) in events
            assert mirror.get(existing.name) == existing
            await mirror.start(js)  # watching afresh (as after a reconnect) changes nothing
            await asyncio.sleep(0.3)
            assert mirror.get(existing.name) == existing
            assert events.count((existing.name, True)) == 1
        finally:
            await mirror.stop()
            await store.delete(existing.name)


async def _async(value: bool) -> bool:
    return value
