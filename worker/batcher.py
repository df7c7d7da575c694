"""TokenBudgetBatcher: one model's queue, batched by padded-token cost.

The cost of a batch is what the model computes: longest sequence x items. Pending items
are kept sorted by length, so a batch is a contiguous run of similar lengths (little
padding). Every batch is built around an *anchor*: the oldest item of the highest
priority, where waiting ages an item up one priority level per ``PRIORITY_AGING_S``, so no
item starves however long it is or however low its priority. A batch closes at
``max_batch_tokens``, at ``max_batch_items``, or when waiting for more items would cost
more than it gains (``BatchCostModel.worth_waiting``, bounded by ``max_wait_s``).

One task (the ModelRunner's loop) owns the queue; callers only ``submit``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from heron_sdk.errors import ErrorCode, HeronError

# Waiting this long raises an item one priority level (0 is the highest): under a flood of
# priority-0 work a priority-1 item still runs within about this much extra time. At 1 s,
# saturated priority-1 work (waiting about a second anyway) aged past fresh priority-0
# work and took its place: priority 0's p90 queue wait was 320 ms, against 42 ms at 2.5 s
# (bench/priority_bench.py; 5 s gave no better p0 and a 4.8 s p99 for priority 1).
PRIORITY_AGING_S = 2.5
# While work of more than one priority arrives (each seen within MIXED_PRIORITY_WINDOW_S),
# batches hold at most 1/MIXED_PRIORITY_BATCH_SHARE of max_batch_items. A priority-0 item
# that arrives during a forward pass waits for that pass to end, so under mixed saturation
# long batches of priority-1 work set priority 0's tail. Eighth-size batches (8 of
# MiniLM's 64) cost about 16% of throughput while priorities mix, nothing otherwise; at a
# quarter, priority 0's p99 was 423-487 ms against 332-415 ms, and the p99 ratio to
# priority 1 missed its target (a third) in 2 of 4 runs (bench/priority_bench.py).
MIXED_PRIORITY_BATCH_SHARE = 8
MIXED_PRIORITY_WINDOW_S = 2.0
# Priorities from BACKGROUND_PRIORITY on are background work (bulk jobs' shards, at the
# gateway's job_priority, 10 by default): they only fill the gaps of better work.
# - A batch of it while better work arrives is 1/32 (2 of MiniLM's 64): an interactive
#   item that arrives during it waits for it whole. For BACKGROUND_WINDOW_S after better
#   work was last seen it is an eighth, not whole: interactive traffic comes back after
#   pauses, and its first requests after one found a full batch of a job's items computing
#   (p99 x2.9 at 8 clients, bench/job_bench.py). A 32nd throughout halved a job's rows/s
#   for a minute after any interactive request.
# - After a batch of better work, a batch of it starts only once the model has been free
#   BACKGROUND_QUIET_S with nothing better arriving: under closed-loop load the clients of
#   the batch just answered send again within a few milliseconds (the cluster path's round
#   trip), and a job's batch started in that gap made each of them wait for it
#   (bench/job_bench.py, split cores: p99 x1.14 and p50 +10% at 8 clients).
# Not for priorities 1-9: applied to priority 1 under bench/priority_bench.py's mixed
# saturation, both halved its throughput (579 -> 288 items/s) and doubled priority 0's p99.
BACKGROUND_PRIORITY = 10
BACKGROUND_BATCH_SHARE = 32
BACKGROUND_WINDOW_S = 60.0
BACKGROUND_QUIET_S = 0.010
# Admit a request only if the queue ahead of it is expected to be done within this share
# of its time left: the estimate is a mean, and tokenizing and answering take time too.
ADMISSION_MARGIN = 0.85
# A split whose batches can hold at most this many items (the cap, or the items there
# are) is planned in plain Python, a wider one with numpy: per item planned, plain Python
# costs about 0.07 µs a candidate batch start, numpy 5 µs whatever their number (this
# 2-core machine: 10 items 7 against 52 µs; 257 items of cap 64 1.1 against 1.3 ms;
# 1,025 items of cap 256 16 against 5.6 ms).
PLAIN_PLAN_WIDTH = 64


@dataclass(slots=True)
class WorkItem:
    payload: Any  # the adapter's Tokenized item
    length: int
    priority: int
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    seq: int = 0
    # The LoRA adapter the item is computed with (worker/lora.py; None: the base model).
    # Batches may mix adapters: each row is computed with its own, so it is no batch key.
    lora: Any = None


class TokenBudgetBatcher:
    def __init__(self, *, max_batch_tokens: int, max_batch_items: int, max_wait_s: float,
                 max_queue_items: int, packed: bool = False,
                 arrivals_open: Callable[[], bool] | None = None) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self.max_wait_s = max_wait_s
        self.max_queue_items = max_queue_items
        # Packed batches (no padding) cost their real tokens, not longest x items.
        self.packed = packed
        # False while nothing more can be submitted until a batch is taken (queue mode: the
        # worker holds all the work it may fetch ahead): then waiting gains nothing.
        self._arrivals_open = arrivals_open or _always_open
        self._seq = itertools.count()
        self._items: dict[int, WorkItem] = {}
        self._by_length: list[tuple[int, int]] = []  # (length, seq), sorted
        self._fifo: dict[int, deque[int]] = {}  # priority -> seqs in arrival order
        self._queued_tokens = 0
        self._last_seen: dict[int, float] = {}  # priority -> when it last arrived
        self._last_priority: int | None = None  # the anchor's of the last batch taken
        self._wakeup = asyncio.Event()
        self.cost = BatchCostModel()
        self.drain = DrainRate()  # the runner reports every forward pass

    def __len__(self) -> int:
        return len(self._items)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def submit(self, items: list[WorkItem]) -> None:
        """Queue a request's items, all or none: 429 QUEUE_FULL past the bound, or when
        the queue ahead would not be done before the request's deadline at the measured
        rate. A request that finds the queue empty is always taken, even one bigger than
        the bound (it could never be taken otherwise)."""
        waiting = len(self._items)
        if waiting:
            self._admit(items, waiting)
        for item in items:
            item.seq = next(self._seq)
            self._items[item.seq] = item
            bisect.insort(self._by_length, (item.length, item.seq))
            self._fifo.setdefault(item.priority, deque()).append(item.seq)
            self._last_seen[item.priority] = item.enqueued_at
            self._queued_tokens += item.length
            self.cost.arrived(item.enqueued_at)
        self._wakeup.set()

    def _admit(self, items: list[WorkItem], waiting: int) -> None:
        tokens = self._queued_tokens + sum(item.length for item in items)
        wait = self.drain.seconds_for(tokens)
        if waiting + len(items) > self.max_queue_items:
            raise HeronError(ErrorCode.QUEUE_FULL,
                             f"queue is full ({waiting} items waiting, bound "
                             f"{self.max_queue_items})",
                             retry_after_s=retry_after_s(wait or 0.0, 0.0))
        deadline = min((i.deadline for i in items if i.deadline is not None), default=None)
        if deadline is None or wait is None:
            return
        left = deadline - time.monotonic()
        if wait > left * ADMISSION_MARGIN:
            raise HeronError(ErrorCode.QUEUE_FULL,
                             f"{waiting} items waiting, about {wait:.1f} s of work at the "
                             f"rate measured, more than the {max(0.0, left):.1f} s left",
                             retry_after_s=retry_after_s(wait, left * ADMISSION_MARGIN))

    async def next_batch(self, free_passes: Callable[[], int] | None = None
                         ) -> list[WorkItem]:
        """Wait for work, then (maybe) for more work, then take one batch.

        ``free_passes``: how many forward passes could start now, this one included
        (``--inference-threads``). The queue is then shared between them: a batch takes at
        most its share, and the next free thread takes the rest. Taking everything left the
        other thread idle: one `heron serve` process with two passes made 0.56-0.62 of two
        processes' MiniLM requests/s at 32-64 clients, with 30-49% of the CPU idle.

        The wait is bounded from when the model became free (this call), not from when
        the oldest item arrived. Under closed-loop load the items of the batch just
        answered come back a few milliseconds later; counted from arrival, the items that
        queued during the last forward pass had always waited long enough, so they ran
        alone, and two half-size cohorts took turns for good. Counted from now, the
        returning cohort joins them: bench/serve_bench, 2 processes, interleaved runs,
        434 -> 456 items/s at 64 clients and 336 -> 362 at 16, p99 unchanged. Not while
        priorities mix (see ``_item_cap``)."""
        free_since = time.monotonic()
        while True:
            while not self._items:
                self._wakeup.clear()
                await self._wakeup.wait()
            anchor = self._peek_anchor()
            if anchor is None:
                continue
            quiet_left = BACKGROUND_QUIET_S - (time.monotonic() - free_since)
            if anchor.priority >= BACKGROUND_PRIORITY and self._last_priority is not None \
                    and anchor.priority > self._last_priority and quiet_left > 0:
                self._wakeup.clear()  # better work may come back: wait for it (bounded)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), quiet_left)
                continue
            cap = self._item_cap(anchor.priority)
            parts = free_passes() if free_passes is not None else 1
            if parts > 1:
                cap = min(cap, -(-len(self._items) // parts))
            # While priorities mix, a batch closes on the anchor's own wait: there, the
            # priority-0 tail counts for more than batch size.
            since = anchor.enqueued_at if cap < self.max_batch_items else max(
                anchor.enqueued_at, free_since)
            waited = time.monotonic() - since
            full = (len(self._items) >= cap
                    or self._queued_tokens >= self.max_batch_tokens)
            if (not full and waited < self.max_wait_s and self.cost.worth_waiting()
                    and self._arrivals_open()):
                # More items are likely to arrive before another forward pass would have
                # paid for itself: wait for one (bounded), then decide again.
                before = len(self._items)
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), min(
                        self.max_wait_s - waited, 2 * self.cost.expected_gap_s))
                if len(self._items) > before:
                    continue
            batch = self._take(anchor, cap)
            live = self._drop_dead(batch)
            if live:
                self._last_priority = anchor.priority
                return live

    def _peek_anchor(self) -> WorkItem | None:
        """The oldest item of the best *aged* priority (see PRIORITY_AGING_S)."""
        now = time.monotonic()
        best: tuple[float, int] | None = None
        for priority, seqs in list(self._fifo.items()):
            while seqs and seqs[0] not in self._items:
                seqs.popleft()  # already taken in another item's batch
            if not seqs:
                del self._fifo[priority]
                continue
            head = self._items[seqs[0]]
            key = (priority - (now - head.enqueued_at) / PRIORITY_AGING_S, head.seq)
            if best is None or key < best:
                best = key
        return None if best is None else self._items[best[1]]

    def _item_cap(self, priority: int) -> int:
        """Items per batch of ``priority`` now: smaller while more than one level arrives;
        for background work, smallest while better work arrives, and smaller for a while
        after it did."""
        now = time.monotonic()
        better = None
        if priority >= BACKGROUND_PRIORITY:
            better = max((seen for p, seen in self._last_seen.items() if p < priority),
                         default=None)
            if better is not None and better >= now - MIXED_PRIORITY_WINDOW_S:
                return max(1, self.max_batch_items // BACKGROUND_BATCH_SHARE)
        since = now - MIXED_PRIORITY_WINDOW_S
        if sum(1 for seen in self._last_seen.values() if seen >= since) > 1 or (
                better is not None and better >= now - BACKGROUND_WINDOW_S):
            return max(1, self.max_batch_items // MIXED_PRIORITY_BATCH_SHARE)
        return self.max_batch_items

    def _take(self, anchor: WorkItem, cap: int) -> list[WorkItem]:
        keys = self._by_length
        # A batch holds no item of a worse priority than its anchor's: filled up with a
        # bulk job's items of similar lengths, each interactive item's batch grew to the
        # cap and the next one waited for it (bench/job_bench.py: 300 ms of batch wait at
        # 8 clients). Under bench/priority_bench.py's mixed saturation, priority 0's
        # p50/p99 were 74/442 ms with this and 257/575 ms filled with priority 1's items,
        # at the same items/s (342 against 358).
        view = keys if len(self._fifo) < 2 else [
            k for k in keys if self._items[k[1]].priority <= anchor.priority]
        lo, hi = self._plan(anchor, cap, view)
        chosen = view[lo : hi + 1]
        if view is keys:
            del keys[lo : hi + 1]
        else:
            for key in chosen:
                del keys[bisect.bisect_left(keys, key)]
        taken = [self._items.pop(seq) for _, seq in chosen]
        self._queued_tokens -= sum(item.length for item in taken)
        return taken

    def _plan(self, anchor: WorkItem, cap: int, keys: list[tuple[int, int]]
              ) -> tuple[int, int]:
        """The run [lo, hi] of the length-sorted queue to run now: the batch that holds the
        anchor in the cheapest split of the items around it into batches.

        Cost of a batch = overhead + longest x items (in tokens; the sum of lengths for
        packed batches, which have no padding); the overhead is what one
        forward pass costs beyond its tokens, learned from observed forward times. Splitting
        a mixed queue into similar-length batches beats one padded batch whenever the
        padding saved is worth more than the extra forward passes. Exact dynamic programme
        over a bounded window (numpy, well under a millisecond for 256 items). ``keys``:
        the length-sorted queue, or the part of it the batch may take from."""
        at = bisect.bisect_left(keys, (anchor.length, anchor.seq))
        reach = 2 * cap
        first, last = max(0, at - reach), min(len(keys), at + reach + 1)
        overhead = self.cost.overhead_tokens
        if min(last - first, cap) <= PLAIN_PLAN_WIDTH:
            start = self._split_plain([float(k[0]) for k in keys[first:last]], cap,
                                      overhead)
        else:
            start = self._split(np.fromiter((k[0] for k in keys[first:last]),
                                            dtype=np.float64, count=last - first), cap,
                                overhead)
        # Walk the optimal split back to the batch that holds the anchor.
        j, target = last - first, at - first
        while start[j] > target:
            j = int(start[j])
        return first + int(start[j]), first + j - 1

    def _split(self, lengths: np.ndarray, cap: int, overhead: float) -> Any:
        """The cheapest split of ``lengths`` (sorted) into batches: ``start[j]``, where the
        last batch of the first j items starts."""
        n = len(lengths)
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        start = np.zeros(n + 1, dtype=np.int64)
        index = np.arange(n + 1, dtype=np.float64)
        prefix = np.concatenate(([0.0], np.cumsum(lengths)))
        for j in range(1, n + 1):
            width = lengths[j - 1]
            # Batches ending at j-1 may start at i in [low, j-1]: item cap and token budget.
            if self.packed:
                low = int(np.searchsorted(prefix, prefix[j] - self.max_batch_tokens))
                low = max(low, j - cap, 0)
                low = min(low, j - 1)
                tokens = prefix[j] - prefix[low:j]
            else:
                fit = max(1, min(cap, int(self.max_batch_tokens // width)))
                low = max(0, j - fit)
                tokens = width * (j - index[low:j])
            costs = best[low:j] + overhead + tokens
            i = len(costs) - 1 - int(np.argmin(costs[::-1]))  # ties: start later
            best[j] = costs[i]
            start[j] = low + i
        return start

    def _split_plain(self, lengths: list[float], cap: int, overhead: float) -> list[int]:
        """``_split`` in plain Python, the same answer to the last bit (the same float
        operations in the same order): for a few items numpy's per-call cost dominates,
        52 µs for 10 items against 7 (about a null model's batch: one a work item)."""
        n = len(lengths)
        budget = self.max_batch_tokens
        best = [0.0] + [math.inf] * n
        start = [0] * (n + 1)
        prefix = [0.0]
        for length in lengths:
            prefix.append(prefix[-1] + length)
        for j in range(1, n + 1):
            width = lengths[j - 1]
            if self.packed:
                low = max(bisect.bisect_left(prefix, prefix[j] - budget), j - cap, 0)
                low = min(low, j - 1)
            else:
                low = max(0, j - max(1, min(cap, int(budget // width))))
            chosen, least = low, math.inf
            for i in range(low, j):
                tokens = prefix[j] - prefix[i] if self.packed else width * (j - i)
                cost = best[i] + overhead + tokens
                if cost <= least:  # ties: start later
                    chosen, least = i, cost
            best[j] = least
            start[j] = chosen
        return start

    @staticmethod
    def _drop_dead(batch: list[WorkItem]) -> list[WorkItem]:
        """Expired work is answered with an error, cancelled work is skipped: no compute."""
        now = time.monotonic()
        live = []
        for item in batch:
            if item.future.done():
                continue
            if item.deadline is not None and now >= item.deadline:
                item.future.set_exception(HeronError(
                    ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued"))
                continue
            live.append(item)
        return live


class DrainRate:
    """Tokens the model computes per second of forward passes, over recent batches: how
    long a queue of N tokens takes to drain. None until ``min_batches`` were seen (a fresh
    model's queue is admitted on the item bound alone)."""

    def __init__(self, window: int = 64, min_batches: int = 8) -> None:
        self._batches: deque[tuple[int, float]] = deque(maxlen=window)
        self._tokens = 0
        self._seconds = 0.0
        self.min_batches = min_batches

    def observe(self, real_tokens: int, seconds: float) -> None:
        if len(self._batches) == self._batches.maxlen:
            old_tokens, old_seconds = self._batches[0]
            self._tokens -= old_tokens
            self._seconds -= old_seconds
        self._batches.append((real_tokens, seconds))
        self._tokens += real_tokens
        self._seconds += seconds

    def seconds_for(self, tokens: int) -> float | None:
        if len(self._batches) < self.min_batches or self._seconds <= 0 or self._tokens <= 0:
            return None
        return tokens * self._seconds / self._tokens


def retry_after_s(wait_s: float, budget_s: float) -> float:
    """Whole seconds (at least 1) until a request with ``budget_s`` usable would fit, if
    the queue drains as measured and nothing else arrives."""
    return float(max(1, math.ceil(wait_s - budget_s)))


def _always_open() -> bool:
    return True


class BatchCostModel:
    """Learns the fixed cost of one forward pass from observed batches, and how often
    items arrive.

    A forward pass takes about ``c0 + c1 * padded_tokens`` seconds. The split of the queue
    into batches needs the ratio ``c0 / c1`` (``overhead_tokens``); the adaptive wait needs
    ``c0`` itself (``overhead_s``): one more item is worth waiting for while it is expected
    sooner than the forward pass it would otherwise need costs. Least squares over recent
    batches, clamped to a sane range; priors until there is enough spread to fit.
    """

    def __init__(self, prior_overhead_tokens: float = 64.0, window: int = 256,
                 prior_overhead_s: float = 0.002) -> None:
        self.overhead_tokens = prior_overhead_tokens
        self.overhead_s = prior_overhead_s
        self.expected_gap_s = 1.0  # EWMA of the time between arrivals
        self._last_arrival: float | None = None
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._since_fit = 0

    def arrived(self, at: float) -> None:
        if self._last_arrival is not None:
            gap = max(0.0, at - self._last_arrival)
            self.expected_gap_s += 0.1 * (gap - self.expected_gap_s)
        self._last_arrival = at

    def worth_waiting(self) -> bool:
        return self.expected_gap_s < self.overhead_s

    def observe(self, padded_tokens: int, seconds: float) -> None:
        self._samples.append((float(padded_tokens), seconds))
        self._since_fit += 1
        if self._since_fit >= 16 and len(self._samples) >= 32:
            self._since_fit = 0
            self._fit()

    def _fit(self) -> None:
        data = np.array(self._samples)
        x, y = data[:, 0], data[:, 1]
        if x.std() < 0.2 * x.mean():  # all batches alike: the fit would be noise
            return
        c1, c0 = np.polyfit(x, y, 1)
        if c1 > 0 and c0 > 0:
            self.overhead_tokens = float(np.clip(c0 / c1, 4.0, 1024.0))
            self.overhead_s = float(np.clip(c0, 0.0, 0.05))
