"""Folding config deltas into a snapshot: newer applies once; twice or late changes nothing."""

from __future__ import annotations

import copy

from heron.runtime.configsync import apply_delta
from heron.runtime.protocol import ConfigDelta


def snapshot() -> dict:
    return {"epoch": 3, "models": {"a": {"id": "a"}},
            "bundles": {"b1": {"adapters": ["dense"], "models": ["a"], "hash": "h3"}}}


def delta(epoch: int, model_id: str = "m", bundles: tuple[str, ...] = ("b1",)) -> ConfigDelta:
    return ConfigDelta(epoch, {"id": model_id, "adapter": "dense"}, bundles,
                       {b: f"h{epoch}" for b in bundles})


def test_a_newer_delta_applies() -> None:
    snap = snapshot()
    assert apply_delta(snap, delta(4))
    assert snap["epoch"] == 4 and snap["models"]["m"]["adapter"] == "dense"
    assert snap["bundles"]["b1"]["models"] == ["a", "m"] and snap["bundles"]["b1"]["hash"] == "h4"


def test_twice_or_late_changes_nothing() -> None:
    snap = snapshot()
    apply_delta(snap, delta(4))
    after = copy.deepcopy(snap)
    assert not apply_delta(snap, delta(4))  # the same delta again
    assert not apply_delta(snap, delta(2, "old"))  # an old one, late
    assert snap == after


def test_new_bundle_in_a_delta_is_created() -> None:
    snap = snapshot()
    assert apply_delta(snap, delta(5, bundles=("b1", "b2")))
    assert snap["bundles"]["b2"]["models"] == ["m"] and snap["bundles"]["b2"]["hash"] == "h5"
