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
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind

from heron.runtime import telemetry
from heron.runtime.image_urls import ImageFetcher
from heron.runtime.logs import bind_request
from heron.runtime.nats_names import (
    WorkStreamSpec,
    dlq_subject,
    ensure_dlq_stream,
    ensure_work_stream,
)
from heron.runtime.protocol import ProtocolError, WorkItemHeaders, WorkResult
from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron.worker.fetching import Hold, LaneFetcher
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
# A result must fit in one NATS message (max_payload, 1 MiB by default) with its subject
# and protocol line: a generous allowance for those.
RESULT_HEADROOM_BYTES = 1024


class ItemKeepAlive:
    """``in_progress()`` every ``every_s`` while an item computes: a timer, not a task per
    item (most items finish long before the first beat is due).

    The first beat comes ``every_s`` after the item was stored in the stream if that is
    sooner than ``every_s`` from now. The ack wait runs from the delivery, and a delivery
    can reach this worker late: a short follow-up pull answered after it expired leaves
    its message in nats-py's queue until the next pull, after a forward pass (up to 631 ms
    measured on MiniLM; seconds on a loaded host). An item that sat there over 2.5 s of
    a 5 s ack wait was handed out again before its first beat (what a CI run of
    test_gateway_gone showed: one 64-item work item delivered twice). The stream's store
    time is never later than the delivery, so the beat is never later than ``every_s``
    after either; an item that waited in the stream longer than ``every_s`` beats as it
    starts (one more message)."""

    __slots__ = ("_handle", "_loop", "_sending", "every_s", "msg")

    def __init__(self, msg: Msg, every_s: float) -> None:
        self.msg, self.every_s = msg, every_s
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(
            first_beat_s(msg, every_s), self._beat)
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


def first_beat_s(msg: Msg, every_s: float, now: float | None = None) -> float:
    """Seconds until an item's first ``in_progress()``: ``every_s`` after its store time
    (``now``: unix seconds, the clock by default), never more than ``every_s`` (a clock
    behind the server's) nor less than 0. A message without JetStream metadata gets
    ``every_s``."""
    try:
        stored = msg.metadata.timestamp
    except NotJSMessageError:  # a plain message (no JetStream ack subject)
        return every_s
    if stored is None:
        return every_s
    age = (time.time() if now is None else now) - stored.timestamp()
    return min(every_s, max(0.0, every_s - age))


class WorkConsumer(LaneFetcher):
    def __init__(self, nc: NATS, service: InferenceService, spec: WorkStreamSpec, *,
                 fetch_batch: int = 32, max_in_flight: int = 128,
                 lookahead_items: int = CPU_FETCH_LOOKAHEAD,
                 lookahead_busy_items: int | None = None,
                 metrics: WorkerMetrics | None = None) -> None:
        super().__init__(service, fetch_batch=fetch_batch, max_in_flight=max_in_flight,
                         lookahead_items=lookahead_items,
                         lookahead_busy_items=lookahead_busy_items)
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self._tokens: TokenService | None = None  # made on the first tokenizer call
        self.spec = spec
        self.handled = 0
        self.metrics = metrics
        self.inboxes = GatewayInboxes(nc)

    async def start(self) -> None:
        await ensure_work_stream(self.js, self.spec)
        await ensure_dlq_stream(self.js, self.spec.file_storage)
        await self._start_fetching(self.js, self.spec.pool)

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Stop fetching, finish (and ack) everything already held."""
        await self._stop_fetching(timeout_s)


    def _start(self, msg: Msg, hold: Callable[[int], Hold]
               ) -> tuple[int, Coroutine[Any, Any, None]]:
        try:
            item = WorkItemHeaders.from_wire(msg.headers)
        except ProtocolError as exc:
            return 1, self._dead_letter_malformed(msg, exc, hold(1))
        count = max(1, item.count)
        return count, self._handle(msg, item, hold(count))

    # ---- one work item -----------------------------------------------------------------
    async def _handle(self, msg: Msg, item: WorkItemHeaders, hold: Hold) -> None:
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
                           hold: Hold) -> int:
        """Compute and answer one item; the HTTP-like status of what happened (200 answered,
        4xx/5xx answered with that error, _RETRIED nak'ed for later, _TERMINATED its gateway
        is gone). The item is kept in progress until it is answered: delivering a result
        may take seconds (a gateway asked again), past the ack wait (5 s) that would hand
        the item to another worker to compute again."""
        keep_alive = ItemKeepAlive(msg, self.spec.ack_wait_s / 2)
        try:
            return await self._handle_kept(msg, item, received, hold)
        finally:
            keep_alive.cancel()

    async def _handle_kept(self, msg: Msg, item: WorkItemHeaders, received: float,
                           hold: Hold) -> int:
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

    async def _dead_letter_malformed(self, msg: Msg, exc: ProtocolError, hold: Hold) -> None:
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
