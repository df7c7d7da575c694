"""The config service's engine: the registry read from the store, the NATS connection, the
writer lease, accepted writes and their deltas. config_service/routes.py is its HTTP face.

Start-up (in the background; the app answers /healthz at once): read the store (retried
until it answers), connect to NATS (forever), declare HERON_CONFIG and the lease bucket,
then try for the lease every ttl/3. On election: re-read the store (another instance may
have written), drop orphan change files, publish committed-but-unpublished deltas, and only
then accept writes. A standby re-reads the journal every second, so its GETs stay current.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections import OrderedDict
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from heron.config_service.body import body_digest, check_remote_code, decode, parse_posted
from heron.config_service.leader import LeaderLease
from heron.config_service.metrics import ConfigMetrics
from heron.config_service.state import Change, Registry
from heron.config_service.store import ConfigStore, Journal, LeaseLost
from heron.runtime.nats_link import NatsLink
from heron.runtime.nats_names import config_all_subject, config_subject, ensure_config_stream
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError

log = logging.getLogger("heron.config")

RETRY_S = 1.0
REFRESH_S = 1.0  # a standby re-reads the journal this often
PUBLISH_TIMEOUT_S = 2.0
MAX_REMEMBERED_NOOPS = 10_000  # Idempotency-Keys of 200 answers kept in memory


class ConfigService:
    def __init__(self, nats_url: str, store: ConfigStore, base: Registry, *,
                 instance_id: str, lease_ttl_s: float, metrics: ConfigMetrics,
                 allow_remote_code: bool = False) -> None:
        self.nats_url = nats_url
        # Posts may set trust_remote_code (configs already stored, and the bundles dir,
        # are the operator's and load either way).
        self.allow_remote_code = allow_remote_code
        self.store = store
        self.base = base
        self.registry = copy.deepcopy(base)
        self.journal = Journal(0, [])
        self.instance_id = instance_id
        self.metrics = metrics
        self.lease = LeaderLease(instance_id, lease_ttl_s, on_elected=self._on_elected,
                                 on_lost=self._on_lost)
        self.loaded = False
        self.writable = False
        self.nats = NatsLink(nats_url, name=f"heron-config-{instance_id}",
                             setup=self._set_up_nats, on_reconnect=self._set_up_nats,
                             logger_name="heron.config.nats")
        self.last_error: str | None = None
        self._pending: dict[int, Change] = {}  # committed, deltas not out yet
        self._answers: OrderedDict[str, tuple[str, int, dict[str, Any]]] = OrderedDict()
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- state seen from outside ------------------------------------------------------
    @property
    def can_write(self) -> bool:
        return self.writable and self.lease.is_leader

    @property
    def nats_connected(self) -> bool:
        return self.nats.ready

    @property
    def ready(self) -> bool:
        return self.loaded and self.nats_connected

    def status(self) -> dict[str, Any]:
        self.update_gauges()
        return {"instance_id": self.instance_id, "leader": self.can_write,
                "leader_id": self.lease.holder, "epoch": self.registry.epoch,
                "store": self.store.describe(), "store_loaded": self.loaded,
                "nats_connected": self.nats_connected,
                "last_error": self.last_error or self.nats.last_error}

    def update_gauges(self) -> None:
        m = self.metrics
        m.epoch.set(self.registry.epoch)
        m.is_leader.set(1 if self.can_write else 0)
        m.models.set(len(self.registry.models))
        m.unpublished.set(len(self.journal.unpublished()))
        m.nats_connected.set(1 if self.nats_connected else 0)

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._main()))

    async def stop(self) -> None:
        self.writable = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.lease.resign()
        await self.nats.close()

    async def _main(self) -> None:
        while not self.loaded:
            try:
                await self.refresh()
                self.loaded = True
                log.info("config store %s loaded at epoch %d", self.store.describe(),
                         self.registry.epoch)
            except Exception as exc:
                self._error("store", f"cannot load the store {self.store.describe()}: {exc}")
                await asyncio.sleep(RETRY_S)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._follow()))
        self.nats.start()
        await self.nats.wait_set_up()
        self._tasks.append(loop.create_task(self._publish_loop()))
        await self.lease.run()

    async def _set_up_nats(self, nc: NatsClient, js: JetStreamContext) -> None:
        """Once connected, and again after every reconnect (a NATS that came back without
        its store lost them): the config stream and the lease bucket."""
        await ensure_config_stream(js)
        await self.lease.declare_bucket(nc)

    def _error(self, op: str, message: str) -> None:
        self.last_error = message
        self.metrics.store_errors.labels(op).inc()
        log.error(message)

    # ---- reading the store --------------------------------------------------------------
    async def refresh(self) -> None:
        """Catch up with the store: apply the changes its journal has that we do not."""
        journal = await asyncio.to_thread(self.store.read_journal)
        registry = self.registry
        if journal.epoch < registry.epoch:
            log.error("the store's epoch %d is behind ours (%d): re-reading it whole",
                      journal.epoch, registry.epoch)
            registry = copy.deepcopy(self.base)
        after = registry.epoch
        changes = await asyncio.to_thread(
            lambda: list(self.store.read_changes(journal, after=after)))
        for change in changes:
            registry.apply(change)
            if change.idempotency_key and change.body_sha256:
                self._remember(change.idempotency_key, change.body_sha256, 201, change.answer())
        unpublished = {e.epoch for e in journal.unpublished()}
        self._pending = {e: c for e, c in self._pending.items() if e in unpublished}
        self._pending.update({c.epoch: c for c in changes if c.epoch in unpublished})
        self.registry, self.journal = registry, journal
        self.last_error = None
        self.update_gauges()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            if self.writable:
                continue
            try:
                async with self._lock:
                    await self.refresh()
            except Exception as exc:
                self._error("read", f"re-reading the store failed: {exc}")

    # ---- leadership -----------------------------------------------------------------------
    async def _on_elected(self, term: int) -> None:
        async with self._lock:
            while True:
                try:
                    await self.refresh()
                    orphans = await asyncio.to_thread(self.store.remove_orphans, self.journal)
                    break
                except Exception as exc:
                    self._error("read", f"re-reading the store on election failed: {exc}")
                    await asyncio.sleep(RETRY_S)
            if orphans:
                log.warning("removed uncommitted change files: %s", orphans)
            await self._publish_pending()
            if self.lease.term == term and self.lease.is_leader:
                self.writable = True
                self.metrics.leader_changes.inc()
                log.info("%s accepts config writes at epoch %d", self.instance_id,
                         self.registry.epoch)
        self.update_gauges()

    def _on_lost(self) -> None:
        self.writable = False
        self.metrics.leader_changes.inc()
        self.update_gauges()

    def not_leader(self) -> HeronError:
        holder = self.lease.holder
        who = f"; the leader is {holder}" if holder and holder != self.instance_id else ""
        return HeronError(ErrorCode.NOT_LEADER,
                          f"config service {self.instance_id} does not hold the writer lease"
                          f"{who}; retry", retry_after_s=self.lease.ttl_s)

    # ---- writes -------------------------------------------------------------------------
    async def post(self, raw: bytes, content_type: str | None,
                   idempotency_key: str | None) -> tuple[int, dict[str, Any]]:
        if not self.can_write:
            raise self.not_leader()
        digest = body_digest(raw)
        posted = parse_posted(decode(raw, content_type))
        check_remote_code(posted.model, self.allow_remote_code)
        async with self._lock:
            if not self.can_write:
                raise self.not_leader()
            if idempotency_key and (seen := self._answers.get(idempotency_key)) is not None:
                if seen[0] != digest:
                    raise HeronError(ErrorCode.CONTENT_CONFLICT,
                                     "Idempotency-Key was used before with another body",
                                     field="Idempotency-Key")
                return seen[1], seen[2]
            change = self.registry.plan(posted.model, posted.bundles,
                                        idempotency_key=idempotency_key, body_sha256=digest)
            if change is None:
                model_id = posted.model.id
                answer = {"id": model_id, "epoch": self.registry.updated.get(model_id, 0),
                          "bundles": self.registry.model_bundles(model_id), "created": False}
                if idempotency_key:
                    self._remember(idempotency_key, digest, 200, answer)
                return 200, answer
            try:
                self.journal = await asyncio.to_thread(
                    self.store.commit, self.journal, change, lambda: self.lease.is_leader)
            except LeaseLost as exc:
                raise self.not_leader() from exc
            except Exception as exc:
                self._error("write", f"the store could not be written: {exc}")
                raise HeronError(ErrorCode.NOT_READY, f"the config store could not be "
                                 f"written: {exc}", retry_after_s=2) from exc
            self.registry.apply(change)
            self._pending[change.epoch] = change
            if idempotency_key:
                self._remember(idempotency_key, digest, 201, change.answer())
            log.info("epoch %d: %s %s (bundles %s)", change.epoch,
                     "added" if change.new_model else "extended", change.id,
                     ", ".join(change.bundles))
            await self._publish_pending()
        self.update_gauges()
        return 201, change.answer()

    def _remember(self, key: str, digest: str, status: int, answer: dict[str, Any]) -> None:
        self._answers[key] = (digest, status, answer)
        self._answers.move_to_end(key)
        while len(self._answers) > MAX_REMEMBERED_NOOPS:
            self._answers.popitem(last=False)

    # ---- deltas -------------------------------------------------------------------------
    async def _publish_pending(self) -> None:
        """Publish the unpublished changes in epoch order, then mark them (under the lock).
        A failure leaves them for the next try; re-publishing is de-duplicated."""
        entries = self.journal.unpublished()
        if not entries or not self.nats_connected:
            return
        done: set[int] = set()
        try:
            for entry in entries:
                change = self._pending.get(entry.epoch)
                if change is None:
                    change = await asyncio.to_thread(self.store.read_change, entry)
                await self._publish(change)
                done.add(entry.epoch)
        except Exception as exc:
            self.metrics.publish_errors.inc()
            log.warning("publishing config deltas failed (will retry): %r", exc)
        if done:
            try:
                self.journal = await asyncio.to_thread(self.store.mark_published,
                                                       self.journal, done)
                for epoch in done:
                    self._pending.pop(epoch, None)
            except Exception as exc:  # published again later: de-duplicated by Nats-Msg-Id
                self._error("write", f"marking deltas published failed: {exc}")

    async def _publish(self, change: Change) -> None:
        js = self.nats.js
        assert js is not None
        payload = wire.encode(change.delta().to_wire(), wire.MSGPACK)
        subjects = [config_subject(b) for b in change.bundles] + [config_all_subject()]
        for subject in dict.fromkeys(subjects):
            await js.publish(subject, payload, timeout=PUBLISH_TIMEOUT_S,
                                  headers={"Nats-Msg-Id": f"{change.epoch}-{subject}"})
            self.metrics.deltas.inc()

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(RETRY_S)
            if self.can_write and self.journal.unpublished():
                async with self._lock:
                    await self._publish_pending()
                self.update_gauges()
