"""The lease mirror's bookkeeping (newest revision wins, expiry by the clock), reading
bucket messages as leases, and the gateway forgetting an ended pool's demand."""

from __future__ import annotations

import time

from heron.gateway.demand import DemandTracker
from heron.gateway.metrics import GatewayMetrics
from heron.runtime.pool_store import LeaseMirror, lease_from_entry
from heron_sdk.pools import PoolLease, PoolSpec


def lease(name: str = "team-a", ttl_s: float = 60.0, age_s: float = 0.0,
          workers: int = 1) -> PoolLease:
    return PoolLease.new(PoolSpec(name, "default", workers, ttl_s), now=time.time() - age_s)


def recording_mirror() -> tuple[LeaseMirror, list[tuple[str, PoolLease | None]]]:
    events: list[tuple[str, PoolLease | None]] = []
    return LeaseMirror(on_change=lambda name, value: events.append((name, value))), events


def test_the_newest_revision_wins_and_an_end_is_told_once() -> None:
    mirror, events = recording_mirror()
    first, renewed = lease(), lease(ttl_s=120)
    mirror.apply("team-a", first, 5)
    mirror.apply("team-a", first, 5)  # the watcher echoing our own write: nothing new
    assert mirror.get("team-a") == first and events == [("team-a", first)]
    mirror.apply("team-a", renewed, 7)
    mirror.apply("team-a", first, 6)  # late, older: ignored
    assert mirror.get("team-a") == renewed
    mirror.apply("team-a", None, 8)  # deleted
    mirror.apply("team-a", renewed, 7)  # a stale renewal cannot bring it back
    assert mirror.get("team-a") is None and mirror.live() == {}
    assert events == [("team-a", first), ("team-a", renewed), ("team-a", None)]


def test_a_lease_ends_by_the_clock_before_any_marker() -> None:
    mirror, events = recording_mirror()
    mirror.apply("old", lease("old", ttl_s=2, age_s=1.7), 1)
    mirror.apply("new", lease("new", ttl_s=60), 2)
    assert set(mirror.live()) == {"old", "new"}
    time.sleep(0.4)
    assert set(mirror.live()) == {"new"} and mirror.get("old") is None
    assert events[-1] == ("old", None) and [e for e in events if e[1] is None] == [
        ("old", None)]
    # an already-expired lease arriving late is never live
    mirror.apply("late", lease("late", ttl_s=1, age_s=5), 3)
    assert mirror.get("late") is None and "late" not in [name for name, _ in events]


def test_bucket_messages_that_are_not_live_leases() -> None:
    value = lease("team-a").to_kv()
    assert lease_from_entry(value, None, "team-a") == PoolLease.from_kv(value)
    assert lease_from_entry(value, {"KV-Operation": "PURGE"}, "team-a") is None
    assert lease_from_entry(b"", {"Nats-Marker-Reason": "MaxAge"}, "team-a") is None
    assert lease_from_entry(value, None, "team-b") is None  # not the key it was written to
    assert lease_from_entry(b"{not json", None, "team-a") is None
    assert lease_from_entry(b'{"name": "team-a"}', None, "team-a") is None
    assert lease_from_entry(b'["team-a"]', None, "team-a") is None  # JSON, but no lease


def test_an_ended_pool_leaves_no_demand_behind() -> None:
    demand = DemandTracker(window_s=60)
    metrics = GatewayMetrics()
    demand.record("team-a")
    demand.record("other")
    metrics.pending_demand.labels("team-a").set(demand.pending("team-a"))
    metrics.healthy_workers.labels("team-a").set(0)
    demand.forget("team-a")
    metrics.forget_pool("team-a")
    metrics.forget_pool("never-seen")  # harmless
    assert demand.pending("team-a") == 0 and demand.pools() == ["other"]
    assert b'pool="team-a"' not in metrics.render()
    assert demand.record("team-a") is True  # a new lease of the name starts from scratch
