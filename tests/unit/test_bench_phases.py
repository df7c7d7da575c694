"""bench/phase_bench.py's reading of Server-Timing lines: phases by percentile, and the
answers that shared a work item told apart by their worker phases."""

from __future__ import annotations

from pathlib import Path

from bench.phase_bench import parse_server_timing, read_phases, summarize
from heron.runtime.http import server_timing


def test_the_header_heron_writes_reads_back() -> None:
    phases = {"coalesce": 0.0012, "queue_wait": 0.2, "inference": 0.25, "total": 0.46}
    assert parse_server_timing(server_timing(phases)) == {
        "coalesce": 1.2, "queue_wait": 200.0, "inference": 250.0, "total": 460.0}
    assert parse_server_timing("") == {}


def test_only_2xx_answers_count_and_statuses_are_tallied(tmp_path: Path) -> None:
    path = tmp_path / "phases"
    path.write_text("200 inference;dur=5.00, total;dur=6.00\n"
                    "429 \n"
                    "200 inference;dur=7.00, total;dur=9.00\n")
    answers, statuses = read_phases(path)
    assert statuses == {"200": 2, "429": 1}
    assert [a["total"] for a in answers] == [6.0, 9.0]


def test_percentiles_and_the_slowest_shared_work_items() -> None:
    # 100 answers alone (totals 1..100 ms), then 3 members of one shared work item whose
    # slowest answer (250 ms) is the slowest of all.
    answers = [{"queue_wait": float(i), "batch_wait": 0.0, "inference": 1.0 + i / 100,
                "total": float(i)} for i in range(1, 101)]
    answers += [{"queue_wait": 120.0, "batch_wait": 3.0, "inference": 90.0,
                 "total": total} for total in (230.0, 240.0, 250.0)]
    summary = summarize(answers, slowest=2)
    assert summary["answers"] == 103
    total = summary["phases"]["total"]
    assert (total["p50"], total["max"]) == (52.0, 250.0)
    assert total["p99"] == 240.0  # nearest rank: the 102nd of 103
    assert list(summary["phases"]) == ["queue_wait", "batch_wait", "inference", "total"]
    first, second = summary["slowest_work_items"]
    assert first == {"members": 3, "queue_wait": 120.0, "batch_wait": 3.0,
                     "inference": 90.0, "total_max": 250.0}
    assert (second["members"], second["total_max"]) == (1, 100.0)
    # 100 passes of one request each and one pass of the three.
    assert summary["requests_per_pass"] == {"passes": 101, "p50": 1, "max": 3}
    assert summarize([]) == {"answers": 0, "phases": {}, "requests_per_pass": {},
                             "slowest_work_items": []}
