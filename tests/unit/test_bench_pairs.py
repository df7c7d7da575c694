"""The benchmarks' interleaved pairs (bench/ceiling.py; cluster_bench, serve_bench): each
ratio pairs a ceiling with the server step measured right after it, and the median is over
the pairs."""

from __future__ import annotations

from typing import Any

from bench.ceiling import interleaved_pairs


def test_each_ratio_pairs_a_ceiling_with_the_step_right_after_it() -> None:
    calls: list[str] = []
    ceilings = iter([200.0, 180.0, 220.0])  # the machine's speed drifting between pairs
    steps = iter([170.0, 162.0, 176.0])

    def ceiling() -> float:
        calls.append("ceiling")
        return next(ceilings)

    def step() -> dict[str, Any]:
        calls.append("server")
        return {"throughput_rps": next(steps), "latency_ms": {"p50": 1.0, "p99": 2.0},
                "non_2xx": 0}

    result = interleaved_pairs(3, ceiling, step)
    assert calls == ["ceiling", "server"] * 3
    assert [r["ratio"] for r in result["runs"]] == [0.85, 0.9, 0.8]
    assert result["median_ratio"] == 0.85
    assert result["connections"] == 64
