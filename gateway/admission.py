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

Items and slices (work items) are both counted: the cost of a pool is per item for long
texts and per message for single-text requests (about 2.5 ms of NATS and worker overhead a
message against 2-3 ms of MiniLM compute for a short text on this machine), so the wait is
the longer of the two estimates.

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
        self._done.append((self._items_done, self._slices_done, self._busy_s))

    def abandoned(self, items: int, slices: int, now: float) -> None:
        """Outstanding work no one waits for any more (deadline passed, client gone): it
        stops counting (workers drop it past its deadline); no completion is recorded."""
        self._advance(now)
        self.items = max(0, self.items - items)
        self.slices = max(0, self.slices - slices)

    def rates(self) -> tuple[float, float] | None:
        """(items/s, slices/s) over the remembered completions' busy time; None until
        ``min_samples`` completions say enough."""
        if len(self._done) < self.min_samples + 1:
            return None
        first, last = self._done[0], self._done[-1]
        busy = last[2] - first[2]
        if busy <= 0:
            return None
        return (last[0] - first[0]) / busy, (last[1] - first[1]) / busy

    def expected_wait_s(self, items: int = 0, slices: int = 0) -> float | None:
        """Seconds until the backlog and ``items``/``slices`` more would be done; None
        while the rate is unknown."""
        rates = self.rates()
        if rates is None:
            return None
        item_rate, slice_rate = rates
        if item_rate <= 0 or slice_rate <= 0:
            return math.inf
        return max((self.items + items) / item_rate,
                   (self.slices + slices) / slice_rate) + self.batch_s

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
