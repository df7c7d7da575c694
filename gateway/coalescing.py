"""Which small requests share a work item, and when a shared work item leaves (sans-IO).

Every work item costs the cluster the same handful of NATS messages and a worker's dispatch,
whatever its size: one text a request, that was about 1.3 ms of CPU a request on 2 cores
(docs/benchmarks.md). So concurrent small requests with the same *group key* (pool, model,
task, priority, deadline class and every option but the items) are packed into one work
item: their items concatenated in one request body, computed by the worker as one request,
answered in one result that the Dispatcher splits back by each member's item range.

When a group leaves:
- a request that finds no other request of this gateway outstanding in its pool is not
  held: its group leaves at the end of the current event-loop turn (requests parsed in the
  same turn still join it);
- otherwise the pool is busy and the group stays open for the key's window (at most
  ``max_wait_s``), or until the pool has none of this gateway's shared work items in flight
  any more (``release``: its workers would sit idle);
- a group that is full (items, estimated tokens, bytes) leaves at once.

The window adapts per key: a timed group that nobody joined halves it (down to
``MIN_WAIT_S``); one that got company doubles it (up to ``max_wait_s``).
The Dispatcher does the I/O: it schedules the timers, publishes and routes the results;
``split_result`` turns a shared work item's result into each member's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from heron.gateway.reassembly import ITEM_INDEX, shift_item_errors, slice_error
from heron.runtime.protocol import WorkResult
from heron_sdk.errors import STATUS_BY_CODE, ErrorCode

MIN_WAIT_S = 0.0001  # a window never shrinks below 0.1 ms (one event-loop turn or two)


@dataclass(slots=True)
class Member:
    """One request in a group: the inbox key its results go to, and its items."""

    inbox_key: str
    request_id: str
    items: list[Any]  # the request's items in wire form
    tokens: int  # estimated (heron.gateway.slicing.item_tokens)
    size: int  # estimated bytes of its items in the work item
    deadline: float  # unix seconds, as workers read it
    joined_at: float  # the coalescer's clock


@dataclass(slots=True)
class Group:
    """Requests that leave as one work item. ``body``: the wire body they share (the first
    member's, without items)."""

    key: Hashable
    pool: str
    body: dict[str, Any]
    opened_at: float
    wait_s: float  # how long it may stay open (0: until the end of this loop turn)
    members: list[Member] = field(default_factory=list)
    items: int = 0
    tokens: int = 0
    size: int = 0
    left: bool = False  # published (or being published): nobody joins any more

    def add(self, member: Member) -> None:
        self.members.append(member)
        self.items += len(member.items)
        self.tokens += member.tokens
        self.size += member.size

    @property
    def deadline(self) -> float:
        """The work item's deadline: the latest member's (each member times out alone)."""
        return max(m.deadline for m in self.members)

    def wire_items(self) -> list[Any]:
        return [item for m in self.members for item in m.items]

    def only(self, members: list[Member]) -> Group:
        """The same (left) group with only ``members``: some left, or one failed."""
        out = Group(self.key, self.pool, self.body, self.opened_at, self.wait_s, left=True)
        for member in members:
            out.add(member)
        return out

    def offsets(self) -> list[tuple[Member, int]]:
        """(member, index of its first item in the work item), in order."""
        out, start = [], 0
        for member in self.members:
            out.append((member, start))
            start += len(member.items)
        return out


@dataclass(slots=True)
class Joined:
    """What ``Coalescer.join`` asks the Dispatcher to do: publish ``ready`` now; schedule
    ``opened`` to close after its ``wait_s`` (None: the member joined an open group)."""

    ready: list[Group]
    opened: Group | None


class Coalescer:
    def __init__(self, *, max_wait_s: float, max_items: int, max_tokens: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wait_s = max_wait_s
        self.max_items = max_items
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self._clock = clock
        self._open: dict[Hashable, Group] = {}
        self._window: dict[Hashable, float] = {}

    def window(self, key: Hashable) -> float:
        return self._window.get(key, self.max_wait_s)

    def open_groups(self) -> int:
        return len(self._open)

    def join(self, key: Hashable, pool: str, body: dict[str, Any], member: Member, *,
             busy: bool) -> Joined:
        """Put ``member`` in the open group of ``key`` (opening one if there is none or it
        cannot take the member). ``busy``: other requests of this gateway are outstanding in
        the pool, so a new group waits for company (else only for this loop turn)."""
        ready: list[Group] = []
        group = self._open.get(key)
        if group is not None and not self._fits(group, member):
            ready.append(self._leave(group))
            group = None
        opened = None
        if group is None:
            now = self._clock()
            group = opened = Group(key, pool, body, now, self.window(key) if busy else 0.0)
            self._open[key] = group
        group.add(member)
        if group.items >= self.max_items or group.tokens >= self.max_tokens \
                or group.size >= self.max_bytes:
            ready.append(self._leave(group))
            if opened is group:
                opened = None
        return Joined(ready, opened)

    def release(self, pool: str) -> list[Group]:
        """The pool has no shared work item of this gateway in flight any more: its open
        groups leave now."""
        return [self._leave(g) for g in list(self._open.values()) if g.pool == pool]

    def close(self, group: Group) -> bool:
        """The group's wait is over: True if it leaves now (False: it already left, full).
        A timed group adapts its key's window."""
        if group.left:
            return False
        self._leave(group)
        if group.wait_s > 0:
            window = self.window(group.key)
            self._window[group.key] = (max(MIN_WAIT_S, window / 2) if len(group.members) == 1
                                       else min(self.max_wait_s, window * 2))
        return True

    def _fits(self, group: Group, member: Member) -> bool:
        return (group.items + len(member.items) <= self.max_items
                and group.tokens + member.tokens <= self.max_tokens
                and group.size + member.size <= self.max_bytes)

    def _leave(self, group: Group) -> Group:
        group.left = True
        if self._open.get(group.key) is group:
            del self._open[group.key]
        return group


# ---- a shared work item's result, back to its members ------------------------------------
@dataclass(slots=True)
class Split:
    """Each waiting member's own result, and the members to send again in a new work item
    (their neighbour's input failed the shared one)."""

    results: list[tuple[Member, WorkResult]]
    resend: list[Member]


def split_result(group: Group, result: WorkResult, waiting: Callable[[str], bool]) -> Split:
    """``result`` of the work item ``group`` went in, as each member's own (``waiting``:
    whether a member's inbox key still waits). A member's result holds its own items (range
    0..count) and usage; an input error (4xx) that names an item fails only the member
    that owns it, its index counted in that member's items, and the other members are to
    be sent again; any other error is every member's. A body with the wrong number of items
    fails every member: a shifted answer is never served."""
    error = result.error
    if error is not None:
        owner = _owner(group, error)
        if owner is not None:
            member, start = owner
            own = WorkResult(member.request_id, 0, len(member.items), None,
                             slice_error(error, -start).to_body()["error"], result.timings)
            return Split([(member, own)] if waiting(member.inbox_key) else [],
                         [m for m in group.members
                          if m is not member and waiting(m.inbox_key)])
    body = result.body
    rows = body.get("items") if body is not None else None
    results = []
    for member, start in group.offsets():
        if not waiting(member.inbox_key):
            continue
        count = len(member.items)
        if error is not None:
            part = WorkResult(member.request_id, 0, count, None, error, result.timings)
        elif body is None or not isinstance(rows, list) or len(rows) != group.items:
            part = WorkResult(member.request_id, 0, count, None, {
                "code": ErrorCode.INTERNAL.value,
                "message": f"a worker answered a shared work item of {group.items} items with "
                           f"{len(rows) if isinstance(rows, list) else 'no'} items"},
                result.timings)
        else:  # the member's items, an item's own error counted in the member's items
            own, errors = shift_item_errors(rows[start:start + count], -start)
            own_body = {"model": body.get("model"), "items": own,
                        "usage": {"tokens": sum(int(r.get("tokens", 0)) for r in own
                                                if isinstance(r, dict))}}
            if errors:
                own_body["errors"] = errors
            part = WorkResult(member.request_id, 0, count, own_body, None, result.timings)
        results.append((member, part))
    return Split(results, [])


def _owner(group: Group, error: dict[str, Any]) -> tuple[Member, int] | None:
    """(member, index of its first item) whose item an input error (4xx with a field
    ``items[i]``) names; None for an error of the whole work item."""
    field_name = error.get("field")
    match = ITEM_INDEX.match(field_name) if isinstance(field_name, str) else None
    try:
        status = STATUS_BY_CODE.get(ErrorCode(error.get("code")), 500)
    except ValueError:
        return None
    if match is None or status >= 500:
        return None
    index = int(match.group(1))
    for member, start in group.offsets():
        if start <= index < start + len(member.items):
            return member, start
    return None
