"""The single-writer lease: key CONFIG_LEADER_KEY in the NATS KV bucket CONFIG_LEADER_BUCKET,
whose TTL is the lease's. Value: the holder's instance id.

Acquire with ``kv.create`` (fails while anyone holds it), renew every ttl/3 with
``kv.update(last=revision)``. A renewal that the server refuses (someone else's revision)
ends the lease at once; one that cannot reach the server ends it locally once the lease
could have lapsed on the server (measured from the last renewal *sent*, so the holder
always gives up before anyone else can take over). A clean stop deletes the key, so a
standby takes over at its next try instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from heron.runtime.nats_names import CONFIG_LEADER_BUCKET, CONFIG_LEADER_KEY

log = logging.getLogger("heron.config.leader")

OnElected = Callable[[int], Awaitable[None]]  # gets the term number


async def leader_bucket(js: JetStreamContext, ttl_s: float) -> KeyValue:
    """The lease bucket, created with TTL ``ttl_s`` if missing (an existing bucket keeps
    the TTL it was created with: every instance should use the same lease TTL)."""
    try:
        return await js.key_value(CONFIG_LEADER_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(
            bucket=CONFIG_LEADER_BUCKET, ttl=ttl_s, history=1,
            description="Heron config service: the writer's lease"))


class LeaderLease:
    # Give up this much before the server could expire the key (clock rates, latency).
    SAFETY = 0.8

    def __init__(self, instance_id: str, ttl_s: float, *, on_elected: OnElected,
                 on_lost: Callable[[], None]) -> None:
        if ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.instance_id = instance_id
        self.ttl_s = ttl_s
        self.on_elected = on_elected
        self.on_lost = on_lost
        self.kv: KeyValue | None = None
        self.revision: int | None = None
        self.term = 0  # bumped on every acquisition
        self.holder: str | None = None  # the last holder seen (ourselves when leading)
        self._valid_until = 0.0
        self._elected: set[asyncio.Task[None]] = set()

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    @property
    def is_leader(self) -> bool:
        return self.revision is not None and time.monotonic() < self._valid_until

    async def declare_bucket(self, nc: NatsClient) -> None:
        """Look up (or create) the lease bucket on this connection: at NATS setup and again
        after every reconnect (a NATS that came back without its store lost the bucket)."""
        # Lease calls time out well inside the lease, so a stuck one cannot outlive it.
        js = nc.jetstream(timeout=max(0.5, self.interval_s))
        self.kv = await leader_bucket(js, self.ttl_s)

    async def run(self) -> None:
        """Forever: acquire or renew every ttl/3, on the bucket ``declare_bucket`` found
        last (it is looked up again after a NATS reconnect)."""
        while True:
            kv = self.kv
            assert kv is not None, "declare_bucket() first"
            if self.revision is None:
                await self._try_acquire(kv)
            else:
                await self._renew(kv)
            await asyncio.sleep(self.interval_s)

    async def _try_acquire(self, kv: KeyValue) -> None:
        sent = time.monotonic()
        value = self.instance_id.encode()
        try:
            revision = await kv.create(CONFIG_LEADER_KEY, value)
        except KeyWrongLastSequenceError:
            try:
                entry = await kv.get(CONFIG_LEADER_KEY)
            except Exception:
                return  # lapsed meanwhile (or NATS trouble): try again next tick
            self.holder = (entry.value or b"").decode(errors="replace")
            if self.holder != self.instance_id or entry.revision is None:
                return
            try:  # our own lease from before a restart: take it back
                revision = await kv.update(CONFIG_LEADER_KEY, value, last=entry.revision)
            except Exception:
                return
        except Exception as exc:
            log.debug("leader lease: acquire failed: %r", exc)
            return
        self.revision = revision
        self.holder = self.instance_id
        self._valid_until = sent + self.ttl_s * self.SAFETY
        self.term += 1
        log.info("leader lease acquired by %s (term %d)", self.instance_id, self.term)
        task = asyncio.get_running_loop().create_task(self.on_elected(self.term))
        self._elected.add(task)
        task.add_done_callback(self._elected.discard)

    async def _renew(self, kv: KeyValue) -> None:
        sent = time.monotonic()
        try:
            self.revision = await kv.update(CONFIG_LEADER_KEY, self.instance_id.encode(),
                                            last=self.revision)
            self._valid_until = sent + self.ttl_s * self.SAFETY
            return
        except KeyWrongLastSequenceError:
            self._lose("the lease was taken over or lapsed")
        except Exception as exc:
            if time.monotonic() >= self._valid_until:
                self._lose(f"cannot renew it: {exc!r}")
            else:
                log.warning("leader lease: renewal failed, retrying: %r", exc)

    def _lose(self, why: str) -> None:
        log.warning("leader lease lost by %s: %s", self.instance_id, why)
        self.revision = None
        self._valid_until = 0.0
        for task in list(self._elected):
            task.cancel()
        self.on_lost()

    async def resign(self) -> None:
        """Give the lease back now (a clean stop): a standby takes over at its next try."""
        revision, kv = self.revision, self.kv
        self.revision, self._valid_until = None, 0.0
        for task in list(self._elected):
            task.cancel()
        if revision is not None and kv is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(kv.delete(CONFIG_LEADER_KEY, last=revision), 2.0)
                log.info("leader lease released by %s", self.instance_id)
