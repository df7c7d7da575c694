"""LaneFetcher: how a worker takes work from its pool's stream, lane by lane (WorkConsumer,
heron.worker.consumer, computes and answers what it takes).

- how much it may hold beyond its forward passes (the lookahead; on CPU nothing while a
  pass runs), so that work it cannot start soon stays in the stream for an idle worker;
- which lane goes first: priority 0, then the low lane (priorities 1 and up) only while no
  priority-0 item waits here, then the bulk lane one work item at a time
  (heron.runtime.nats_names.Lane);
- the pulls themselves: one blocking pull for a message, then short follow-ups for what is
  queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NotJSMessageError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from heron.runtime.nats_names import Lane, lane_consumer, work_stream
from heron.worker.service import InferenceService

log = logging.getLogger("heron.worker.fetching")

BACKLOG_POLL_S = 0.005  # how often a full backlog is looked at again (forward passes start)
# The lanes a worker pulls (every one), as its heartbeats say: a gateway sends work to a
# lane only when every healthy worker of the pool pulls it (WorkerHealth.all_pull).
PULLED_LANES = tuple(lane.label for lane in Lane)
# Bulk lane work items a worker holds at most: the one computing and the next, already
# tokenized and queued, so the model never waits for a fetch between them.
BULK_ITEMS_HELD = 2


def queued_after(msg: Msg) -> bool:
    """Whether the lane's consumer held more messages when JetStream delivered ``msg`` (its
    ack subject carries the count); True when it cannot tell."""
    try:
        pending = msg.metadata.num_pending
    except NotJSMessageError:
        return True
    return pending is None or pending > 0


class Hold:
    """A fetched work item's items, counted in the worker's backlog until computed (not
    while ``suspend``ed: waiting for its gateway's verdict, it blocks no fetching), and
    (``first``) among the first lane's. A bulk lane work item holds none: that lane counts
    work items (_bulk_fetch_loop)."""

    __slots__ = ("consumer", "counted", "first", "items")

    def __init__(self, consumer: LaneFetcher, items: int, first: bool) -> None:
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


class LaneFetcher:
    """The fetching half of WorkConsumer: its subclass turns a fetched message into the
    coroutine that computes and answers it (``_start``)."""

    def __init__(self, service: InferenceService, *, fetch_batch: int, max_in_flight: int,
                 lookahead_items: int, lookahead_busy_items: int | None) -> None:
        self.service = service
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
                or not self.service.passes_busy():
            return self.lookahead_items
        if lane is Lane.FIRST and self._held_items > self._first_items_held:
            return self.lookahead_items
        return self.lookahead_busy_items

    async def _start_fetching(self, js: JetStreamContext, pool: str) -> None:
        """Bind every lane's consumer and start its fetch loop."""
        for lane in Lane:
            self._subs[lane] = await js.pull_subscribe_bind(
                durable=lane_consumer(pool, lane), stream=work_stream(pool))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._fetch_loop(Lane.FIRST)),
                       loop.create_task(self._fetch_loop(Lane.LOW)),
                       loop.create_task(self._bulk_fetch_loop())]

    async def _stop_fetching(self, timeout_s: float) -> None:
        """Stop fetching, let what is held finish (up to ``timeout_s``), unsubscribe."""
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
        None is sent when the last message fetched says the stream held nothing more for
        this lane (``queued_after``): at one client every follow-up found nothing, and
        cost a pull (nats-py sends it no-wait with an expiry, which nats-server lets
        linger the whole 5 ms), its status reply and the wake-ups for them.

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
            queued = queued_after(msgs[0])
            while queued and not self._stopping.is_set():
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
                queued = queued_after(msgs[-1])
            if not queued:
                await self._let_a_pass_start()

    async def _let_a_pass_start(self) -> None:
        """The stream held nothing more: before the next blocking pull, wait up to
        BACKLOG_POLL_S (less once an item is done), so that a forward pass about to start
        on what was just taken has started, and the lookahead keeps this worker from
        fetching during it. The 5 ms follow-up pull that found nothing gave the same wait,
        at the cost of its messages."""
        if self.lookahead_busy_items != self.lookahead_items:
            await self._backlog_moves()

    async def _backlog_moves(self) -> None:
        """Until an item held here is done or suspended, or BACKLOG_POLL_S has passed (a
        forward pass that starts is not signalled: it is seen by polling)."""
        self._backlog_moved.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._backlog_moved.wait(), BACKLOG_POLL_S)

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
            await self._backlog_moves()

    async def _wait_for_room(self, lane: Lane) -> None:
        """Until ``lane`` has room. Finished items wake us at once; a forward pass that
        starts (and takes items off the backlog) is seen by polling."""
        while self.room(lane) <= 0 and not self._stopping.is_set():
            await self._backlog_moves()

    async def _pull(self, n: int, timeout_s: float, sub: Any) -> list[Msg]:
        try:
            return await sub.fetch(batch=n, timeout=timeout_s)
        except (NatsTimeoutError, TimeoutError):
            return []
        except Exception as exc:  # disconnected: nats-py reconnects; try again soon
            log.warning("fetch failed: %s", exc)
            await asyncio.sleep(0.5)
            return []

    def _start(self, msg: Msg, hold: Callable[[int], Hold]
               ) -> tuple[int, Coroutine[Any, Any, None]]:
        """``msg``'s items and the coroutine that computes and answers them, holding
        ``hold(items)`` (the subclass reads the message)."""
        raise NotImplementedError

    def _dispatch(self, msg: Msg, lane: Lane) -> int:
        """Start computing ``msg`` in a task of its own; its items."""
        bulk, first = lane is Lane.BULK, lane is Lane.FIRST
        count, work = self._start(msg, lambda items: Hold(self, 0 if bulk else items, first))
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
