"""Pending demand: requests answered 202 (no healthy worker) per pool.

Autoscalers read it two ways: the ``heron.demand.<pool>`` messages the gateway publishes
(at most one per pool per interval) and the ``heron_gateway_pending_demand{pool}`` gauge,
the number of 202 answers in a trailing window, which decays to 0 once they stop (KEDA
scales a pool to zero again on that).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class DemandTracker:
    def __init__(self, window_s: float = 60.0, publish_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.publish_interval_s = publish_interval_s
        self.clock = clock
        self._answers: dict[str, deque[float]] = {}  # pool -> times of 202 answers
        self._last_published: dict[str, float] = {}
        self._since: dict[str, float] = {}  # pool -> when its current wait began

    def record(self, pool: str) -> bool:
        """Count one 202 for ``pool``; True when a demand message is due now."""
        now = self.clock()
        self._answers.setdefault(pool, deque()).append(now)
        self._since.setdefault(pool, now)
        last = self._last_published.get(pool)
        if last is not None and now - last < self.publish_interval_s:
            return False
        self._last_published[pool] = now
        return True

    def satisfied(self, pool: str) -> None:
        """The pool has a healthy worker again: the next wait starts from scratch."""
        self._since.pop(pool, None)

    def forget(self, pool: str) -> None:
        """The pool is gone (its lease ended): its demand ends now, not after the window."""
        self._answers.pop(pool, None)
        self._last_published.pop(pool, None)
        self._since.pop(pool, None)

    def pending(self, pool: str) -> int:
        """202 answers for ``pool`` in the trailing window."""
        answers = self._answers.get(pool)
        if not answers:
            return 0
        horizon = self.clock() - self.window_s
        while answers and answers[0] <= horizon:
            answers.popleft()
        return len(answers)

    def pools(self) -> list[str]:
        return list(self._answers)

    def estimated_wait_s(self, pool: str, provisioning_s: float, floor_s: float) -> float:
        """How long until a worker is likely ready: a fresh worker's start time, less how
        long this pool has already waited (a worker is probably on its way)."""
        since = self._since.get(pool)
        waited = 0.0 if since is None else self.clock() - since
        return round(max(floor_s, provisioning_s - waited), 1)
