"""Shared work items on the wire: the Dispatcher's I/O for coalesced requests.

gateway/coalescing.py decides which small requests share a work item and when it leaves
(sans-IO). This module does the rest for the Dispatcher: it puts a request in its key's
open group and schedules the group's departure, publishes a group as one work item under
an inbox key of its own, keeps it while it is in flight (a pool with none of them in flight
lets its open groups leave at once: its workers would sit idle), and splits its result back
into each member's, sending again the members whose neighbour's input failed it.

A member stays the Dispatcher's request (``PendingRequest``): its deadline, its wait and
its reassembly are the Dispatcher's; a member that timed out or whose client left before its
group left is not computed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind

from heron.gateway.admission import PoolLoad
from heron.gateway.coalescing import Coalescer, Group, Member, split_result
from heron.gateway.metrics import GatewayMetrics
from heron.gateway.publisher import WorkPublisher
from heron.gateway.settings import GatewaySettings
from heron.gateway.slicing import HEADER_BYTES, MESSAGE_OVERHEAD_BYTES, item_bytes, item_tokens
from heron.runtime import telemetry
from heron.runtime.nats_link import NatsLink
from heron.runtime.nats_names import Lane, reply_subject, work_subject
from heron.runtime.protocol import WorkItemHeaders, WorkResult
from heron_sdk import wire
from heron_sdk.ids import new_request_id

if TYPE_CHECKING:
    from heron.gateway.dispatcher import PendingRequest, WorkRequest

# Tasks whose small requests are coalesced: their answers are per item, so a shared work
# item's answer splits back by item range (score ranks against one query: not coalesced).
COALESCED_TASKS = frozenset({"encode", "extract"})
# A request with less time left than this many coalescing windows is sent alone.
COALESCE_MIN_DEADLINE_WINDOWS = 50
# Options that differ between requests of one group: the items, and the timeout (the work
# item carries the latest member's deadline; each member times out on its own).
_PER_MEMBER_FIELDS = frozenset({"items", "timeout_s"})
# Bytes of items in a shared work item: NATS max_payload (1 MiB by default) less room for
# the headers and the request's other fields (heron.gateway.slicing).
GROUP_BYTES_DEFAULT = 1024 * 1024 - MESSAGE_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class GroupKey:
    """What requests must share to be coalesced into one work item."""

    pool: str
    model_id: str
    task: str
    priority: int
    lane: Lane
    deadline_class: int  # log2 of the seconds left: similar deadlines only
    options: str  # repr of every wire field but items and timeout_s (their order as sent)


@dataclass(slots=True)
class SentGroup:
    """A published shared work item: its members (by inbox key) and their item ranges."""

    group: Group
    live: int  # members still waiting for it
    load: PoolLoad  # the backlog it counts in, as one slice


# Applies one result to a member: (its request, its part of the result, when it arrived,
# shared=True) -> the items answered without error (Dispatcher._apply).
ApplyResult = Callable[..., int]


class SharedItems:
    """The shared work items of one gateway: open groups (``coalescer``), and those in
    flight by their inbox key."""

    def __init__(self, link: NatsLink, gateway_id: str, settings: GatewaySettings,
                 metrics: GatewayMetrics, publisher: WorkPublisher,
                 pending: dict[str, PendingRequest], apply: ApplyResult) -> None:
        self.link = link
        self.gateway_id = gateway_id
        self.settings = settings
        self.metrics = metrics
        self.publisher = publisher
        self._pending = pending  # the Dispatcher's requests by inbox key
        self._apply = apply
        self.coalescer = Coalescer(
            max_wait_s=settings.coalesce_max_wait_s, max_items=settings.coalesce_max_items,
            max_tokens=settings.max_tokens_per_work_item,
            max_bytes=GROUP_BYTES_DEFAULT)  # set from NATS max_payload once connected
        self._sent: dict[str, SentGroup] = {}  # inbox key of a shared work item -> it
        self._flying: dict[str, int] = {}  # pool -> its shared work items in self._sent
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps weak refs

    def coalescable(self, work: WorkRequest, remaining: float) -> bool:
        """Whether ``work`` (one slice, ``remaining`` seconds left) may share a work item."""
        settings = self.settings
        # Chunking: an item is many rows already, and the worker bounds the chunks of what
        # it computes as one request: members that each fit could not fit together.
        return (work.task in COALESCED_TASKS and settings.coalesce_max_items > 1
                and not work.bulk and "chunking" not in work.wire_body
                and 2 * len(work.items) <= settings.coalesce_max_items
                and remaining > COALESCE_MIN_DEADLINE_WINDOWS * settings.coalesce_max_wait_s)

    def join(self, work: WorkRequest, inbox_key: str, deadline: float, remaining: float,
             busy: bool) -> None:
        """Put the request in its key's open group; publish what is ready, and schedule
        the group it opened (if any) to leave after its wait."""
        body = work.wire_body
        shared = {k: v for k, v in body.items() if k not in _PER_MEMBER_FIELDS}
        key = GroupKey(work.pool, work.model_id, work.task, work.priority, work.lane,
                       int(math.log2(max(remaining, 1e-3))), repr(shared))
        member = Member(inbox_key, work.request_id, body["items"],
                        sum(item_tokens(i) for i in work.items),
                        sum(item_bytes(i) for i in work.items), deadline, time.monotonic())
        self.coalescer.max_bytes = self.link.max_payload - MESSAGE_OVERHEAD_BYTES
        joined = self.coalescer.join(key, work.pool, shared, member, busy=busy)
        for group in joined.ready:
            self._send(group)
        opened = joined.opened
        if opened is not None:
            loop = asyncio.get_running_loop()
            if opened.wait_s <= 0:
                loop.call_soon(self._close, opened)
            else:
                loop.call_later(opened.wait_s, self._close, opened)

    def take(self, inbox_key: str) -> SentGroup | None:
        """The shared work item whose result came back on ``inbox_key`` (None: not one of
        ours in flight), no longer in flight."""
        sent = self._sent.pop(inbox_key, None)
        if sent is not None:
            self._landed(sent)
        return sent

    def split(self, sent: SentGroup, result: WorkResult, arrived: float) -> None:
        """A shared work item's result, as each member's own (coalescing.split_result);
        members whose neighbour's input failed it are sent again."""
        split = split_result(sent.group, result, self._pending.__contains__)
        done = 0  # items answered: the work item's one completion in the pool's rate
        for member, part in split.results:
            done += self._apply(self._pending[member.inbox_key], part, arrived, shared=True)
        if result.error is None and done:
            batch_s = result.timings.get("inference") if result.timings else None
            sent.load.answered(done, 1, arrived,
                               batch_s if isinstance(batch_s, int | float) else None)
        else:
            sent.load.abandoned(0, 1, arrived)
        if split.resend:
            self.metrics.coalesced_resent.labels(sent.group.pool).inc(len(split.resend))
            self._send(sent.group.only(split.resend))

    def member_left(self, group_key: str) -> None:
        """A member of the shared work item ``group_key`` stopped waiting for it (answered,
        failed or timed out)."""
        sent = self._sent.get(group_key)
        if sent is None:
            return
        sent.live -= 1
        if sent.live <= 0:  # nobody waits for that work item's result any more
            self._landed(self._sent.pop(group_key))
            sent.load.abandoned(0, 1, time.monotonic())

    def _close(self, group: Group) -> None:
        if self.coalescer.close(group):
            self._send(group)

    def _send(self, group: Group) -> None:
        task = asyncio.get_running_loop().create_task(self._send_group(group))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_group(self, group: Group) -> None:
        """Publish one shared work item for the group's members still waiting (one that
        timed out or whose client left is not computed)."""
        left_at = time.monotonic()
        live = [(m, p) for m in group.members
                if (p := self._pending.get(m.inbox_key)) is not None]
        if not live:
            return
        if len(live) < len(group.members):
            group = group.only([m for m, _ in live])
        key: GroupKey = group.key  # type: ignore[assignment]
        payload = wire.encode({**group.body, "items": group.wire_items()}, wire.MSGPACK)
        if len(payload) > self.link.max_payload - HEADER_BYTES and len(group.members) > 1:
            half = len(group.members) // 2  # the byte estimate was short: two work items
            for part in (group.members[:half], group.members[half:]):
                self._send(group.only(part))
            return
        group_key = new_request_id()
        load = live[0][1].load
        self._sent[group_key] = SentGroup(group, len(live), load)
        load.published(0, 1, left_at)
        self._flying[group.pool] = self._flying.get(group.pool, 0) + 1
        for member, pending in live:
            pending.group = group_key
            pending.published_at = left_at
            pending.reassembly.gateway_timings["coalesce"] = left_at - member.joined_at
        subject = work_subject(key.pool, key.model_id, key.lane)
        headers = WorkItemHeaders(group.members[0].request_id, key.task, key.model_id,
                                  reply_subject(self.gateway_id, group_key), 0, group.items,
                                  group.deadline, key.priority).to_wire()
        try:
            with telemetry.span(telemetry.GATEWAY, "publish", kind=SpanKind.PRODUCER,
                                attributes={"messaging.system": "nats",
                                            "messaging.destination.name": subject,
                                            "heron.work_items": 1,
                                            "heron.coalesced_requests": len(live)}):
                telemetry.inject(headers)
                give_up_at = time.monotonic() + min(group.deadline - time.time(),
                                                    self.settings.publish_retry_max_s)
                await self.publisher.publish(key.pool, subject, payload, headers, give_up_at)
        except Exception as exc:
            self._landed(self._sent.pop(group_key, None))
            load.abandoned(0, 1, time.monotonic())
            error = self.publisher.error(key.pool, exc)
            for _, pending in live:
                pending.fail(error)
            return
        metrics = self.metrics
        metrics.of(metrics.work_items, key.pool).inc()
        metrics.of(metrics.coalesced, key.pool).observe(len(live))
        published = time.monotonic() - left_at
        for _, pending in live:
            pending.reassembly.gateway_timings.setdefault("publish", published)

    def _landed(self, sent: SentGroup | None) -> None:
        """A shared work item is no longer in flight: the pool's open groups may leave."""
        if sent is None:
            return
        pool = sent.group.pool
        self._flying[pool] = flying = max(0, self._flying.get(pool, 0) - 1)
        if not flying:  # the pool's workers have nothing of ours: waiting gains nothing
            for group in self.coalescer.release(pool):
                self._send(group)
