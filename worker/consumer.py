"""WorkConsumer: the worker's queue mode. Pulls work items from the pool's durable JetStream
consumer and feeds them through the same InferenceService (and batcher) as the HTTP API
(``tokenize`` and ``decode`` items, the TEI routes' tokenizer calls, through TokenService).

Delivery rules (names in heron/runtime/nats_names.py; the messages, WorkItemHeaders in and
WorkResult out, in heron/runtime/protocol.py):
- ack only after the gateway confirmed the result (a request/reply on its inbox): a result
  lost in transit, e.g. while NATS restarts, means a nak and the item is computed again;
- a gateway gone (no responders on its inbox, asked for a few seconds): the item is
  terminated (never redelivered), and so are the gateway's other items as they are fetched,
  without computing them (heron.worker.gateway_inboxes); a redelivered item's inbox is asked
  first (one empty request), so an item whose gateway died is not computed twice;
- model not loaded yet, or its queue full: start the load and ``nak(delay)``;
- ``in_progress()`` every half ack-wait while an item computes and its result is delivered,
  so a live worker's items are never redelivered and a dead worker's come back within one
  ack wait;
- the last allowed delivery that still cannot run goes to the dead-letter stream and the
  caller gets an error;
- a deadline already passed: acked and answered with DEADLINE_EXCEEDED, never computed;
- headers that cannot be read (no answer can be trusted to reach anyone): dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind

from heron.runtime import telemetry
from heron.runtime.image_urls import ImageFetcher
from heron.runtime.logs import bind_request
from heron.runtime.nats_names import (
    Lane,
    WorkStreamSpec,
    dlq_subject,
    ensure_dlq_stream,
    ensure_work_stream,
    lane_consumer,
    work_stream,
)
from heron.runtime.protocol import ProtocolError, WorkItemHeaders, WorkResult
from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron.worker.gateway_inboxes import Delivery, GatewayInboxes
from heron.worker.metrics import WorkerMetrics
from heron.worker.service import InferenceService, Outcome
from heron.worker.settings import CPU_FETCH_LOOKAHEAD
from heron.worker.tokens import TOKEN_TASKS, TokenService
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import EncodeRequest, ExtractRequest, ScoreRequest

log = logging.getLogger("heron.worker.consumer")

_PARSERS = {"encode": EncodeRequest.from_wire, "score": ScoreRequest.from_wire,
            "extract": ExtractRequest.from_wire,
            # the tokenizer calls (heron.worker.tokens): no forward pass, no batching
            "tokenize": TokenizeRequest.from_wire, "decode": DecodeRequest.from_wire}
_RETRY_LATER = (ErrorCode.MODEL_LOADING, ErrorCode.QUEUE_FULL)
_RETRIED = 102  # an item nak'ed to run later (model loading, queue full): not an error yet
_TERMINATED = 499  # its gateway is gone: nobody to answer (nginx's "client closed request")
_OUTCOMES = {200: "answered", _RETRIED: "nak'ed, to run later",
             _TERMINATED: "terminated, its gateway is gone"}
BACKLOG_POLL_S = 0.005  # how often a full backlog is looked at again (forward passes start)
# The lanes a worker pulls (every one), as its heartbeats say: a gateway sends work to a
# lane only when every healthy worker of the pool pulls it (WorkerHealth.pull).
PULLED_LANES = tuple(lane.label for lane in Lane)
# Bulk lane work items a worker holds at most: the one computing and the next, already
# tokenized and queued, so the model never waits for a fetch between them.
BULK_ITEMS_HELD = 2
# A result must fit in one NATS message (max_payload, 1 MiB by default) with its subject
# and protocol line: a generous allowance for those.
RESULT_HEADROOM_BYTES = 1024


class _Hold:
    """A fetched work item's items, counted in the worker's backlog until computed (not
    while ``suspend``ed: waiting for its gateway's verdict, it blocks no fetching), and
    (``first``) among the first lane's. A bulk lane work item holds none: that lane counts
    work items (_bulk_fetch_loop)."""

    __slots__ = ("consumer", "counted", "first", "items")

    def __init__(self, consumer: WorkConsumer, items: int, first: bool) -> None:
        self.consumer, self.items, self.first, self.counted = consumer, items, first, False
        self.resume()

    def release(self) -> None:
        self.suspend()
        self.items = 0

    def suspend(self) -> None:
        if self.counted and self.items:
            self.consumer._held_items -= self.items
            if self.first:
                self.consumer._first_items_held -= self.items
            self.consumer._backlog_moved.set()
        self.counted = False

    def resume(self) -> None:
        if not self.counted and self.items:
            self.consumer._held_items += self.items
            if self.first:
                self.consumer._first_items_held += self.items
        self.counted = True


class _KeepAlive:
    """``in_progress()`` every ``every_s`` while an item computes: a timer, not a task per
    item (most items finish long before the first beat is due)."""

    __slots__ = ("_handle", "_loop", "_sending", "every_s", "msg")

    def __init__(self, msg: Msg, every_s: float) -> None:
        self.msg, self.every_s = msg, every_s
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(every_s, self._beat)
        self._sending: asyncio.Task | None = None  # held: the loop keeps only weak refs

    def _beat(self) -> None:
        self._sending = self._loop.create_task(self._send())
        self._handle = self._loop.call_later(self.every_s, self._beat)

    async def _send(self) -> None:
        with contextlib.suppress(Exception):
            await self.msg.in_progress()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class WorkConsumer:
    def __init__(self, nc: NATS, service: InferenceService, spec: WorkStreamSpec, *,
                 fetch_batch: int = 32, max_in_flight: int = 128,
                 lookahead_items: int = CPU_FETCH_LOOKAHEAD,
                 lookahead_busy_items: int | None = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.service = service
        self._tokens: TokenService | None = None  # made on the first tokenizer call
        self.spec = spec
        self.fetch_batch = fetch_batch
        self.max_in_flight = max_in_flight
        self.lookahead_items = lookahead_items
        self.lookahead_busy_items = lookahead_items if lookahead_busy_items is None \
            else lookahead_busy_items
        self._in_flight: set[asyncio.Task] = set()
        self._room = asyncio.Semaphore(max_in_flight)
        self._held_items = 0  # items fetched and not yet computed (waiting or in a forward)
        self._first_items_held = 0  # of those, the first lane's (priority 0)
        self._bulk_items_held = 0  # bulk lane work items fetched and not yet answered
        self._backlog_moved = asyncio.Event()
        self._subs: dict[Lane, Any] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()
        self.handled = 0
        self.metrics = metrics
        self.inboxes = GatewayInboxes(nc)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def backlog(self) -> int:
        """Items this worker holds that no forward pass has taken yet. (A forward pass of
        HTTP requests' items counts too: a worker serving both fetches a little more.)"""
        return max(0, self._held_items - self.service.items_in_forward())

    @property
    def first_waiting(self) -> int:
        """Items of the first lane (priority 0) held that wait for a forward pass, at most
        (which lane's items a pass holds is the batcher's business: the least of the
        first lane's held items and the backlog)."""
        return min(self._first_items_held, self.backlog)

    def can_fetch(self) -> bool:
        """Whether more work may be fetched now: False while the worker holds all it may
        (the batchers then do not wait for more: nothing comes before a batch is taken)."""
        return self.backlog < self.lookahead() and not self._room.locked()

    def room(self, lane: Lane) -> int:
        """Items the fetch loop of ``lane`` may take now. The first lane's counts only its
        own waiting items; the low lane's takes nothing while a first-lane item waits here
        for a forward pass (it is fetched only after them, as the batcher runs it after)."""
        if lane is Lane.FIRST:
            return self.lookahead(lane) - self.first_waiting
        if self.first_waiting:
            return 0
        return self.lookahead(lane) - self.backlog

    def lookahead(self, lane: Lane = Lane.FIRST) -> int:
        """Items this worker may hold beyond its forward passes now: ``lookahead_busy_items``
        while one runs, ``lookahead_items`` while the model is free and a batch forms.

        Why fewer while busy (0 on CPU): what arrives during a pass then waits in the
        stream for whichever worker is free first, instead of for this one; a worker that
        frees up fetches the lot for its next batch, and its event loop does no fetching or
        tokenizing while the model computes. Measured, MiniLM through heron up on 2 cores,
        interleaved A/B, medians: +6.5% requests/s at 32 clients and +4.6% at 64 (2
        workers x 1 thread), +6.6% at 32 with 1 worker x 2 threads, +5.6% with the null
        model; p99 unchanged within the runs' spread.

        Not while this worker holds a bulk job's work, nor, for the first lane, while it
        holds the low lane's: those passes are lower-priority work, and items of a better
        lane fetched during one are in the batcher when it ends, so the next pass is theirs
        (left in the stream, they would wait out another such pass).
        Measured (bench/priority_bench.py --cluster, 16 priority-0 and 240 priority-1
        connections): priority 0's p99 went from 0.64 of priority 1's in one lane to
        0.07 with the low lane fetched this way."""
        if self.lookahead_busy_items == self.lookahead_items or self._bulk_items_held \
                or not self.service.items_in_forward():
            return self.lookahead_items
        if lane is Lane.FIRST and self._held_items > self._first_items_held:
            return self.lookahead_items
        return self.lookahead_busy_items

    async def start(self) -> None:
        await ensure_work_stream(self.js, self.spec)
        await ensure_dlq_stream(self.js, self.spec.file_storage)
        for lane in Lane:
            self._subs[lane] = await self.js.pull_subscribe_bind(
                durable=lane_consumer(self.spec.pool, lane), stream=work_stream(self.spec.pool))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._fetch_loop(Lane.FIRST)),
                       loop.create_task(self._fetch_loop(Lane.LOW)),
                       loop.create_task(self._bulk_fetch_loop())]

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Stop fetching, finish (and ack) everything already held."""
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=timeout_s)
        for sub in self._subs.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # ---- fetching ------------------------------------------------------------------------
    async def _fetch_loop(self, lane: Lane) -> None:
        """The first or the low lane: block for one message, start it, then take what else
        is queued right now, as long as the lane has ``room``.

        A pull for N messages that finds fewer lingers on the server until N arrive or it
        expires, and nats-py holds the ones it has until then: measured, a lone request
        waited up to a second (p99 874 ms at one connection). So the blocking pull asks for
        one message, and the follow-up pulls for more wait at most a few milliseconds.

        Why the lookahead: an item a busy worker holds waits for that worker even while
        another worker of the pool is idle. Left in the stream, it goes to whichever worker
        asks first. Measured (2 workers x 1 thread, 64 clients, 8-256 tokens): holding up
        to 128 items each left 19% of the CPU idle (297 items/s); docs/benchmarks.md has
        the lookahead sweep."""
        sub = self._subs[lane]
        while not self._stopping.is_set():
            await self._wait_for_room(lane)
            await self._room.acquire()
            msgs = await self._pull(1, timeout_s=2.0, sub=sub)
            if not msgs:
                self._room.release()
                continue
            fetched, items = 1, self._dispatch(msgs[0], lane)
            while not self._stopping.is_set():
                # The room is in items, a pull in work items: as many as fit at the mean
                # size of those fetched so far. (One per item of room took up to 16 shared
                # work items at once: passes of 40-64 items, 200-250 ms, on one worker.)
                want = 0
                limit = min(self.fetch_batch, self.room(lane) * fetched // items)
                while want < limit and not self._room.locked():
                    await self._room.acquire()
                    want += 1
                if want == 0:
                    break
                msgs = await self._pull(want, timeout_s=0.005, sub=sub)
                for _ in range(want - len(msgs)):
                    self._room.release()
                for msg in msgs:
                    items += self._dispatch(msg, lane)
                fetched += len(msgs)
                if len(msgs) < want:
                    break

    async def _bulk_fetch_loop(self) -> None:
        """The bulk lane (bulk jobs' shards): one work item at a time, pulled only while no
        interactive item waits here for a forward pass, and while this worker holds fewer
        than BULK_ITEMS_HELD of them (the next one is tokenized and queued when the one
        computing ends). Interactive work that arrives meanwhile goes first in the batcher
        (it has the higher priority) and waits at most for the forward pass under way."""
        while not self._stopping.is_set():
            await self._wait_for_bulk_room()
            if self._stopping.is_set():
                return
            await self._room.acquire()
            msgs = await self._pull(1, timeout_s=1.0, sub=self._subs[Lane.BULK])
            if not msgs:
                self._room.release()
                continue
            self._dispatch(msgs[0], Lane.BULK)

    async def _wait_for_bulk_room(self) -> None:
        while (self.backlog > 0 or self._bulk_items_held >= BULK_ITEMS_HELD) \
                and not self._stopping.is_set():
            self._backlog_moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._backlog_moved.wait(), BACKLOG_POLL_S)

    async def _wait_for_room(self, lane: Lane) -> None:
        """Until ``lane`` has room. Finished items wake us at once; a forward pass that
        starts (and takes items off the backlog) is seen by polling."""
        while self.room(lane) <= 0 and not self._stopping.is_set():
            self._backlog_moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._backlog_moved.wait(), BACKLOG_POLL_S)

    async def _pull(self, n: int, timeout_s: float, sub: Any) -> list[Msg]:
        try:
            return await sub.fetch(batch=n, timeout=timeout_s)
        except (NatsTimeoutError, TimeoutError):
            return []
        except Exception as exc:  # disconnected: nats-py reconnects; try again soon
            log.warning("fetch failed: %s", exc)
            await asyncio.sleep(0.5)
            return []

    def _dispatch(self, msg: Msg, lane: Lane) -> int:
        """Start computing ``msg`` in a task of its own; its items."""
        work: Coroutine[Any, Any, None]
        bulk, first = lane is Lane.BULK, lane is Lane.FIRST
        try:
            item = WorkItemHeaders.from_wire(msg.headers)
        except ProtocolError as exc:
            count = 1
            hold = _Hold(self, 0 if bulk else 1, first)
            work = self._dead_letter_malformed(msg, exc, hold)
        else:
            count = max(1, item.count)
            hold = _Hold(self, 0 if bulk else count, first)
            work = self._handle(msg, item, hold)
        task = asyncio.get_running_loop().create_task(work)
        self._in_flight.add(task)
        task.add_done_callback(self._done)
        if bulk:
            self._bulk_items_held += 1
            task.add_done_callback(self._bulk_done)
        return count

    def _bulk_done(self, _: asyncio.Task) -> None:
        self._bulk_items_held -= 1
        self._backlog_moved.set()

    def _done(self, task: asyncio.Task) -> None:
        self._in_flight.discard(task)
        self._room.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("work item handler failed: %r", task.exception())

    # ---- one work item -----------------------------------------------------------------
    async def _handle(self, msg: Msg, item: WorkItemHeaders, hold: _Hold) -> None:
        """One work item, in a task of its own: its log lines carry the request's id (from
        the gateway's Heron-Request-Id), its spans join the gateway's trace (traceparent)."""
        received = time.monotonic()
        bind_request(item.request_id, model=item.model or None, pool=self.spec.pool)
        span = self._start_trace(msg, item) if telemetry.enabled() else None
        if self.metrics is not None and msg.metadata is not None and \
                (msg.metadata.num_delivered or 1) > 1:
            self.metrics.redeliveries.labels(self.spec.pool).inc()
        status = 500
        try:
            status = await self._handle_item(msg, item, received, hold)
        finally:
            hold.release()
            level = logging.DEBUG if status < 500 else logging.WARNING
            if log.isEnabledFor(level):
                elapsed_ms = round((time.monotonic() - received) * 1000, 2)
                log.log(level, "work item (%s, %s items from %s): %s in %.2f ms",
                        item.task or "?", item.count, item.start,
                        _OUTCOMES.get(status) or f"answered with an error ({status})",
                        elapsed_ms, extra={"status": status, "duration_ms": elapsed_ms})
            telemetry.end_span(span, attributes={"heron.status": status},
                               error=f"status {status}" if status >= 500 else None)

    def _start_trace(self, msg: Msg, item: WorkItemHeaders) -> Any:
        """The item's spans: ``queue_wait`` (stored in the stream until now: the stream's
        clock against ours) and ``process`` (current until the item is answered), both
        children of the gateway's publish span (the traceparent header)."""
        parent = telemetry.extract(msg.headers or {})
        now = time.time_ns()
        if msg.metadata is not None and msg.metadata.timestamp is not None:
            stored = int(msg.metadata.timestamp.timestamp() * 1e9)
            telemetry.record_span(telemetry.WORKER, "queue_wait", min(stored, now), now,
                                  parent=parent,
                                  attributes={"heron.deliveries": msg.metadata.num_delivered
                                              or 1})
        return telemetry.start_span(
            telemetry.WORKER, "process", kind=SpanKind.CONSUMER, parent=parent,
            attributes={"messaging.system": "nats", "messaging.destination.name": msg.subject,
                        "heron.request_id": item.request_id, "heron.task": item.task,
                        "heron.model": item.model, "heron.pool": self.spec.pool,
                        "heron.item_start": item.start, "heron.item_count": item.count})

    async def _handle_item(self, msg: Msg, item: WorkItemHeaders, received: float,
                           hold: _Hold) -> int:
        """Compute and answer one item; the HTTP-like status of what happened (200 answered,
        4xx/5xx answered with that error, _RETRIED nak'ed for later, _TERMINATED its gateway
        is gone). The item is kept in progress until it is answered: delivering a result
        may take seconds (a gateway asked again), past the ack wait (5 s) that would hand
        the item to another worker to compute again."""
        keep_alive = _KeepAlive(msg, self.spec.ack_wait_s / 2)
        try:
            return await self._handle_kept(msg, item, received, hold)
        finally:
            keep_alive.cancel()

    async def _handle_kept(self, msg: Msg, item: WorkItemHeaders, received: float,
                           hold: _Hold) -> int:
        deadline = item.deadline
        computed = False

        async def answer(*, body: dict[str, Any] | None = None,
                         error: HeronError | None = None,
                         timings: dict[str, float] | None = None) -> int:
            """Send the result, then ack (or nak, or terminate: the status for the log)."""
            with telemetry.span(telemetry.WORKER, "respond"):
                if item.reply:
                    result = WorkResult(item.request_id, item.start, item.count, body,
                                        None if error is None else error.to_body()["error"],
                                        timings)
                    data = wire.encode(result.to_wire(), wire.MSGPACK)
                    if len(data) > self.nc.max_payload - RESULT_HEADROOM_BYTES:
                        # NATS refuses it, and sending it again would fail again until the
                        # caller's deadline: answer at once with what the caller can do.
                        data = wire.encode(_too_large(item, len(data), self.nc.max_payload)
                                           .to_wire(), wire.MSGPACK)
                    delivery = await self.inboxes.deliver(item.reply, data)
                    if delivery is Delivery.GATEWAY_GONE:
                        await self._terminate(msg, item, computed=computed)
                        return _TERMINATED
                    if delivery is Delivery.UNCONFIRMED:
                        await msg.nak(delay=1.0)  # compute and send it again
                        return _RETRIED
                await msg.ack()
                self.handled += 1
                return 200 if error is None else error.status

        if item.reply:
            if self.inboxes.is_suspect(item.reply):  # a wait that holds no fetching back
                hold.suspend()
            gone = await self.inboxes.gone(item.reply)
            if not gone and msg.metadata is not None and (msg.metadata.num_delivered or 1) > 1:
                gone = not await self.inboxes.listening(item.reply)
            hold.resume()
            if gone:  # computed for nobody, so not computed
                hold.release()
                await self._terminate(msg, item, computed=False)
                return _TERMINATED
        if deadline is not None and time.time() >= deadline:
            hold.release()
            return await answer(error=HeronError(
                ErrorCode.DEADLINE_EXCEEDED, "deadline passed before a worker took the work"))
        try:
            outcome = await self._run(item, msg.data)
        except HeronError as exc:
            if exc.code in _RETRY_LATER:
                return await self._retry_later(msg, exc, answer)
            return await answer(error=exc)
        except Exception as exc:  # a bug must not lose the item: answer with an error
            log.exception("work item %s failed", item.request_id)
            await answer(error=HeronError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return 500
        finally:
            hold.release()  # computed (or failed): off the backlog before answering
        computed = True
        # "total" is the worker's whole time on the item: the gateway subtracts it from its
        # wait to tell the time queued in the stream (queue_wait).
        return await answer(body=outcome.body, timings={**outcome.timings.phases(),
                                                        "total": time.monotonic() - received})

    async def _terminate(self, msg: Msg, item: WorkItemHeaders, *, computed: bool) -> None:
        """Take an item whose gateway is gone off the stream for good (never redelivered:
        another worker would compute it for nobody too)."""
        await msg.term()
        if self.metrics is not None:
            self.metrics.terminated_items.labels(self.spec.pool, str(computed).lower()).inc(
                max(1, item.count))

    async def _run(self, item: WorkItemHeaders, data: bytes) -> Outcome:
        parse = _PARSERS.get(item.task)
        if parse is None:
            raise HeronError(ErrorCode.MALFORMED_BODY, f"unknown task {item.task!r}")
        request = parse(wire.decode(data, wire.MSGPACK))
        if isinstance(request, EncodeRequest | ScoreRequest) and ImageFetcher.pending(request):
            # A gateway fetches image URLs before it publishes; a worker fetches nothing.
            raise HeronError(ErrorCode.IMAGE_URL_REFUSED, "a work item holds an image URL; "
                             "workers fetch nothing (the gateway fetches image URLs)")
        if item.priority is not None:
            request.options.priority = item.priority
        if item.deadline is not None:  # the batcher drops it if it expires while queued
            request.options.timeout_s = max(0.001, item.deadline - time.time())
        if item.task in TOKEN_TASKS:  # tokenize | decode
            if self._tokens is None:
                self._tokens = TokenService(self.service.registry)
            return await getattr(self._tokens, item.task)(item.model, request)
        call = getattr(self.service, item.task)  # encode | score | extract, checked above
        return await call(item.model, request)

    async def _retry_later(self, msg: Msg, exc: HeronError, answer: Any) -> int:
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        if delivered >= self.spec.max_deliver:
            # Out of deliveries: keep the item for inspection and tell the caller.
            await self.js.publish(dlq_subject(self.spec.pool), msg.data, headers=msg.headers)
            if self.metrics is not None:
                self.metrics.dead_letters.labels(self.spec.pool).inc()
            await answer(error=HeronError(
                exc.code, f"{exc.message} (gave up after {delivered} deliveries)",
                retry_after_s=exc.retry_after_s))
            return exc.status
        await msg.nak(delay=exc.retry_after_s or 1.0)
        return _RETRIED

    async def _dead_letter_malformed(self, msg: Msg, exc: ProtocolError, hold: _Hold) -> None:
        """A work item whose headers cannot be read (a Heron-Item-Start or Heron-Item-Count
        that is no number, ...): it can never run and its reply cannot be trusted, so it is
        kept in the dead-letter stream for inspection and taken off the work stream."""
        try:
            log.warning("dead-lettering a work item with unreadable headers on %s: %s",
                        msg.subject, exc)
            await self.js.publish(dlq_subject(self.spec.pool), msg.data, headers=msg.headers)
            if self.metrics is not None:
                self.metrics.dead_letters.labels(self.spec.pool).inc()
            await msg.ack()
        finally:
            hold.release()


def _too_large(item: WorkItemHeaders, size: int, max_payload: int) -> WorkResult:
    """The answer for an item whose result does not fit in a NATS message: 413, saying how
    to get it (fewer items a request; the gateway cannot split an answer it has not seen)."""
    last = item.start + item.count - 1
    error = HeronError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"the answer for items {item.start}..{last} is {size} bytes, over the {max_payload}"
        " bytes a NATS message may carry here: send fewer items per request (or raise"
        " max_payload on the NATS servers)")
    return WorkResult(item.request_id, item.start, item.count, None,
                      error.to_body()["error"], None)
