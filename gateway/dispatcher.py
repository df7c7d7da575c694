"""Publish a request's work items to its pool's JetStream stream; collect their results.

One wildcard subscription on this gateway's inbox (``inbox_prefix(gateway_id).>``) takes
every result; ``on_result`` hands each to its request's Reassembly. A request is registered
before its first work item is published (a fast worker may answer before the publish ack),
and forgotten when it completes, fails or passes its deadline: late results are dropped.

Results are matched by their inbox (a key unique to this gateway), not by the request id:
the id may be the client's own X-Request-Id, which two requests may share (a client that
retries with the same id while its first try is still pending).

Phases measured here: ``publish`` (until JetStream acked every work item) and
``queue_wait`` (the rest of the wait that the worker did not account for: time in the
stream before a worker took the item, and the result's way back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import APIError
from opentelemetry.trace import SpanKind

from heron.gateway.metrics import GatewayMetrics
from heron.gateway.reassembly import Added, Reassembly
from heron.gateway.settings import GatewaySettings
from heron.gateway.slicing import Slice, encode_slices, plan_slices
from heron.runtime import telemetry
from heron.runtime.nats_link import NatsLink
from heron.runtime.nats_names import reply_subject, work_subject
from heron.runtime.protocol import ProtocolError, WorkItemHeaders, WorkResult
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.ids import new_request_id
from heron_sdk.types import Item

log = logging.getLogger("heron.gateway.dispatch")


@dataclass(slots=True)
class WorkRequest:
    """One inference request, validated and routed, ready to split and publish."""

    request_id: str  # the id its logs and the work items' Heron-Request-Id carry
    pool: str
    task: str  # encode | score | extract
    model_id: str
    wire_body: dict[str, Any]  # the sdk request's to_wire(), all items
    items: list[Item]
    timeout_s: float
    priority: int = 0
    shared_text: str = ""  # sent with every slice (the score query)
    # encode/extract: a slice that fails server-side (5xx) becomes per-item errors and the
    # rest is answered; score and OpenAI bodies have no place for per-item errors.
    partial: bool = False


@dataclass(slots=True)
class _Pending:
    reassembly: Reassembly
    pool: str
    done: asyncio.Future[None]
    items: int  # all the request's items
    answered: int = 0  # items whose slice's result arrived (no longer outstanding)
    published_at: float = 0.0  # monotonic, when publishing began
    # The last slice's (result arrival - published_at - the worker's own time); None while
    # no result has told its worker's time.
    unaccounted_s: float | None = None


class Dispatcher:
    def __init__(self, link: NatsLink, gateway_id: str, settings: GatewaySettings,
                 metrics: GatewayMetrics) -> None:
        self.link = link
        self.gateway_id = gateway_id
        self.settings = settings
        self.metrics = metrics
        self._pending: dict[str, _Pending] = {}
        # pool -> items published and not answered. Items, not work items: a work item holds
        # 1 to 64 of them, and the backlog that matters is the compute waiting.
        self._outstanding: dict[str, int] = {}

    def outstanding(self, pool: str) -> int:
        return self._outstanding.get(pool, 0)

    def nats_unavailable(self, why: str) -> HeronError:
        return HeronError(ErrorCode.NATS_UNAVAILABLE, why,
                          retry_after_s=self.settings.nats_retry_after_s)

    async def submit(self, work: WorkRequest) -> Reassembly:
        """Publish ``work`` and wait for all its results (or its first error, or its
        deadline). Raises HeronError: 503 NATS away, 429 backlog, 504 deadline, or the
        error a worker answered."""
        if not self.link.ready:
            raise self.nats_unavailable("not connected to NATS; retry shortly")
        started = time.monotonic()
        max_payload = self.link.max_payload
        slices = plan_slices(work.items, max_items=self.settings.max_items_per_work_item,
                             max_tokens=self.settings.max_tokens_per_work_item,
                             max_payload=max_payload, shared_text=work.shared_text)
        encoded = encode_slices(work.wire_body, slices, max_payload)
        self._check_backlog(work.pool, len(work.items))

        inbox_key = new_request_id()
        reply = reply_subject(self.gateway_id, inbox_key)
        deadline = time.time() + work.timeout_s
        pending = _Pending(Reassembly(work.request_id, [s for s, _ in encoded],
                                      partial=work.partial), work.pool,
                           asyncio.get_running_loop().create_future(), len(work.items))
        self._pending[inbox_key] = pending
        self._add_outstanding(work.pool, len(work.items))
        timings = pending.reassembly.gateway_timings
        try:
            pending.published_at = time.monotonic()
            with telemetry.span(telemetry.GATEWAY, "publish", kind=SpanKind.PRODUCER,
                                attributes={"messaging.system": "nats",
                                            "messaging.destination.name":
                                                work_subject(work.pool, work.model_id),
                                            "heron.work_items": len(encoded)}):
                await self._publish(work, reply, deadline, encoded, started)
            timings["publish"] = time.monotonic() - pending.published_at
            remaining = work.timeout_s - (time.monotonic() - started)
            try:
                with telemetry.span(telemetry.GATEWAY, "wait",
                                    attributes={"heron.work_items": len(encoded)}):
                    await asyncio.wait_for(pending.done, max(0.0, remaining))
            except TimeoutError:
                raise HeronError(ErrorCode.DEADLINE_EXCEEDED,
                                 f"request did not finish within timeout_s={work.timeout_s:g}"
                                 ) from None
        finally:
            self._forget(inbox_key)
        if pending.reassembly.error is not None:
            raise pending.reassembly.error
        timings["publish"], timings["queue_wait"] = split_unaccounted(
            timings["publish"], pending.unaccounted_s)
        return pending.reassembly

    def _check_backlog(self, pool: str, count: int) -> None:
        # A request bigger than the bound still goes when nothing else is waiting: it could
        # never succeed otherwise.
        outstanding = self.outstanding(pool)
        if outstanding and outstanding + count > self.settings.max_outstanding_items_per_pool:
            raise HeronError(ErrorCode.QUEUE_FULL,
                             f"pool {pool} has {outstanding} items waiting (bound "
                             f"{self.settings.max_outstanding_items_per_pool}); retry shortly",
                             retry_after_s=self.settings.queue_full_retry_after_s)

    async def _publish(self, work: WorkRequest, reply: str, deadline: float,
                       encoded: list[tuple[Slice, bytes]], started: float) -> None:
        js = self.link.js
        assert js is not None
        subject = work_subject(work.pool, work.model_id)
        timeout = max(0.05, min(self.settings.publish_timeout_s,
                                work.timeout_s - (time.monotonic() - started)))
        publishes = []
        for piece, payload in encoded:
            headers = WorkItemHeaders(work.request_id, work.task, work.model_id, reply,
                                      piece.start, piece.count, deadline,
                                      work.priority).to_wire()
            telemetry.inject(headers)  # traceparent: the worker's spans join this trace
            publishes.append(js.publish(subject, payload, timeout=timeout, headers=headers))
        if len(publishes) == 1:
            outcomes: list[Any] = [await _settle(publishes[0])]
        else:
            outcomes = await asyncio.gather(*publishes, return_exceptions=True)
        self.metrics.work_items.labels(work.pool).inc(
            sum(not isinstance(o, BaseException) for o in outcomes))
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise self._publish_error(work.pool, failures[0])

    def _publish_error(self, pool: str, exc: BaseException) -> HeronError:
        if isinstance(exc, APIError) and "maximum" in str(exc.description or "").lower():
            return HeronError(ErrorCode.QUEUE_FULL,
                              f"the work stream of pool {pool} is full: {exc.description}",
                              retry_after_s=self.settings.queue_full_retry_after_s)
        if isinstance(exc, HeronError):
            return exc
        log.warning("publishing work to pool %s failed: %r", pool, exc)
        return self.nats_unavailable(
            f"could not queue the work on NATS ({type(exc).__name__}); retry shortly")

    # ---- results ------------------------------------------------------------------------
    async def on_result(self, msg: Msg) -> None:
        """Inbox callback: one result message for one slice of one request. Every result
        is acknowledged (even a late or duplicate one): the worker acks its work item only
        after this, so a result lost in transit (NATS restarting) is computed again."""
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(b"")
        arrived = time.monotonic()
        try:
            result = WorkResult.from_wire(wire.decode(msg.data, wire.MSGPACK))
        except (HeronError, ProtocolError) as exc:
            log.warning("dropping a malformed result on %s: %s", msg.subject, exc)
            self.metrics.ignored_results.labels("malformed").inc()
            return
        pending = self._pending.get(msg.subject.rpartition(".")[2])  # the inbox key
        if pending is None:
            self.metrics.ignored_results.labels("unknown").inc()
            return
        outcome = pending.reassembly.add(result)
        if outcome in (Added.ACCEPTED, Added.COMPLETE):
            pending.answered += result.count
            self._add_outstanding(pending.pool, -result.count)
            worker_s = result.timings.get("total") if result.timings else None
            if isinstance(worker_s, int | float):  # the last slice's: see Reassembly.timings
                pending.unaccounted_s = max(0.0, arrived - pending.published_at - worker_s)
        elif outcome in (Added.DUPLICATE, Added.UNEXPECTED):
            self.metrics.ignored_results.labels(outcome.value).inc()
        if pending.reassembly.done and not pending.done.done():
            pending.done.set_result(None)

    def _forget(self, inbox_key: str) -> None:
        pending = self._pending.pop(inbox_key, None)
        if pending is not None:
            # Slices still unanswered stop counting: workers drop them past the deadline.
            self._add_outstanding(pending.pool, pending.answered - pending.items)

    def _add_outstanding(self, pool: str, delta: int) -> None:
        value = max(0, self._outstanding.get(pool, 0) + delta)
        self._outstanding[pool] = value
        self.metrics.outstanding.labels(pool).set(value)

    def pending_requests(self) -> int:
        return len(self._pending)


def split_unaccounted(publish_s: float, unaccounted_s: float | None) -> tuple[float, float]:
    """(publish, queue_wait) out of the time the last slice spent outside a worker (None:
    unknown, no worker told its time).

    A worker can answer before JetStream's ack reaches the gateway (the ack and the work
    race on a busy host): the ack's wait then overlaps the worker's time, and ``publish``
    is capped so the phases still follow one another inside the request's total."""
    if unaccounted_s is None:
        return publish_s, 0.0
    publish_s = min(publish_s, max(0.0, unaccounted_s))
    return publish_s, max(0.0, unaccounted_s - publish_s)


async def _settle(coro: Any) -> Any:
    """Await one publish, returning its exception instead of raising (as gather does)."""
    try:
        return await coro
    except Exception as exc:  # every failure becomes a 503/429 in _publish_error
        return exc
