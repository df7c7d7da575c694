"""LoopHistogram renders what prometheus_client's Histogram renders for the same
observations (the gateway's latency and phase histograms)."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from heron.runtime.loop_histogram import LoopHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


def test_the_same_text_as_prometheus_clients_histogram() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "help text", ["phase", "model"], buckets=BUCKETS,
                          registry=theirs)
    loop = LoopHistogram("h_seconds", "help text", ["phase", "model"], buckets=BUCKETS,
                         registry=ours)
    rng = random.Random(5)
    values = [*BUCKETS, 0.0, -1.0, 1e9, math.inf, math.nan,
              *(rng.lognormvariate(-5, 2) for _ in range(2000))]
    for value in values:
        labels = (rng.choice(["publish", "inference"]), rng.choice(["m/a", 'm"b']))
        reference.labels(*labels).observe(value)
        loop.labels(*labels).observe(value)
    assert _without_created(generate_latest(ours)) == _without_created(generate_latest(theirs))
    assert "h_seconds_bucket" in generate_latest(ours).decode()


def test_labels_are_checked_and_removed() -> None:
    loop = LoopHistogram("x_seconds", "x", ["pool"], buckets=(1, 2), registry=CollectorRegistry())
    with pytest.raises(ValueError):
        loop.labels("a", "b")
    loop.labels("a").observe(1.5)
    assert loop.labels("a").counts == [0, 1, 0]
    loop.remove("a")
    assert loop.labels("a").counts == [0, 0, 0]
