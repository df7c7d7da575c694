"""Bulk jobs' records in the ``heron_jobs`` NATS KV bucket: one key per job, shared by every
gateway, so none holds a job of its own and any can answer for it or take it over.

A record holds the job's spec, state, counters and a lease (``owner``, ``lease_until``):
the gateway running a job renews its lease every few seconds together with the counters;
a job whose lease has lapsed (its gateway died) is claimed by any gateway's job loop
(gateway/job_runner.py). Every write is compare-and-set on the key's revision, so two
gateways never both claim one job, and a cancel is never lost under a progress write.
The bucket is on file storage: the records outlive a NATS restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from heron.runtime.nats_names import stream_replicas
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.jobs import FINISHED
from heron_sdk.types import shown

log = logging.getLogger("heron.gateway.jobs")

JOBS_BUCKET = "heron_jobs"
_CAS_ATTEMPTS = 5
LIST_TIMEOUT_S = 5.0
# A record's last write is kept this long: a running job's is a few seconds old at most
# (its lease renewals), so only finished jobs expire, a week after their end.
JOBS_KEPT_S = 7 * 24 * 3600.0


JOB_ID = re.compile(r"job_[0-9a-f]{20}")


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex[:20]}"


def job_not_found(job_id: str) -> HeronError:
    return HeronError(ErrorCode.JOB_NOT_FOUND, f"no job {shown(job_id)}; GET /v1/jobs lists them")


@dataclass(slots=True)
class JobRecord:
    id: str
    spec: dict[str, Any]  # heron_sdk.jobs.JobSpec.to_wire()
    shard_rows: int  # fixed when the job is created: part files are numbered by it
    state: str = "queued"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    rows_total: int | None = None  # known once the input has been read
    rows_done: int = 0  # rows in finished shards, failed ones included
    rows_failed: int = 0
    shards_total: int | None = None
    shards_done: int = 0
    rows_per_s: float | None = None
    eta_s: float | None = None
    owner: str | None = None  # the gateway running it
    lease_until: float = 0.0  # unix seconds; past it, any gateway may take the job over
    runs: int = 0  # how many times a gateway has taken it
    error: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def leased(self, now: float | None = None) -> bool:
        return self.owner is not None and (time.time() if now is None else now) < \
            self.lease_until

    def to_kv(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_kv(cls, data: bytes) -> JobRecord:
        raw = orjson.loads(data)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def view(self) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{id}`` shows it."""
        spec = self.spec
        out = {"id": self.id, "object": "job", "model": spec.get("model"),
               "task": spec.get("task", "encode"), "state": self.state,
               "rows_total": self.rows_total, "rows_done": self.rows_done,
               "rows_failed": self.rows_failed, "shards_total": self.shards_total,
               "shards_done": self.shards_done, "rows_per_s": self.rows_per_s,
               "eta_s": self.eta_s, "input": spec.get("input"), "output": spec.get("output"),
               "output_uri": (spec.get("output") or {}).get("uri"),
               "created_at": self.created_at, "started_at": self.started_at,
               "finished_at": self.finished_at, "updated_at": self.updated_at,
               "runs": self.runs, "error": self.error}
        return out


class StaleRecord(Exception):
    """The record changed since it was read (another gateway's write)."""


async def ensure_jobs_bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(JOBS_BUCKET)
    except BucketNotFoundError:
        # Two gateways may both get here: the server accepts an identical stream twice.
        return await js.create_key_value(KeyValueConfig(
            bucket=JOBS_BUCKET, history=1, storage=StorageType.FILE,
            replicas=stream_replicas(), ttl=JOBS_KEPT_S,
            description="Heron bulk jobs: key = job id"))


class JobStore:
    """Reads and compare-and-set writes of job records."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: KeyValue | None = None

    async def kv(self) -> KeyValue:
        if self._kv is None:
            self._kv = await ensure_jobs_bucket(self.js)
        return self._kv

    async def create(self, record: JobRecord) -> int:
        return await (await self.kv()).create(record.id, record.to_kv())

    async def read(self, job_id: str) -> tuple[JobRecord, int]:
        """The record and its revision; 404 JOB_NOT_FOUND when there is none."""
        if not JOB_ID.fullmatch(job_id):  # not one of ours (nor a valid key): no job
            raise job_not_found(job_id)
        try:
            entry = await (await self.kv()).get(job_id)
        except KeyNotFoundError:  # KeyDeletedError too
            raise job_not_found(job_id) from None
        if not entry.value:
            raise job_not_found(job_id)
        return JobRecord.from_kv(entry.value), entry.revision or 0

    async def write(self, record: JobRecord, revision: int) -> int:
        """Write over exactly ``revision``; StaleRecord when the key moved on."""
        record.updated_at = time.time()
        try:
            return await (await self.kv()).update(record.id, record.to_kv(), last=revision)
        except KeyWrongLastSequenceError:
            raise StaleRecord(record.id) from None

    async def change(self, job_id: str, edit: Callable[[JobRecord], bool]
                     ) -> tuple[JobRecord, int]:
        """Read, ``edit`` in place (False: nothing to write), write; again on a race."""
        for _ in range(_CAS_ATTEMPTS):
            record, revision = await self.read(job_id)
            if not edit(record):
                return record, revision
            try:
                return record, await self.write(record, revision)
            except StaleRecord:
                await asyncio.sleep(0.05)
        raise HeronError(ErrorCode.NATS_UNAVAILABLE, f"job {job_id} is being changed "
                         "concurrently; try again", retry_after_s=1.0)

    async def all(self) -> list[tuple[JobRecord, int]]:
        """Every job with its revision (a watcher's snapshot of the bucket)."""
        kv = await self.kv()
        watcher = await kv.watchall(ignore_deletes=True)
        out = []
        try:
            while True:
                entry = await watcher.updates(timeout=LIST_TIMEOUT_S)
                if entry is None:
                    break
                if entry.value and entry.operation is None:
                    with contextlib.suppress(ValueError, TypeError):
                        out.append((JobRecord.from_kv(entry.value), entry.revision or 0))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.stop(), 2.0)
        return out


class JobMirror:
    """Every job record and its revision, kept from a watcher on the bucket: the job loop
    looks here every second instead of reading the whole bucket. ``on_change`` is called
    when a record arrives (a new job, a lease given up)."""

    def __init__(self, on_change: Callable[[], None] | None = None, retry_s: float = 1.0
                 ) -> None:
        self.records: dict[str, tuple[JobRecord, int]] = {}
        self.synced = False  # the watcher delivered the bucket's state at least once
        self.on_change = on_change
        self.retry_s = retry_s
        self._task: asyncio.Task[None] | None = None

    async def start(self, store: JobStore) -> None:
        """Watch (afresh after a reconnect: the old watcher's consumer may be gone)."""
        await self.stop()
        self._task = asyncio.get_running_loop().create_task(self._watch_forever(store))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def note(self, record: JobRecord, revision: int) -> None:
        """A write of this process's own, before the watcher says so."""
        known = self.records.get(record.id)
        if known is None or known[1] < revision:
            self.records[record.id] = (record, revision)

    async def _watch_forever(self, store: JobStore) -> None:
        while True:
            try:
                await self._watch(await store.kv())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away: watch again shortly
                log.warning("watching the %s bucket failed (%r); retrying in %.0fs",
                            JOBS_BUCKET, exc, self.retry_s)
            await asyncio.sleep(self.retry_s)

    async def _watch(self, kv: KeyValue) -> None:
        watcher = await kv.watchall()
        # Until the first None, entries are the bucket's state: swapped in at once.
        snapshot: dict[str, tuple[JobRecord, int]] | None = {}
        try:
            async for entry in watcher:
                if entry is None:
                    if snapshot is not None:
                        self.records, snapshot, self.synced = snapshot, None, True
                        self._changed()
                    continue
                records = self.records if snapshot is None else snapshot
                if entry.operation is not None or not entry.value:  # deleted, purged
                    records.pop(entry.key, None)
                    continue
                try:
                    record = JobRecord.from_kv(entry.value)
                except (ValueError, TypeError):
                    log.warning("ignoring an unreadable job record under %s", entry.key)
                    continue
                known = records.get(entry.key)
                if known is None or known[1] < (entry.revision or 0):
                    records[entry.key] = (record, entry.revision or 0)
                if snapshot is None:
                    self._changed()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.stop(), 2.0)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
