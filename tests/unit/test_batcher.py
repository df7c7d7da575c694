"""TokenBudgetBatcher: cost = longest x items, sorted runs, anchors never starve."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from heron.worker.batcher import PRIORITY_AGING_S, TokenBudgetBatcher, WorkItem
from heron_sdk.errors import ErrorCode, HeronError


def make(batcher: TokenBudgetBatcher, lengths: list[int], *, priority: int = 0,
         deadline: float | None = None) -> list[WorkItem]:
    loop = asyncio.get_running_loop()
    items = [WorkItem(payload=n, length=n, priority=priority, deadline=deadline,
                      future=loop.create_future()) for n in lengths]
    batcher.submit(items)
    return items


def new(max_tokens: int = 1000, max_items: int = 8, wait_s: float = 0.0,
        queue: int = 100) -> TokenBudgetBatcher:
    return TokenBudgetBatcher(max_batch_tokens=max_tokens, max_batch_items=max_items,
                              max_wait_s=wait_s, max_queue_items=queue)


async def test_batch_respects_token_budget_and_item_cap() -> None:
    b = new(max_tokens=100, max_items=3)
    make(b, [10, 10, 10, 10, 50, 50])
    first = await b.next_batch()
    assert len(first) == 3 and max(w.length for w in first) * len(first) <= 100
    second = await b.next_batch()
    assert max(w.length for w in second) * len(second) <= 100
    rest = await b.next_batch()
    assert sorted(w.length for w in first + second + rest) == [10, 10, 10, 10, 50, 50]


async def test_batches_group_similar_lengths() -> None:
    b = new(max_tokens=10_000, max_items=4)
    make(b, [5, 100, 6, 101, 7, 102, 8, 103])
    first = await b.next_batch()
    second = await b.next_batch()
    assert sorted(w.length for w in first) == [5, 6, 7, 8]
    assert sorted(w.length for w in second) == [100, 101, 102, 103]


async def test_oldest_item_is_always_in_the_next_batch() -> None:
    """A long item that arrived first is not starved by a stream of short ones."""
    b = new(max_tokens=256, max_items=8)
    (long_item,) = make(b, [200])
    make(b, [4] * 50)
    batch = await b.next_batch()
    assert long_item in batch


async def test_single_item_over_budget_still_runs_alone() -> None:
    b = new(max_tokens=16, max_items=8)
    (big,) = make(b, [300])
    assert await b.next_batch() == [big]


async def test_higher_priority_is_served_first() -> None:
    b = new(max_tokens=40, max_items=2)
    make(b, [10, 10, 10, 10], priority=5)
    urgent = make(b, [30], priority=0)
    batch = await b.next_batch()
    assert urgent[0] in batch


async def test_queue_bound_rejects_whole_request() -> None:
    b = new(queue=5)
    make(b, [1, 2, 3])
    with pytest.raises(HeronError) as err:
        make(b, [1, 2, 3])
    assert err.value.code is ErrorCode.QUEUE_FULL and err.value.status == 429
    assert err.value.retry_after_s is not None
    assert len(b) == 3


async def test_expired_and_cancelled_items_are_not_computed() -> None:
    b = new()
    expired = make(b, [5, 5], deadline=time.monotonic() - 1)
    cancelled = make(b, [6])
    cancelled[0].future.cancel()
    live = make(b, [7])
    batch = await b.next_batch()
    assert batch == live
    for item in expired:
        assert isinstance(item.future.exception(), HeronError)
        assert item.future.exception().code is ErrorCode.DEADLINE_EXCEEDED


async def test_waits_for_more_items_when_they_come_faster_than_a_forward_pass() -> None:
    b = new(max_items=4, wait_s=0.2)
    b.cost.overhead_s, b.cost.expected_gap_s = 0.05, 0.01  # items come 5x faster
    make(b, [5])

    async def later() -> None:
        await asyncio.sleep(0.015)
        make(b, [5, 5, 5])

    task = asyncio.create_task(later())
    batch = await asyncio.wait_for(b.next_batch(), 2)
    await task
    assert len(batch) == 4  # filled before the window closed


async def test_items_that_queued_during_a_forward_pass_still_wait_for_the_next_ones() -> None:
    """Items that waited out a forward pass do not close the next batch at once while
    more are coming fast: the wait counts from when the model became free."""
    b = new(max_items=4, wait_s=0.05)
    b.cost.overhead_s, b.cost.expected_gap_s = 0.05, 0.01
    make(b, [5, 5])
    await asyncio.sleep(0.1)  # older than max_wait: the previous forward pass ran meanwhile

    async def later() -> None:
        await asyncio.sleep(0.01)
        make(b, [5, 5])

    task = asyncio.create_task(later())
    batch = await asyncio.wait_for(b.next_batch(), 2)
    await task
    assert len(batch) == 4


async def test_does_not_wait_when_arrivals_are_sparse() -> None:
    b = new(max_items=4, wait_s=0.5)
    b.cost.overhead_s, b.cost.expected_gap_s = 0.002, 0.3  # waiting would not pay
    make(b, [5])
    started = time.monotonic()
    batch = await asyncio.wait_for(b.next_batch(), 2)
    assert len(batch) == 1 and time.monotonic() - started < 0.05


async def test_does_not_wait_while_no_more_work_can_arrive() -> None:
    """Queue mode: while the worker holds all the work it may fetch, nothing can join the
    batch, so it closes at once however fast items have been arriving."""
    can_fetch = False
    b = TokenBudgetBatcher(max_batch_tokens=1000, max_batch_items=8, max_wait_s=0.5,
                           max_queue_items=100, arrivals_open=lambda: can_fetch)

    async def batch_of(now: int, later: int) -> list[WorkItem]:
        make(b, [5] * now)
        b.cost.overhead_s, b.cost.expected_gap_s = 0.05, 0.02  # waiting would pay

        async def arrive() -> None:
            await asyncio.sleep(0.01)
            make(b, [5] * later)

        task = asyncio.create_task(arrive())
        batch = await asyncio.wait_for(b.next_batch(), 2)
        await task
        return batch

    assert len(await batch_of(2, 2)) == 2  # closed at once: the 2 later ones wait
    assert len(await b.next_batch()) == 2
    can_fetch = True  # room to fetch again: the same queue waits for more
    assert len(await batch_of(1, 2)) == 3


async def test_arrival_gaps_are_learned() -> None:
    b = new()
    for _ in range(40):
        make(b, [5])
        await asyncio.sleep(0.002)
    assert b.cost.expected_gap_s < 0.02


async def test_a_waiting_low_priority_item_ages_past_fresh_high_priority_work() -> None:
    b = new(max_tokens=10, max_items=1)
    old = make(b, [5], priority=1)
    old[0].enqueued_at -= 1.5 * PRIORITY_AGING_S  # aged past priority 0
    make(b, [5], priority=0)
    assert (await b.next_batch()) == old


async def test_window_is_bounded() -> None:
    b = new(max_items=64, wait_s=0.05)
    b.cost.overhead_s, b.cost.expected_gap_s = 0.05, 0.001  # would wait, but not past 50 ms
    make(b, [5])
    started = time.monotonic()
    batch = await asyncio.wait_for(b.next_batch(), 2)
    assert len(batch) == 1 and time.monotonic() - started < 1.0


async def test_batches_shrink_while_priorities_mix() -> None:
    """A priority-0 item waits for the forward pass running when it arrives: while two
    priority levels arrive, batches are an eighth of max_batch_items; background work's
    (BACKGROUND_PRIORITY on, a bulk job's) a 32nd."""
    from heron.worker.batcher import (
        BACKGROUND_BATCH_SHARE,
        BACKGROUND_PRIORITY,
        MIXED_PRIORITY_BATCH_SHARE,
    )

    for low, share in ((1, MIXED_PRIORITY_BATCH_SHARE),
                       (BACKGROUND_PRIORITY, BACKGROUND_BATCH_SHARE)):
        alone = new(max_tokens=10_000, max_items=64)
        make(alone, [5] * 40, priority=low)
        assert len(await alone.next_batch()) == 40

        mixed = new(max_tokens=10_000, max_items=64)
        make(mixed, [5] * 40, priority=low)
        make(mixed, [5] * 12, priority=0)
        sizes = []
        while len(mixed):
            batch = await mixed.next_batch()
            sizes.append((batch[0].priority, len(batch)))
        # the urgent first, in batches of their own
        assert sizes[:2] == [(0, 64 // MIXED_PRIORITY_BATCH_SHARE), (0, 4)], low
        assert {n for p, n in sizes[2:]} == {64 // share}, low
        assert sum(n for _, n in sizes) == 52


async def test_batches_shrink_while_priorities_mix_small_bound() -> None:
    """The same with a small max_batch_items: never under one item a batch."""
    alone = new(max_tokens=10_000, max_items=16)
    make(alone, [5] * 40, priority=1)
    assert len(await alone.next_batch()) == 16

    mixed = new(max_tokens=10_000, max_items=16)
    make(mixed, [5] * 40, priority=1)
    urgent = make(mixed, [5], priority=0)
    first = await mixed.next_batch()
    assert urgent[0] in first
    sizes = [len(first)]
    while len(mixed):
        sizes.append(len(await mixed.next_batch()))
    assert sum(sizes) == 41 and set(sizes) == {2, 1}


async def test_a_request_bigger_than_the_bound_runs_alone_when_the_queue_is_empty() -> None:
    b = new(queue=8)
    big = make(b, [5] * 9)  # 9 items, bound 8: taken, the queue being empty
    assert len(b) == 9
    with pytest.raises(HeronError) as err:  # but nothing joins it past the bound
        make(b, [5])
    assert err.value.code is ErrorCode.QUEUE_FULL and err.value.retry_after_s >= 1
    taken = [*await b.next_batch(), *await b.next_batch()]  # 8 items a batch at most
    assert sorted(map(id, taken)) == sorted(map(id, big))


async def test_refuses_what_the_queue_would_not_finish_before_the_deadline() -> None:
    b = new(queue=10_000)
    for _ in range(8):  # measured: 1,000 tokens a second
        b.drain.observe(100, 0.1)
    make(b, [100] * 30)  # 3,000 tokens queued: about 3 s
    soon = time.monotonic() + 1.0
    with pytest.raises(HeronError) as err:
        make(b, [10], deadline=soon)
    assert err.value.code is ErrorCode.QUEUE_FULL and err.value.status == 429
    assert err.value.retry_after_s == 3.0  # 3.01 s of work, 0.85 s usable
    make(b, [10], deadline=time.monotonic() + 10.0)  # time enough: taken
    assert len(b) == 31


async def test_a_batch_holds_nothing_of_lower_priority_than_its_anchor_while_mixed() -> None:
    """An interactive item among a bulk job's items of the same length runs in a batch of
    its own level: filled with bulk items, it would wait for them (and the next one too)."""
    b = new(max_tokens=10_000, max_items=64)
    make(b, [5] * 40, priority=10)
    urgent = make(b, [5, 5, 5], priority=0)
    first = await b.next_batch()
    assert sorted(map(id, first)) == sorted(map(id, urgent))
    rest = [await b.next_batch() for _ in range(20)]
    assert all(item.priority == 10 for batch in rest for item in batch)
    assert sum(map(len, rest)) == 40 and len(b) == 0


async def test_worse_work_waits_a_moment_after_better_work_for_its_clients_to_return() -> None:
    """Closed-loop interactive clients send again a few ms after their answer: a bulk
    batch started in that gap would hold them back, so it starts only after a quiet
    BACKGROUND_QUIET_S, and what comes back meanwhile goes first."""
    from heron.worker.batcher import BACKGROUND_QUIET_S as LOW_PRIORITY_QUIET_S

    b = new(max_tokens=10_000, max_items=64)
    make(b, [5] * 4, priority=10)
    first = make(b, [5], priority=0)
    assert await b.next_batch() == first
    loop = asyncio.get_running_loop()
    returning: list[WorkItem] = []
    loop.call_later(LOW_PRIORITY_QUIET_S / 4,
                    lambda: returning.extend(make(b, [5], priority=0)))
    assert await b.next_batch() == returning  # came back within the quiet time
    started = time.monotonic()
    bulk = await b.next_batch()
    assert {i.priority for i in bulk} == {10}
    assert time.monotonic() - started >= LOW_PRIORITY_QUIET_S * 0.9
    assert {i.priority for i in await b.next_batch()} == {10} and len(b) == 0


@pytest.mark.parametrize("packed", [False, True])
def test_planning_in_plain_python_splits_as_numpy_does(packed: bool) -> None:
    """Narrow splits are planned in plain Python, wide ones with numpy: for any lengths,
    cap, token budget and overhead the two split the queue the same way."""
    rng = random.Random(11)
    b = TokenBudgetBatcher(max_batch_tokens=1000, max_batch_items=64, max_wait_s=0.0,
                           max_queue_items=1000, packed=packed)
    for _ in range(500):
        b.max_batch_tokens = rng.choice([64, 256, 2048, 16384])
        lengths = sorted(rng.choice([rng.randint(1, 512), rng.randint(8, 16)])
                         for _ in range(rng.randint(1, 80)))
        cap = rng.choice([1, 2, 4, 16, 64, 256])
        overhead = rng.choice([0.0, 7.3, 64.0, 500.0])
        wide = b._split(np.array(lengths, dtype=np.float64), cap, overhead)
        plain = b._split_plain([float(n) for n in lengths], cap, overhead)
        assert [int(i) for i in wide] == plain, (lengths, cap, overhead)
