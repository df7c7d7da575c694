"""Admission by deadline (gateway/admission.py), with an injected clock: the backlog is
judged by the rate the pool has been answering, over busy time only."""

from __future__ import annotations

import pytest

from heron.gateway.admission import MIN_RETRY_AFTER_S, CostFit, PoolLoad


def busy_pool(rate_items_s: float, results: int = 20, start: float = 0.0) -> tuple[PoolLoad,
                                                                                    float]:
    """A pool that answered ``results`` one-item requests at ``rate_items_s``; the clock
    after the last one."""
    load = PoolLoad(min_samples=8)
    now = start
    load.published(results, results, now)
    for _ in range(results):
        now += 1.0 / rate_items_s
        load.answered(1, 1, now)
    return load, now


def test_no_rate_yet_assumes_the_cold_rate_and_keeps_the_item_bound() -> None:
    load = PoolLoad(min_samples=8)
    load.published(100, 100, 0.0)
    assert load.rates() is None
    assert load.refusal(10, 10, remaining_s=20, timeout_s=20, max_items=200,
                        cold_rate=10.0) is None
    refusal = load.refusal(150, 150, remaining_s=10, timeout_s=10, max_items=200,
                           cold_rate=1000.0)
    assert refusal is not None and "bound 200" in refusal.reason
    assert refusal.retry_after_s >= MIN_RETRY_AFTER_S
    # 100 waiting and 40 more at the 10 items/s assumed: 14 s, over 80% of 10 s.
    refusal = load.refusal(40, 40, remaining_s=10, timeout_s=10, max_items=200,
                           cold_rate=10.0)
    assert refusal is not None and "assumed until a rate is measured" in refusal.reason
    assert refusal.retry_after_s == 6.0


def test_a_request_bigger_than_the_bound_is_admitted_into_an_empty_pool() -> None:
    load = PoolLoad(min_samples=8)
    assert load.refusal(5000, 80, remaining_s=30, timeout_s=30, max_items=4096,
                        cold_rate=10.0) is None


def test_rate_is_measured_over_busy_time_only() -> None:
    load, now = busy_pool(100.0)
    items_s, slices_s = load.rates()  # type: ignore[misc]
    assert items_s == pytest.approx(100.0) and slices_s == pytest.approx(100.0)
    # A quiet minute changes nothing: idle time is not work time.
    now += 60.0
    load.published(1, 1, now)
    load.answered(1, 1, now + 0.01)
    assert load.rates()[0] == pytest.approx(100.0, rel=0.05)  # type: ignore[index]


def test_refuses_what_cannot_finish_in_time_with_an_honest_retry_after() -> None:
    load, now = busy_pool(100.0)
    load.published(500, 500, now)  # 5 s of work at 100 items/s
    assert load.refusal(1, 1, remaining_s=10.0, timeout_s=10.0, max_items=4096,
                        cold_rate=10.0) is None
    refusal = load.refusal(1, 1, remaining_s=2.0, timeout_s=2.0, max_items=4096,
                           cold_rate=10.0)
    assert refusal is not None and "5.0 s of work" in refusal.reason
    # 5 s of backlog, 2 s x 0.85 usable by a retry: back in about 4 s.
    assert refusal.retry_after_s == 4.0


def test_slices_bound_the_wait_when_messages_are_the_cost() -> None:
    load = PoolLoad(min_samples=8)
    now = 0.0
    load.published(20 * 64, 20, now)
    for _ in range(20):  # 64-item work items, 10 a second: 640 items/s but 10 slices/s
        now += 0.1
        load.answered(64, 1, now)
    load.published(30, 30, now)  # 30 one-item requests: 3 s of messages, 0.05 s of items
    assert load.expected_wait_s(1, 1) == pytest.approx(3.1)


def test_abandoned_work_stops_counting_but_is_no_completion() -> None:
    load, now = busy_pool(100.0)
    load.published(50, 5, now)
    load.abandoned(50, 5, now + 1.0)
    assert load.items == 0 and load.slices == 0
    assert load.rates()[0] == pytest.approx(100.0)  # type: ignore[index]


def test_the_last_admitted_item_waits_for_its_whole_batch() -> None:
    load = PoolLoad(min_samples=8)
    now = 0.0
    load.published(20, 20, now)
    for _ in range(20):  # 10 items a second, each result from a 1.5 s forward pass
        now += 0.1
        load.answered(1, 1, now, batch_s=1.5)
    load.published(30, 30, now)  # 3 s of backlog at the rate, and one batch on top
    assert load.expected_wait_s(1, 1) == pytest.approx(3.1 + 1.5)
    assert load.refusal(1, 1, remaining_s=5.0, timeout_s=5.0, max_items=4096,
                        cold_rate=10.0) is not None  # 4.6 s > 80% of 5 s


def test_a_burst_of_shared_work_items_after_big_ones_is_judged_by_its_own_cost() -> None:
    """Four 64-item work items at a second each, then shared work items of 10 one-text
    requests at 0.16 s each (a shared work item is one slice; its members add items):
    the fit gives an item its 15 ms and a message almost nothing, so 45 items in 5
    shared work items are about 0.7 s of work, where the slice rate alone (8 work items
    in 3.8 s of the window) would say 2.4 s."""
    load = PoolLoad(min_samples=8)
    now = 0.0
    load.published(256, 4, now)
    for _ in range(4):
        now += 1.0
        load.answered(64, 1, now)
    for _ in range(5):  # members join, their shared work items leave and come back
        load.published(10, 0, now)
        load.published(0, 1, now)
        now += 0.16
        load.answered(10, 1, now)
    load.published(45, 0, now)
    load.published(0, 5, now)
    wait = load.expected_wait_s(1, 0)
    assert wait is not None and 0.5 < wait - load.batch_s < 0.9
    assert load.refusal(1, 0, remaining_s=4.0, timeout_s=5, max_items=4096,
                        cold_rate=20) is None


def test_work_items_of_one_size_keep_the_longer_of_the_two_estimates() -> None:
    """Every work item the same size: items and messages cannot be told apart (the fit
    declines) and the wait is the longer of the two rates' estimates, as before."""
    fit = CostFit(16)
    for seconds in (0.1, 0.12, 0.09, 0.11):
        fit.add(64, 1, seconds)
    assert fit.costs(256, 4, 0.42) is None
    load, now = busy_pool(rate_items_s=100.0)
    load.published(50, 50, now)
    assert load.expected_wait_s(0, 0) == pytest.approx(0.5)


def test_the_fit_splits_time_between_items_and_messages() -> None:
    fit = CostFit(64)
    for items in (1, 5, 10, 20, 40, 64) * 3:  # a message 2 ms, an item 1 ms
        fit.add(items, 1, 0.002 + 0.001 * items)
    items = 3 * (1 + 5 + 10 + 20 + 40 + 64)
    costs = fit.costs(items, 18, 18 * 0.002 + 0.001 * items)
    assert costs == (pytest.approx(0.001), pytest.approx(0.002))
    # Old rows leave the window: the sums follow the rows kept.
    for _ in range(64):
        fit.add(10, 1, 0.02)
    assert fit.costs(640, 64, 1.28) is None  # one mix again
