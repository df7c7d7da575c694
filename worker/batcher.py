"""TokenBudgetBatcher: one model's queue, batched by padded-token cost.

The cost of a batch is what the model computes: longest sequence x items. Pending items
are kept sorted by length, so a batch is a contiguous run of similar lengths (little
padding). Every batch is built around an *anchor*, the highest-priority oldest item, so no
item starves however long it is. A batch closes at ``max_batch_tokens``, at
``max_batch_items``, or after a bounded wait measured from its anchor's arrival.

One task (the ModelRunner's loop) owns the queue; callers only ``submit``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from sdk.errors import ErrorCode, HeronError


@dataclass(slots=True)
class WorkItem:
    payload: Any  # the adapter's Tokenized item
    length: int
    priority: int
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    seq: int = 0


class TokenBudgetBatcher:
    def __init__(self, *, max_batch_tokens: int, max_batch_items: int, max_wait_s: float,
                 max_queue_items: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self.max_wait_s = max_wait_s
        self.max_queue_items = max_queue_items
        self._seq = itertools.count()
        self._items: dict[int, WorkItem] = {}
        self._by_length: list[tuple[int, int]] = []  # (length, seq), sorted
        self._anchors: list[tuple[int, int]] = []  # heap of (priority, seq)
        self._queued_tokens = 0
        self._wakeup = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def submit(self, items: list[WorkItem]) -> None:
        """Queue a request's items, all or none (429 QUEUE_FULL past the bound)."""
        if len(self._items) + len(items) > self.max_queue_items:
            raise HeronError(ErrorCode.QUEUE_FULL,
                             f"queue is full ({len(self._items)} items waiting)",
                             retry_after_s=1.0)
        for item in items:
            item.seq = next(self._seq)
            self._items[item.seq] = item
            bisect.insort(self._by_length, (item.length, item.seq))
            heapq.heappush(self._anchors, (item.priority, item.seq))
            self._queued_tokens += item.length
        self._wakeup.set()

    async def next_batch(self) -> list[WorkItem]:
        """Wait for work, then the bounded batching window, then take one batch."""
        while True:
            while not self._items:
                self._wakeup.clear()
                await self._wakeup.wait()
            anchor = self._peek_anchor()
            if anchor is None:
                continue
            waited = time.monotonic() - anchor.enqueued_at
            full = (len(self._items) >= self.max_batch_items
                    or self._queued_tokens >= self.max_batch_tokens)
            if not full and waited < self.max_wait_s:
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.max_wait_s - waited)
                continue
            batch = self._take(anchor)
            live = self._drop_dead(batch)
            if live:
                return live

    def _peek_anchor(self) -> WorkItem | None:
        while self._anchors:
            _, seq = self._anchors[0]
            item = self._items.get(seq)
            if item is not None:
                return item
            heapq.heappop(self._anchors)  # already taken in another item's batch
        return None

    def _take(self, anchor: WorkItem) -> list[WorkItem]:
        keys = self._by_length
        lo = hi = bisect.bisect_left(keys, (anchor.length, anchor.seq))
        width = keys[hi][0]
        # Grow the run [lo, hi] one neighbour at a time, cheapest padding first.
        while hi - lo + 1 < self.max_batch_items:
            n = hi - lo + 1
            left_cost = right_cost = None
            if lo > 0 and width * (n + 1) <= self.max_batch_tokens:
                left_cost = width - keys[lo - 1][0]
            if hi + 1 < len(keys) and keys[hi + 1][0] * (n + 1) <= self.max_batch_tokens:
                right_cost = (keys[hi + 1][0] - width) * n
            if left_cost is None and right_cost is None:
                break
            if right_cost is None or (left_cost is not None and left_cost <= right_cost):
                lo -= 1
            else:
                hi += 1
                width = keys[hi][0]
        taken = [self._items.pop(seq) for _, seq in keys[lo : hi + 1]]
        del keys[lo : hi + 1]
        self._queued_tokens -= sum(item.length for item in taken)
        return taken

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
