"""Publish a request's work items to its pool's JetStream stream; collect their results.

One wildcard subscription on this gateway's inbox (``inbox_prefix(gateway_id).>``) takes
every result; ``on_result`` hands each to its request's Reassembly. A request is registered
before its first work item is published (a fast worker may answer before the publish ack),
and forgotten when it completes, fails or passes its deadline: late results are dropped.

Results are matched by their inbox (a key unique to this gateway), not by the request id:
the id may be the client's own X-Request-Id, which two requests may share (a client that
retries with the same id while its first try is still pending).

Admission (gateway/admission.py): before anything is published, the request must be able to
finish within what is left of its deadline (counted from when the gateway received it) at
the rate the pool has been answering this gateway; else 429 QUEUE_FULL with the Retry-After
the backlog implies.

A publish that fails for want of a JetStream leader (an election after a node loss: no
responders, timeouts) is retried with a backoff within the request's deadline and
``publish_retry_max_s``: a node loss is latency, not errors. A retried publish may have
been stored the first time: the slice is then computed twice and the second result is
dropped as a duplicate (Reassembly), which is cheaper than deduplicating every publish.

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

from heron.gateway.admission import PoolLoad
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

# Between tries of a publish that failed: a JetStream stream leader election on loopback
# takes about 5 s (docs/benchmarks.md), so the tries go on for seconds, sparsely.
PUBLISH_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)
NATS_WAIT_POLL_S = 0.05  # how often a request waiting for NATS to come back looks


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
    received_at: float  # time.monotonic() when the gateway received it: the deadline's start
    priority: int = 0
    workers: int = 1  # healthy workers of the pool now (admission's rate before one is known)
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
    slices: int  # its work items
    answered: int = 0  # items whose slice's result arrived (no longer outstanding)
    answered_slices: int = 0
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
        # pool -> its backlog (items and work items published, not answered) and drain rate
        self._loads: dict[str, PoolLoad] = {}

    def load(self, pool: str) -> PoolLoad:
        load = self._loads.get(pool)
        if load is None:
            load = self._loads[pool] = PoolLoad(self.settings.admission_min_samples)
        return load

    def outstanding(self, pool: str) -> int:
        load = self._loads.get(pool)
        return load.items if load is not None else 0

    def nats_unavailable(self, why: str) -> HeronError:
        return HeronError(ErrorCode.NATS_UNAVAILABLE, why,
                          retry_after_s=self.settings.nats_retry_after_s)

    async def submit(self, work: WorkRequest) -> Reassembly:
        """Publish ``work`` and wait for all its results (or its first error, or its
        deadline). Raises HeronError: 503 NATS away, 429 backlog, 504 deadline, or the
        error a worker answered."""
        await self.ensure_nats(work.timeout_s, work.received_at)
        max_payload = self.link.max_payload
        slices = plan_slices(work.items, max_items=self.settings.max_items_per_work_item,
                             max_tokens=self.settings.max_tokens_per_work_item,
                             max_payload=max_payload, shared_text=work.shared_text)
        encoded = encode_slices(work.wire_body, slices, max_payload)
        remaining = self._remaining(work)
        self._admit(work, len(encoded), remaining)

        inbox_key = new_request_id()
        reply = reply_subject(self.gateway_id, inbox_key)
        deadline = time.time() + remaining  # wall clock: workers compare it with theirs
        pending = _Pending(Reassembly(work.request_id, [s for s, _ in encoded],
                                      partial=work.partial), work.pool,
                           asyncio.get_running_loop().create_future(), len(work.items),
                           len(encoded))
        self._pending[inbox_key] = pending
        self._add_outstanding(work.pool, len(work.items), len(encoded))
        timings = pending.reassembly.gateway_timings
        try:
            pending.published_at = time.monotonic()
            with telemetry.span(telemetry.GATEWAY, "publish", kind=SpanKind.PRODUCER,
                                attributes={"messaging.system": "nats",
                                            "messaging.destination.name":
                                                work_subject(work.pool, work.model_id),
                                            "heron.work_items": len(encoded)}):
                await self._publish(work, reply, deadline, encoded)
            timings["publish"] = time.monotonic() - pending.published_at
            try:
                with telemetry.span(telemetry.GATEWAY, "wait",
                                    attributes={"heron.work_items": len(encoded)}):
                    await asyncio.wait_for(pending.done, max(0.0, self._remaining(work)))
            except TimeoutError:
                raise self._deadline_error(work) from None
        finally:
            self._forget(inbox_key)
        if pending.reassembly.error is not None:
            raise pending.reassembly.error
        timings["publish"], timings["queue_wait"] = split_unaccounted(
            timings["publish"], pending.unaccounted_s)
        return pending.reassembly

    @staticmethod
    def _remaining(work: WorkRequest) -> float:
        """Seconds left of the request's deadline; 504 when none are."""
        remaining = work.timeout_s - (time.monotonic() - work.received_at)
        if remaining <= 0:
            raise Dispatcher._deadline_error(work)
        return remaining

    @staticmethod
    def _deadline_error(work: WorkRequest) -> HeronError:
        return HeronError(ErrorCode.DEADLINE_EXCEEDED,
                          f"request did not finish within timeout_s={work.timeout_s:g}")

    async def ensure_nats(self, timeout_s: float, received_at: float) -> None:
        """NATS is away: a gateway that was connected waits for the client's reconnect (to
        any node of the cluster) within the request's deadline and ``nats_reconnect_wait_s``;
        one that never connected answers 503 at once."""
        if self.link.ready:
            return
        if self.link.set_up:
            left = timeout_s - (time.monotonic() - received_at)
            waited_until = time.monotonic() + min(left, self.settings.nats_reconnect_wait_s)
            while not self.link.ready and time.monotonic() < waited_until:
                await asyncio.sleep(NATS_WAIT_POLL_S)
            if self.link.ready:
                return
        raise self.nats_unavailable("not connected to NATS; retry shortly")

    def _admit(self, work: WorkRequest, slices: int, remaining: float) -> None:
        """429 QUEUE_FULL unless the request can be done within ``remaining`` seconds."""
        settings = self.settings  # (the bound on requests in flight is the front's)
        refusal = self.load(work.pool).refusal(
            len(work.items), slices, remaining, work.timeout_s,
            settings.max_outstanding_items_per_pool,
            settings.admission_cold_rate_per_worker * max(1, work.workers))
        if refusal is not None:
            self.metrics.refused.labels(work.pool).inc()
            raise HeronError(ErrorCode.QUEUE_FULL,
                             f"pool {work.pool} cannot take the request now: {refusal.reason}"
                             "; retry after the Retry-After",
                             retry_after_s=refusal.retry_after_s)

    async def _publish(self, work: WorkRequest, reply: str, deadline: float,
                       encoded: list[tuple[Slice, bytes]]) -> None:
        subject = work_subject(work.pool, work.model_id)
        # Retries stop at the deadline or after publish_retry_max_s, whichever comes first.
        give_up_at = time.monotonic() + min(self._remaining(work),
                                            self.settings.publish_retry_max_s)
        publishes = []
        for piece, payload in encoded:
            headers = WorkItemHeaders(work.request_id, work.task, work.model_id, reply,
                                      piece.start, piece.count, deadline,
                                      work.priority).to_wire()
            telemetry.inject(headers)  # traceparent: the worker's spans join this trace
            publishes.append(self._publish_one(work.pool, subject, payload, headers,
                                               give_up_at))
        if len(publishes) == 1:
            outcomes: list[Any] = [await _settle(publishes[0])]
        else:
            outcomes = await asyncio.gather(*publishes, return_exceptions=True)
        self.metrics.work_items.labels(work.pool).inc(
            sum(not isinstance(o, BaseException) for o in outcomes))
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise self._publish_error(work.pool, failures[0])

    async def _publish_one(self, pool: str, subject: str, payload: bytes,
                           headers: dict[str, str], give_up_at: float) -> None:
        """One work item, retried with a backoff through a leader election (no responders,
        timeouts, NATS reconnecting) until ``give_up_at``. A full stream is not retried."""
        tries = 0
        while True:
            left = give_up_at - time.monotonic()
            js = self.link.js
            if js is not None and self.link.ready:
                try:
                    await js.publish(subject, payload, headers=headers,
                                     timeout=max(0.05, min(self.settings.publish_timeout_s,
                                                           left)))
                    if tries:
                        self.metrics.publish_retries.labels(pool).inc(tries)
                    return
                except APIError as exc:
                    if _stream_full(exc):
                        raise
                    failure: BaseException = exc
                except Exception as exc:  # no responders, timeout, connection lost
                    failure = exc
            else:
                failure = ConnectionError("not connected to NATS")
            pause = PUBLISH_BACKOFF_S[min(tries, len(PUBLISH_BACKOFF_S) - 1)]
            tries += 1
            if time.monotonic() + pause >= give_up_at:
                raise failure
            if tries == 1:
                log.info("publishing to %s failed (%r); retrying for up to %.1f s",
                         subject, failure, left)
            await asyncio.sleep(pause)

    def _publish_error(self, pool: str, exc: BaseException) -> HeronError:
        if isinstance(exc, APIError) and _stream_full(exc):
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
        if not msg.data:
            return  # a worker asking whether this gateway still listens (worker/gateway_inboxes)
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
            pending.answered_slices += 1
            load = self.load(pending.pool)
            if result.error is None:  # the rate is of work done, not of refusals
                batch_s = result.timings.get("inference") if result.timings else None
                load.answered(result.count, 1, arrived,
                              batch_s if isinstance(batch_s, int | float) else None)
            else:
                load.abandoned(result.count, 1, arrived)
            self._show_outstanding(pending.pool)
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
            self.load(pending.pool).abandoned(pending.items - pending.answered,
                                              pending.slices - pending.answered_slices,
                                              time.monotonic())
            self._show_outstanding(pending.pool)

    def _add_outstanding(self, pool: str, items: int, slices: int) -> None:
        self.load(pool).published(items, slices, time.monotonic())
        self._show_outstanding(pool)

    def _show_outstanding(self, pool: str) -> None:
        self.metrics.outstanding.labels(pool).set(self.outstanding(pool))

    def pending_requests(self) -> int:
        return len(self._pending)


def _stream_full(exc: APIError) -> bool:
    return "maximum" in str(exc.description or "").lower()


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
