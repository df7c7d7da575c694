"""Worker health from heartbeats, and the pending-demand window that decays to zero."""

from __future__ import annotations

import asyncio

from heron.gateway.demand import DemandTracker
from heron.gateway.health import WorkerHealth
from tests.support.beats import Clock, beat


def test_a_worker_counts_while_ready_and_beating() -> None:
    clock = Clock()
    health = WorkerHealth(3.0, clock=clock)
    assert not health.has_capacity("p")
    health.observe(beat("w1"))
    assert health.has_capacity("p") and not health.has_capacity("other")
    clock.now += 2.9
    assert health.has_capacity("p")
    clock.now += 0.2  # 3.1 s since the last beat: missed three
    assert not health.has_capacity("p")
    health.observe(beat("w1"))
    assert health.has_capacity("p")
    health.observe(beat("w1", ready=False))  # e.g. draining after SIGTERM
    assert not health.has_capacity("p") and len(health.workers("p")) == 1


def test_model_state_is_the_best_a_healthy_worker_reports() -> None:
    clock = Clock()
    health = WorkerHealth(3.0, clock=clock)
    assert health.model_state("p", "m") == "no_workers"
    health.observe(beat("w1", models={"m": "loading"}))
    assert health.model_state("p", "m") == "loading"
    health.observe(beat("w2", models={"m": "ready"}))
    assert health.model_state("p", "m") == "ready"
    assert health.model_state("p", "other") == "not_loaded"


def test_malformed_beats_are_dropped() -> None:
    health = WorkerHealth()
    health.observe({"pool": "p"})
    health.observe(beat("w", queue_depth="many"))
    assert not health.workers()


async def test_wait_for_capacity_wakes_on_a_beat() -> None:
    health = WorkerHealth()
    assert not await health.wait_for_capacity("p", 0.01)
    waiter = asyncio.create_task(health.wait_for_capacity("p", 5))
    await asyncio.sleep(0.01)
    health.observe(beat("w", pool="p"))
    assert await asyncio.wait_for(waiter, 1)


def test_pending_demand_decays_and_messages_are_throttled() -> None:
    clock = Clock()
    demand = DemandTracker(window_s=10, publish_interval_s=1, clock=clock)
    assert demand.pending("p") == 0
    assert demand.record("p") is True  # first 202: publish demand
    assert demand.record("p") is False  # same second: no second message
    clock.now += 1.5
    assert demand.record("p") is True
    assert demand.pending("p") == 3
    clock.now += 9.0  # the first two fall out of the 10 s window
    assert demand.pending("p") == 1
    clock.now += 5.0
    assert demand.pending("p") == 0


def test_estimated_wait_counts_down_until_satisfied() -> None:
    clock = Clock()
    demand = DemandTracker(clock=clock)
    demand.record("p")
    assert demand.estimated_wait_s("p", 30, 2) == 30
    clock.now += 20
    assert demand.estimated_wait_s("p", 30, 2) == 10
    clock.now += 20
    assert demand.estimated_wait_s("p", 30, 2) == 2  # never below the retry interval
    demand.satisfied("p")
    demand.record("p")
    assert demand.estimated_wait_s("p", 30, 2) == 30
