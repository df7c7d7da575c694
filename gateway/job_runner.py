"""Every gateway's job loop: it takes bulk jobs nobody runs and runs them, shard by shard.

The loop keeps a mirror of the ``heron_jobs`` bucket (gateway/job_store.py: a watcher, so
no reads of the whole bucket) and looks at it every second, and at once when a record
arrives. A job that is not finished and whose lease has
lapsed (new, or its gateway died) is claimed with a compare-and-set write; the claimer then:

1. indexes the input (heron/runtime/job_input.py: one pass that keeps where each shard's
   rows begin, not the rows) and lists the part files already written: those shards are
   done, by an earlier run, and are neither read nor computed again;
2. reads each missing shard's rows when it computes that shard, and encodes them through
   the gateway's own dispatch path (``encode_rows``: the work items of an encode request,
   at ``job_priority``, below interactive requests, which workers take first), at most
   ``job_shards_in_flight`` shards at a time over all of this gateway's jobs, so a job
   uses capacity that is idle and never much of a pool's backlog. A job holds the rows of
   at most twice that many shards (those in flight, those read and waiting for a slot):
   its memory is bounded by its shards in flight, whatever its input's size;
3. writes each finished shard as one part file (atomically) and counts it;
4. renews its lease every third of ``job_lease_s`` with the counters; a renewal that finds
   the job cancelled, or owned by another gateway, stops the run (a run that cannot renew
   stops when its lease runs out: another gateway may have it by then);
5. joins the parts into the output in input order, records success, deletes the parts.

A row the model refuses (an empty text, too long with ``truncate: false``) is a failed row
with its error; a shard whose rows failed server-side (a worker died with it past its
deliveries) is computed again, ``job_shard_attempts`` times. Backpressure (429, 503, 504,
no worker yet) is waited out, however long; an error of the job itself (a bad option, the
model gone) fails the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from heron.gateway.job_store import JobMirror, JobRecord, JobStore, StaleRecord
from heron.gateway.reassembly import ITEM_INDEX
from heron.runtime.backend import Provisioning
from heron.runtime.job_files import (
    PartStore,
    PathPolicy,
    Rows,
    ShardPlan,
    done_shards,
    encode_part,
    part_name,
    parts_of,
)
from heron.runtime.job_input import ShardedInput, open_input
from heron.runtime.job_output import Columns, write_output
from heron_sdk.errors import STATUS_BY_CODE, ErrorCode, HeronError
from heron_sdk.jobs import JobSpec
from heron_sdk.types import EncodeRequest

if TYPE_CHECKING:
    from heron.gateway.routes import GatewayApp

log = logging.getLogger("heron.gateway.jobs")

POLL_S = 1.0
RELEASE_TIMEOUT_S = 1.0
BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
RETRYABLE = frozenset({429, 503, 504})  # backpressure and capacity; waited out


class LeaseLost(Exception):
    """The job was cancelled, or another gateway holds it now: this run stops."""


class JobLoop:
    """The loop and the runs of one gateway."""

    def __init__(self, gateway: GatewayApp, policy: PathPolicy) -> None:
        self.gateway = gateway
        self.settings = gateway.settings
        self.policy = policy
        self.runs: dict[str, asyncio.Task[None]] = {}
        self._running: dict[str, JobRun] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._shards: asyncio.Semaphore | None = None
        self._store: JobStore | None = None
        self.mirror = JobMirror(on_change=self.wake)  # every record, watched

    def store(self) -> JobStore:
        js = self.gateway.link.js
        assert js is not None
        if self._store is None or self._store.js is not js:
            self._store = JobStore(js)
        return self._store

    def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._shards = asyncio.Semaphore(self.settings.job_shards_in_flight)
            self._task = asyncio.get_running_loop().create_task(self._forever())

    async def watch(self) -> None:
        """Watch the bucket (again, after a reconnect)."""
        await self.mirror.start(self.store())

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def stop(self) -> None:
        """Stop looking and running, and give the jobs up: another gateway (or this one,
        restarted) takes them at once, not when their leases would have lapsed."""
        runs = list(self._running.values())
        tasks = [t for t in (self._task, *self.runs.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._task = None
        await self.mirror.stop()
        for run in runs:  # best effort: NATS may be away, and then the leases lapse
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run.release(), RELEASE_TIMEOUT_S)

    async def _forever(self) -> None:
        assert self._wake is not None
        while True:
            try:
                if self.gateway.link.ready:
                    await self._claim_some()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away, a timeout: look again next time
                log.warning("looking for jobs failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()

    async def _claim_some(self) -> None:
        if not self.mirror.synced:
            return
        store = self.store()
        now = time.time()
        waiting = sorted((r for r in self.mirror.records.values() if not r[0].finished),
                         key=lambda r: r[0].created_at)
        for known, revision in waiting:
            if len(self.runs) >= self.settings.max_running_jobs:
                return
            if known.id in self.runs or known.leased(now) or not self._can_run(known):
                continue
            record = JobRecord.from_kv(known.to_kv())  # the mirror's stays as it was
            record.owner = self.gateway.gateway_id
            record.lease_until = time.time() + self.settings.job_lease_s
            record.state, record.runs = "running", record.runs + 1
            record.started_at = record.started_at or time.time()
            try:
                revision = await store.write(record, revision)
            except StaleRecord:
                continue  # another gateway claimed it (or it was cancelled) meanwhile
            self.mirror.note(JobRecord.from_kv(record.to_kv()), revision)
            log.info("running job %s (run %d)", record.id, record.runs)
            run = JobRun(self, record, revision)
            task = asyncio.get_running_loop().create_task(run.run())
            self.runs[record.id], self._running[record.id] = task, run
            task.add_done_callback(lambda _, job_id=record.id: self._ended(job_id))

    def _ended(self, job_id: str) -> None:
        self.runs.pop(job_id, None)
        self._running.pop(job_id, None)


    def _can_run(self, record: JobRecord) -> bool:
        """Whether this gateway routes the job's model and may use its paths: a gateway
        of another configuration leaves the job to the gateways that can run it."""
        try:
            spec = JobSpec.from_wire(record.spec)
            self.gateway.registry.resolve(spec.model)
            self.policy.check(spec.input.uri, "input.uri")
            self.policy.check(spec.output.uri, "output.uri")
        except HeronError:
            return False
        return True


class JobRun:
    """One gateway's run of one job, from its claim to the end (or its lease's)."""

    def __init__(self, loop: JobLoop, record: JobRecord, revision: int) -> None:
        self.loop = loop
        self.gateway = loop.gateway
        self.settings = loop.settings
        self.record = record
        self.revision = revision
        self.spec = JobSpec.from_wire(record.spec)
        self.done: dict[int, int] = {}  # shard -> failed rows, finished ones
        self.plan: ShardPlan | None = None
        self.stopped: str | None = None  # why the renewals stopped this run
        self._started = time.monotonic()
        self._rows_at_start = 0
        self._renew: asyncio.Task[None] | None = None

    async def run(self) -> None:
        main = asyncio.current_task()
        assert main is not None
        renew = self._renew = asyncio.get_running_loop().create_task(
            self._renew_forever(main))
        try:
            await self._run()
        except asyncio.CancelledError:
            if self.stopped is None:
                raise  # the gateway is stopping: the lease lapses, another takes over
            log.info("job %s: run stopped (%s)", self.record.id, self.stopped)
            if self.stopped == "cancelled":  # its parts go: nobody will join them
                with contextlib.suppress(Exception):
                    output = self.loop.policy.check(self.spec.output.uri, "output.uri")
                    await asyncio.to_thread(parts_of(output, self.record.id).clear)
        except LeaseLost as exc:
            log.info("job %s: run stopped (%s)", self.record.id, exc)
        except HeronError as exc:
            log.warning("job %s failed: %s", self.record.id, exc)
            await self._finish("failed", exc.to_body()["error"])
        except Exception as exc:
            log.exception("job %s failed", self.record.id)
            await self._finish("failed", {"code": ErrorCode.INTERNAL.value,
                                          "message": f"the job failed: {exc!r}"})
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await renew

    async def _run(self) -> None:
        spec, policy = self.spec, self.loop.policy
        source = policy.check(spec.input.uri, "input.uri")  # this gateway's own policy
        output = policy.check(spec.output.uri, "output.uri")
        sharded = await asyncio.to_thread(open_input, source, spec.input.format,
                                          spec.input.text_field, spec.input.id_field,
                                          self.record.shard_rows)
        try:
            plan = self.plan = sharded.plan
            parts = parts_of(output, self.record.id)
            self.done = {i: f for i, f in
                         done_shards(await asyncio.to_thread(parts.names)).items()
                         if i < plan.count}
            self._rows_at_start = plan.rows_of(self.done)
            self._started = time.monotonic()
            self._count()
            await self._compute(plan.missing(self.done), sharded, parts)
        finally:
            await asyncio.to_thread(sharded.close)
        request = spec.encode_request([])
        await asyncio.to_thread(write_output, output, spec.output.format, parts, plan,
                                self.done, Columns.of(request), request.output_dtype)
        if await self._finish("succeeded", None):
            await asyncio.to_thread(parts.clear)

    async def _compute(self, missing: list[int], sharded: ShardedInput,
                       parts: PartStore) -> None:
        """Every missing shard, its rows read when it is computed: ``2 *
        job_shards_in_flight`` workers take the shards in order, so at most that many of
        this job's shards hold their rows at once (a Parquet input's reads one at a time,
        in shard order: its cursor moves forward). The first to fail stops the others."""
        todo = iter(missing)
        reading: contextlib.AbstractAsyncContextManager[Any] = \
            asyncio.Lock() if sharded.ordered else contextlib.nullcontext()

        async def worker() -> None:
            for index in todo:  # shared: each shard is taken by one worker
                async with reading:
                    rows = await asyncio.to_thread(sharded.read, index)
                await self._shard(index, rows, parts)
                del rows

        workers = min(len(missing), 2 * self.settings.job_shards_in_flight)
        await _all_or_none([worker() for _ in range(workers)])

    # ---- one shard -------------------------------------------------------------------------
    async def _shard(self, index: int, rows: Rows, parts: PartStore) -> None:
        """Encode shard ``index``, whose rows (``rows.first`` its first) were read, and
        write its part."""
        assert self.plan is not None and self.loop._shards is not None
        start, end = self.plan.bounds(index)
        assert rows.first == start and len(rows.ids) == end - start, (index, rows.first)
        out: list[dict[str, Any] | None] = [
            {"error": rows.errors[k]} if rows.texts[k] is None else None
            for k in range(end - start)]
        server_failures = 0
        waits = 0
        columns = Columns.of(self.spec.encode_request([]))
        while True:
            pending = [k for k, row in enumerate(out) if row is None]
            if not pending:
                break
            try:
                request = EncodeRequest.from_wire({  # an item's own 422 fails its row
                    **self.spec.options, "items": [rows.texts[k] for k in pending]})
                request.options.priority = self.settings.job_priority
                request.options.timeout_s = self.settings.job_shard_timeout_s
                async with self.loop._shards:
                    body = await self.gateway.encode_rows(self.spec.model, request)
            except Provisioning as exc:
                await asyncio.sleep(exc.retry_after_s)
                continue
            except HeronError as exc:
                at = ITEM_INDEX.match(exc.field or "")
                if at is not None and exc.status < 500:  # that row's own fault
                    out[pending[int(at.group(1))]] = {"error": exc.to_body()["error"]}
                    continue
                if exc.status not in RETRYABLE:
                    raise
                waits += 1
                await asyncio.sleep(_backoff(waits, exc.retry_after_s))
                continue
            answered = body["items"]
            if any(_server_error(row) for row in answered) and \
                    server_failures < self.settings.job_shard_attempts - 1:
                server_failures += 1
                await asyncio.sleep(_backoff(server_failures, None))
                continue
            for k, row in zip(pending, answered, strict=True):
                out[k] = columns.kept(row)
        failed = sum("error" in row for row in out if row is not None)
        data = encode_part(rows.ids, [row or {} for row in out])
        await asyncio.to_thread(parts.put, part_name(index, failed), data)
        self.done[index] = failed
        self._count()

    # ---- the record ------------------------------------------------------------------------
    def _count(self) -> None:
        record, plan = self.record, self.plan
        if plan is None:
            return
        record.rows_total, record.shards_total = plan.rows, plan.count
        record.rows_done, record.shards_done = plan.rows_of(self.done), len(self.done)
        record.rows_failed = sum(self.done.values())
        elapsed = time.monotonic() - self._started
        computed = record.rows_done - self._rows_at_start
        if computed > 0 and elapsed > 0:
            record.rows_per_s = round(computed / elapsed, 1)
            record.eta_s = round((plan.rows - record.rows_done) / record.rows_per_s, 1)

    async def _write(self, renew: bool = True) -> None:
        """The record as this run sees it, with its lease renewed; LeaseLost when the job
        was cancelled or another gateway has it."""
        store = self.loop.store()
        if renew:
            self.record.lease_until = time.time() + self.settings.job_lease_s
        try:
            self.revision = await store.write(self.record, self.revision)
            return
        except StaleRecord:
            pass
        current, revision = await store.read(self.record.id)
        if current.state == "cancelled":
            raise LeaseLost("cancelled")
        if current.owner != self.gateway.gateway_id or current.finished:
            raise LeaseLost(f"now run by {current.owner}")
        self.revision = revision  # our own earlier write raced this one: write again
        self.revision = await store.write(self.record, self.revision)

    async def _renew_forever(self, main: asyncio.Task[Any]) -> None:
        every = self.settings.job_lease_s / 3
        while True:
            await asyncio.sleep(every)
            try:
                await self._write()
            except LeaseLost as exc:
                self.stopped = str(exc)
                main.cancel()
                return
            except Exception as exc:  # NATS away: keep going while the lease lasts
                if time.time() >= self.record.lease_until - every:
                    self.stopped = f"could not renew the lease: {exc!r}"
                    main.cancel()
                    return
                log.warning("job %s: renewing its lease failed: %r", self.record.id, exc)

    async def release(self) -> None:
        """Give the job up (this gateway is stopping): still running, owned by nobody."""
        if self.record.finished or self.stopped is not None:
            return
        self.record.owner, self.record.lease_until = None, 0.0
        await self._write(renew=False)
        log.info("job %s given up for another gateway to take", self.record.id)

    async def _finish(self, state: str, error: dict[str, Any] | None) -> bool:
        """Record the job's end (unless it was cancelled or taken meanwhile)."""
        renew = self._renew
        if renew is not None and renew is not asyncio.current_task():
            renew.cancel()  # no renewal may race the last write
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await renew
        self._count()
        record = self.record
        record.state, record.error, record.finished_at = state, error, time.time()
        record.eta_s = 0.0 if state == "succeeded" else None
        record.owner, record.lease_until = None, 0.0
        for attempt in range(len(BACKOFF_S)):
            try:
                await self._write(renew=False)
                log.info("job %s %s: %s of %s rows, %s failed", record.id, state,
                         record.rows_done, record.rows_total, record.rows_failed)
                return True
            except LeaseLost:
                return False
            except Exception as exc:  # NATS away: the next owner finishes it otherwise
                log.warning("job %s: recording %s failed: %r", record.id, state, exc)
                await asyncio.sleep(BACKOFF_S[attempt])
        return False


async def _all_or_none(coros: list[Any]) -> None:
    """Run them all; the first to fail cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION) \
            if tasks else (set(), set())
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _backoff(attempt: int, retry_after_s: float | None) -> float:
    wait = BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)]
    return max(wait, retry_after_s or 0.0) * (0.75 + random.random() / 2)


def _server_error(row: Any) -> bool:
    error = row.get("error") if isinstance(row, dict) else None
    return isinstance(error, dict) and STATUS_BY_CODE.get(error.get("code"), 500) >= 500  # type: ignore[call-overload]

