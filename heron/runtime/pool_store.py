"""Leased pools in the ``heron_pools`` NATS KV bucket: writes and a live mirror.

``PoolStore`` writes leases (create, renew, delete). Create and renew are compare-and-set
on the key's last revision, so two gateways creating one name get one success and one
conflict, and a renewal never brings back a lease that was deleted or has expired. Each
write carries the lease's TTL as the message's own TTL: a lease nobody renews is removed
by the NATS server itself, which then writes a marker that every watcher sees.

``LeaseMirror`` keeps the live leases in memory from a KV watcher (gateways route with
it, ``heron up`` scales with it). It also drops a lease once ``PoolLease.expired()``,
before the server's marker arrives (the TTL has a one-second resolution).

nats-py's ``KeyValue.get``/``create`` do not read the server's expiry marker
(``Nats-Marker-Reason``) as a deletion, so reads and conditional writes go through the
bucket's stream here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue

from heron.runtime.nats_names import POOLS_BUCKET, POOLS_MARKER_TTL_S, ensure_pools_bucket
from heron_sdk.errors import ErrorCode, HeronError, ProtocolError
from heron_sdk.pools import PoolLease

log = logging.getLogger("heron.pools")

POOLS_STREAM = f"KV_{POOLS_BUCKET}"
_KEY_PREFIX = f"$KV.{POOLS_BUCKET}."
_KV_OPERATION = "KV-Operation"
_MARKER_REASON = "Nats-Marker-Reason"
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream: the key moved on since we read it
_RENEW_ATTEMPTS = 3


def pool_not_found(name: str) -> HeronError:
    return HeronError(ErrorCode.POOL_NOT_FOUND,
                      f"pool {name!r} does not exist or its lease has ended; GET /v1/pools "
                      "lists the pools")


def lease_from_entry(value: bytes | None, headers: dict[str, str] | None,
                     name: str) -> PoolLease | None:
    """The lease a bucket message holds; None for a delete/purge/expiry marker or an
    unreadable value (logged: a key we did not write is no pool)."""
    headers = headers or {}
    if headers.get(_KV_OPERATION) or headers.get(_MARKER_REASON) or not value:
        return None
    try:
        lease = PoolLease.from_kv(value)
    except ProtocolError as exc:
        log.warning("ignoring an unreadable lease under %s: %r", name, exc)
        return None
    return lease if lease.name == name else None


@dataclass(frozen=True, slots=True)
class StoredLease:
    """A key's state: its live lease (None when never written, deleted or expired) and
    its last revision (0 when the bucket holds nothing for it)."""

    lease: PoolLease | None
    revision: int


class PoolStore:
    def __init__(self, js: JetStreamContext, timeout_s: float = 2.0) -> None:
        self.js = js
        self.timeout_s = timeout_s

    async def read(self, name: str) -> StoredLease:
        try:
            msg = await self.js.get_msg(POOLS_STREAM, subject=_KEY_PREFIX + name)
        except NotFoundError:
            return StoredLease(None, 0)
        lease = lease_from_entry(msg.data, msg.headers, name)
        if lease is not None and lease.expired():
            lease = None  # the server removes it within a second; it is over already
        return StoredLease(lease, msg.seq or 0)

    async def create(self, lease: PoolLease) -> int:
        """Write a new lease; 409 POOL_CONFLICT when a live one has the name (also when
        another writer got there between our read and our write)."""
        current = await self.read(lease.name)
        if current.lease is not None:
            raise _conflict(lease.name)
        try:
            return await self._write(lease, last=current.revision)
        except _WrongLast:
            raise _conflict(lease.name) from None

    async def renew(self, name: str, ttl_for: Callable[[PoolLease], float]
                    ) -> tuple[PoolLease, int]:
        """Extend a live lease by ``ttl_for(lease)`` seconds from now; 404 POOL_NOT_FOUND
        when it is gone. A concurrent renewal makes us read and try again; a concurrent
        delete or expiry makes it a 404."""
        for _ in range(_RENEW_ATTEMPTS):
            current = await self.read(name)
            if current.lease is None:
                raise pool_not_found(name)
            renewed = current.lease.renewed(ttl_for(current.lease))
            try:
                return renewed, await self._write(renewed, last=current.revision)
            except _WrongLast:
                continue
        raise HeronError(ErrorCode.POOL_CONFLICT, f"pool {name!r} is being renewed "
                         "concurrently; try again", retry_after_s=1.0)

    async def delete(self, name: str) -> int:
        """End a live lease now (404 when there is none); the purge marker expires too."""
        if (await self.read(name)).lease is None:
            raise pool_not_found(name)
        ack = await self.js.publish(
            _KEY_PREFIX + name, b"", timeout=self.timeout_s, msg_ttl=POOLS_MARKER_TTL_S,
            headers={_KV_OPERATION: "PURGE", "Nats-Rollup": "sub"})
        return ack.seq

    async def _write(self, lease: PoolLease, last: int) -> int:
        # NATS message TTLs are whole seconds: round up, so the key never disappears
        # before the lease's own expires_at (the mirror ends it on time by the clock).
        try:
            ack = await self.js.publish(
                _KEY_PREFIX + lease.name, lease.to_kv(), timeout=self.timeout_s,
                msg_ttl=float(math.ceil(lease.ttl_s)), headers={_EXPECTED_LAST: str(last)})
        except APIError as exc:
            if exc.err_code in _WRONG_LAST_SEQUENCE:
                raise _WrongLast from exc
            raise
        return ack.seq


class _WrongLast(Exception):
    """A conditional write found the key at another revision than the one we read."""


def _conflict(name: str) -> HeronError:
    return HeronError(ErrorCode.POOL_CONFLICT, f"pool {name!r} already exists")


LeaseListener = Callable[[str, PoolLease | None], None]


class LeaseMirror:
    """The live leases, kept from a watcher on the bucket. ``on_change(name, lease)`` is
    called when a lease appears or changes, and with None when it ends (deleted, expired,
    or gone while we were disconnected)."""

    def __init__(self, on_change: LeaseListener | None = None, *,
                 sweep_interval_s: float = 0.25, retry_s: float = 1.0) -> None:
        self.on_change = on_change
        self.sweep_interval_s = sweep_interval_s
        self.retry_s = retry_s
        self.synced = False  # the watcher delivered the bucket's state at least once
        self._leases: dict[str, PoolLease] = {}
        self._revisions: dict[str, int] = {}  # newest revision seen per name, ended too
        self._watch_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None

    # ---- reading ---------------------------------------------------------------------
    def get(self, name: str) -> PoolLease | None:
        lease = self._leases.get(name)
        if lease is not None and lease.expired():
            self._end(name)
            return None
        return lease

    def live(self) -> dict[str, PoolLease]:
        self._sweep()
        return dict(self._leases)

    # ---- writing (what this process wrote itself, before its watcher says so) ------------
    def apply(self, name: str, lease: PoolLease | None, revision: int) -> None:
        if revision <= self._revisions.get(name, 0):
            return  # older than what we know
        self._revisions[name] = revision
        if lease is None or lease.expired():
            self._end(name)
        elif self._leases.get(name) != lease:
            self._leases[name] = lease
            self._notify(name, lease)

    # ---- the watcher -----------------------------------------------------------------
    async def start(self, js: JetStreamContext) -> None:
        """Start watching, or watch afresh (after a reconnect: the old watcher's consumer
        may be gone with the server, and keys may have ended meanwhile)."""
        await self._cancel_watch()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch_forever(js))
        if self._sweep_task is None:
            self._sweep_task = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        await self._cancel_watch()
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep_task
            self._sweep_task = None

    async def _cancel_watch(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None

    async def _watch_forever(self, js: JetStreamContext) -> None:
        while True:
            try:
                await self._watch(await ensure_pools_bucket(js))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away or the bucket gone: watch again shortly
                log.warning("watching the %s bucket failed (%r); retrying in %.0fs",
                            POOLS_BUCKET, exc, self.retry_s)
            await asyncio.sleep(self.retry_s)

    async def _watch(self, kv: KeyValue) -> None:
        watcher = await kv.watchall()
        # Until the watcher's first None, entries are the bucket's current state: collect
        # them and swap them in at once, so leases that ended while we were away end here.
        snapshot: dict[str, tuple[PoolLease | None, int]] | None = {}
        try:
            async for entry in watcher:
                if entry is None:
                    if snapshot is not None:
                        self._replace(snapshot)
                        snapshot = None
                    continue
                lease = lease_from_entry(entry.value, {_KV_OPERATION: entry.operation}
                                         if entry.operation else None, entry.key)
                if snapshot is not None:
                    snapshot[entry.key] = (lease, entry.revision or 0)
                else:
                    self.apply(entry.key, lease, entry.revision or 0)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.stop(), 2.0)

    def _replace(self, snapshot: dict[str, tuple[PoolLease | None, int]]) -> None:
        for name in [n for n in self._leases if n not in snapshot]:
            self._end(name)
        self._revisions = {n: rev for n, (_, rev) in snapshot.items()}
        for name, (lease, _) in snapshot.items():
            if lease is None or lease.expired():
                self._end(name)
            elif self._leases.get(name) != lease:
                self._leases[name] = lease
                self._notify(name, lease)
        self.synced = True

    # ---- expiry by the clock -----------------------------------------------------------
    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self._sweep()

    def _sweep(self) -> None:
        now = time.time()
        for name in [n for n, lease in self._leases.items() if lease.expired(now)]:
            self._end(name)

    def _end(self, name: str) -> None:
        if self._leases.pop(name, None) is not None:
            self._notify(name, None)

    def _notify(self, name: str, lease: PoolLease | None) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(name, lease)
        except Exception:  # a listener's bug must not stop the mirror
            log.exception("pool listener failed for %s", name)

