"""Admission by deadline: whether a new request can finish in time, from the backlog this
gateway has in a pool and the rate at which the pool has been working it off.

Sans-IO (the caller passes ``now``, monotonic seconds): the Dispatcher reports what it
publishes and what comes back, and asks ``PoolLoad.refusal`` before publishing.

The rate is measured over *busy* time only: the seconds during which this gateway had
something outstanding in the pool. Idle gaps do not dilute it, and it survives them: after
a quiet minute the last measured rate still stands, so the first burst is judged by it
(not admitted blind). A rate measured at low load understates the pool (one request at a
time shows latency, not capacity); that errs towards refusing, and corrects itself within
the burst, since the work admitted keeps the pool busy and raises the measured rate.

Items and slices (work items: NATS messages) are both counted: the cost of a pool is per
item for long texts and per message for single-text requests (about 2.5 ms of NATS and
worker overhead a message against 2-3 ms of MiniLM compute for a short text on this
machine). Each completion is one work item's result: its items, one slice, and the busy
seconds since the one before. When the remembered completions mix work items of different
sizes (a big request's 64-item work items, then shared work items of 5-15 one-text
requests), a least-squares fit of seconds = items x a + slices x b (``CostFit``) splits
the busy time between the two, and the wait is the backlog's items and slices at those
costs. When every work item had the same size, the two cannot be told apart and the wait
is the longer of the two estimates (items at the item rate, slices at the slice rate).
With the longer of the two alone, a big request's slow work items made a burst of small
requests after it look like a second of work each (a 429 to 5 of a fault test's burst of
100 one-text requests with 30 s deadlines, on a pool that served them all in seconds).

A shared work item (coalescing) is one slice and one completion, however many requests
ride in it; its members count their items, not slices.

With several gateways, each sees its own share of a pool's backlog and of its throughput;
their ratio is the same queue wait, so no gateway needs to know about the others.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Completions remembered for the rate: enough to smooth one batch's burst of results.
RATE_SAMPLES = 256
BATCH_EWMA = 0.2  # weight of the newest forward pass in ``batch_s``
# Admit only what is expected to finish within this share of the time left: the estimate
# is a mean, and the request's own result still has to travel back.
ADMISSION_MARGIN = 0.8
# Retry-After is whole seconds (RFC 9110); never 0, which clients read as "at once".
MIN_RETRY_AFTER_S = 1.0


# Rows whose item and slice counts are this correlated (r squared) are one mix: no split.
COLLINEAR_R2 = 0.98
REFIT_EVERY = 1024  # rows added between two sums rebuilt from the rows (no float drift)


class CostFit:
    """Least squares, without intercept, of ``seconds = items x a + slices x b`` over the
    last rows (one a work item's result: its items, 1, the busy seconds since the result
    before), kept as running sums: a gateway asks at every request (an O(1) solve)."""

    __slots__ = ("_added", "_rows", "ii", "is_", "it", "ss", "st")

    def __init__(self, rows: int) -> None:
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=rows)
        self._added = 0
        self.ii = self.is_ = self.it = self.ss = self.st = 0.0

    def add(self, items: float, slices: float, seconds: float) -> None:
        rows = self._rows
        if len(rows) == rows.maxlen:
            self._sum(*rows[0], sign=-1.0)
        rows.append((items, slices, seconds))
        self._added += 1
        if self._added % REFIT_EVERY:
            self._sum(items, slices, seconds, sign=1.0)
        else:
            self.ii = self.is_ = self.it = self.ss = self.st = 0.0
            for row in rows:
                self._sum(*row, sign=1.0)

    def _sum(self, items: float, slices: float, seconds: float, sign: float) -> None:
        self.ii += sign * items * items
        self.is_ += sign * items * slices
        self.ss += sign * slices * slices
        self.it += sign * items * seconds
        self.st += sign * slices * seconds

    def costs(self, items: float, slices: float, seconds: float
              ) -> tuple[float, float] | None:
        """(seconds an item, seconds a slice), scaled so that the window's ``items`` and
        ``slices`` cost its busy ``seconds``; None when the rows are one mix."""
        ii, ss, is_ = self.ii, self.ss, self.is_
        if ii <= 0 or ss <= 0 or items <= 0 or slices <= 0 or seconds <= 0:
            return None
        det = ii * ss - is_ * is_
        if det <= (1.0 - COLLINEAR_R2) * ii * ss:
            return None
        per_item = (self.it * ss - self.st * is_) / det
        per_slice = (ii * self.st - is_ * self.it) / det
        if per_item <= 0 and per_slice <= 0:
            return None
        if per_slice <= 0:  # the fit gives messages nothing: all the time is the items'
            return seconds / items, 0.0
        if per_item <= 0:
            return 0.0, seconds / slices
        scale = seconds / (items * per_item + slices * per_slice)
        return per_item * scale, per_slice * scale


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused, and when a retry could be admitted."""

    reason: str
    retry_after_s: float


class PoolLoad:
    """One pool's backlog and drain rate as this gateway sees them."""

    def __init__(self, min_samples: int) -> None:
        self.min_samples = max(1, min_samples)
        self.items = 0  # outstanding: published, not answered
        self.slices = 0
        self._busy_s = 0.0  # cumulative seconds with something outstanding
        self._last_event: float | None = None
        # (cumulative items done, slices done, busy seconds) after each completion
        self._done: deque[tuple[int, int, float]] = deque(maxlen=RATE_SAMPLES)
        self._fit = CostFit(RATE_SAMPLES - 1)  # the steps between the completions above
        self._items_done = 0
        self._slices_done = 0
        # EWMA of the forward pass that computed a result: work finishes a batch at a time,
        # so the last admitted item waits for its whole batch (200-token texts on this CPU:
        # 1-2 s a batch, which a continuous rate leaves out: 11 of 113 admitted missed a 5 s
        # deadline without it).
        self.batch_s = 0.0

    def _advance(self, now: float) -> None:
        if self._last_event is not None and (self.items or self.slices):
            self._busy_s += max(0.0, now - self._last_event)
        self._last_event = now

    def published(self, items: int, slices: int, now: float) -> None:
        self._advance(now)
        self.items += items
        self.slices += slices

    def answered(self, items: int, slices: int, now: float,
                 batch_s: float | None = None) -> None:
        """A result came back: ``items`` items in ``slices`` work items, computed in a
        forward pass of ``batch_s`` seconds (when the worker said)."""
        self._advance(now)
        if batch_s is not None and batch_s >= 0:
            weight = BATCH_EWMA if self._done else 1.0  # the first result sets it
            self.batch_s += weight * (batch_s - self.batch_s)
        self.items = max(0, self.items - items)
        self.slices = max(0, self.slices - slices)
        self._items_done += items
        self._slices_done += slices
        if self._done:
            self._fit.add(items, slices, self._busy_s - self._done[-1][2])
        self._done.append((self._items_done, self._slices_done, self._busy_s))

    def abandoned(self, items: int, slices: int, now: float) -> None:
        """Outstanding work no one waits for any more (deadline passed, client gone): it
        stops counting (workers drop it past its deadline); no completion is recorded."""
        self._advance(now)
        self.items = max(0, self.items - items)
        self.slices = max(0, self.slices - slices)

    def _window(self) -> tuple[int, int, float] | None:
        """(items, slices, busy seconds) done between the first and the last remembered
        completion; None until ``min_samples`` completions say enough."""
        if len(self._done) < self.min_samples + 1:
            return None
        first, last = self._done[0], self._done[-1]
        busy = last[2] - first[2]
        if busy <= 0:
            return None
        return last[0] - first[0], last[1] - first[1], busy

    def rates(self) -> tuple[float, float] | None:
        """(items/s, slices/s) over the remembered completions' busy time; None until
        ``min_samples`` completions say enough."""
        window = self._window()
        if window is None:
            return None
        items, slices, busy = window
        return items / busy, slices / busy

    def expected_wait_s(self, items: int = 0, slices: int = 0) -> float | None:
        """Seconds until the backlog and ``items``/``slices`` more would be done; None
        while the rate is unknown."""
        window = self._window()
        if window is None:
            return None
        costs = self._fit.costs(*window)
        if costs is not None:
            per_item, per_slice = costs
            return ((self.items + items) * per_item + (self.slices + slices) * per_slice
                    + self.batch_s)
        done_items, done_slices, busy = window
        if done_items <= 0 or done_slices <= 0:
            return math.inf
        return max((self.items + items) * busy / done_items,
                   (self.slices + slices) * busy / done_slices) + self.batch_s

    def refusal(self, items: int, slices: int, remaining_s: float, timeout_s: float,
                max_items: int, cold_rate: float) -> Refusal | None:
        """None to admit a request of ``items`` in ``slices`` with ``remaining_s`` left of
        its ``timeout_s``; else why not and when to retry (a retry brings a whole
        ``timeout_s``). ``cold_rate``: the items/s to assume until a rate is measured.

        A request that finds the pool empty is always admitted: one bigger than a bound
        could never be admitted otherwise."""
        if not self.items:
            return None
        if self.items + items > max_items:
            wait = self.expected_wait_s()
            return Refusal(f"{self.items} items waiting (bound {max_items})",
                           _retry_after(wait if wait is not None else MIN_RETRY_AFTER_S,
                                        0.0))
        wait = self.expected_wait_s(items, slices)
        measured = wait is not None
        if wait is None:
            # A burst into a pool whose rate is unknown: the first results come back only
            # after the gateway has parsed much of the burst (2,000 requests at once were
            # all admitted before one result was read, and finished at 9.98 s of 10).
            wait = (self.items + items) / cold_rate if cold_rate > 0 else math.inf
        if wait <= remaining_s * ADMISSION_MARGIN:
            return None
        rate = "at the rate measured" if measured else (
            f"at the {cold_rate:g} items/s assumed until a rate is measured")
        return Refusal(f"{self.items} items waiting, about {wait:.1f} s of work {rate}, "
                       f"more than the {remaining_s:.1f} s left",
                       _retry_after(wait, timeout_s * ADMISSION_MARGIN))


def _retry_after(wait_s: float, budget_s: float) -> float:
    """Whole seconds until a request with ``budget_s`` of usable time would be admitted,
    if the backlog drains at the rate measured and nothing else arrives."""
    if not math.isfinite(wait_s):
        return MIN_RETRY_AFTER_S * 5
    return float(max(MIN_RETRY_AFTER_S, math.ceil(wait_s - budget_s)))
