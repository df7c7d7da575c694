"""Where a request's time goes under load: every answer's Server-Timing, phase by phase.

    python -m bench.phase_bench [--side up|serve|both] [--connections 64] [--duration 15]
                                [--steps 2] [--out DIR]

MiniLM (the default bundle), one mixed-length text (8-128 tokens) a request, wrk in a
closed loop with one thread, as bench/coalesce_bench.py drives it; `heron up` in that
bench's layout (one gateway, as many single-thread workers as `heron serve --workers
auto` runs processes). wrk_encode.lua writes each answer's status and Server-Timing
(HERON_WRK_PHASES). Per step: wrk's own latency summary, each phase's p50 / p90 / p99 /
max (milliseconds), and the work items of the slowest answers: the requests that shared
one work item share its worker phases, so answers with the same ``queue_wait``,
``batch_wait`` and ``inference`` are counted as one work item's members; and the requests
a forward pass answered (those with the same ``inference``: a pass's time, to 10 µs).

Writes DIR/phase_bench.json (DIR: bench/results/) and prints it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.cluster_bench import local_cluster
from bench.load import run_wrk, write_bodies
from bench.server import REPO, start_server
from bench.texts import build_workload, percentile
from heron.cli.main import serve_processes, threads_per_process

# The phases a gateway's answer names (gateway/metrics.PHASES, then its total) and those of
# a worker's or `heron serve`'s; the table lists the ones present, in this order.
PHASE_ORDER = ("coalesce", "publish", "queue_wait", "tokenize", "batch_wait", "inference",
               "postprocess", "total")
SHARED_KEY = ("queue_wait", "batch_wait", "inference")
SLOWEST = 8  # work items listed, slowest answer first
_ENTRY = re.compile(r"([A-Za-z_][\w-]*);dur=([0-9.]+)")


def log(message: str) -> None:
    print(f"[phase_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_server_timing(header: str) -> dict[str, float]:
    """``tokenize;dur=0.62, inference;dur=3.10`` -> {phase: milliseconds}."""
    return {name: float(ms) for name, ms in _ENTRY.findall(header)}


def read_phases(path: Path) -> tuple[list[dict[str, float]], dict[str, int]]:
    """The Server-Timing of each 2xx answer in a HERON_WRK_PHASES file, and the count of
    answers by status."""
    answers: list[dict[str, float]] = []
    statuses: dict[str, int] = defaultdict(int)
    for line in path.read_text().splitlines():
        status, _, header = line.partition(" ")
        statuses[status] += 1
        if status.startswith("2"):
            answers.append(parse_server_timing(header))
    return answers, dict(statuses)


def summarize(answers: list[dict[str, float]], slowest: int = SLOWEST) -> dict[str, Any]:
    """Each phase's p50 / p90 / p99 / max over ``answers`` (a phase an answer lacks counts
    as 0 there), and the ``slowest`` work items by their slowest member's total."""
    if not answers:
        return {"answers": 0, "phases": {}, "requests_per_pass": {}, "slowest_work_items": []}
    present = {name for answer in answers for name in answer}
    phases = {}
    for name in [p for p in PHASE_ORDER if p in present]:
        ordered = sorted(answer.get(name, 0.0) for answer in answers)
        phases[name] = {"p50": percentile(ordered, 50), "p90": percentile(ordered, 90),
                        "p99": percentile(ordered, 99), "max": ordered[-1]}
    items: dict[tuple[float, ...], list[dict[str, float]]] = defaultdict(list)
    for answer in answers:
        items[tuple(answer.get(name, 0.0) for name in SHARED_KEY)].append(answer)
    ranked = sorted(items.items(), key=lambda kv: -max(a.get("total", 0.0) for a in kv[1]))
    passes: dict[float, int] = defaultdict(int)  # one forward pass's time: its requests'
    for answer in answers:
        if "inference" in answer:
            passes[answer["inference"]] += 1
    sizes = sorted(passes.values())
    return {"answers": len(answers), "phases": phases, "requests_per_pass": {
        "passes": len(sizes), "p50": percentile(sizes, 50), "max": sizes[-1]} if sizes else {},
        "slowest_work_items": [
        {"members": len(members), **dict(zip(SHARED_KEY, key, strict=True)),
         "total_max": max(a.get("total", 0.0) for a in members)}
        for key, members in ranked[:slowest]]}


def measure(url: str, bodies: Path, connections: int, duration_s: float, steps: int,
            work: Path, side: str) -> list[dict[str, Any]]:
    run_wrk(url, bodies, connections=16, duration_s=3.0)  # warm-up
    out = []
    for index in range(steps):
        path = work / f"{side}-{index}.phases"
        result = run_wrk(url, bodies, connections=connections, duration_s=duration_s,
                         phases_path=path)
        answers, statuses = read_phases(path)
        wrk = result.summary()
        row = {"side": side, "step": index, "wrk": wrk, "statuses": statuses,
               **summarize(answers)}
        phases = row["phases"]
        log(f"{side} step {index}: {wrk['throughput_rps']}/s, p99 "
            f"{wrk['latency_ms']['p99']} ms; requests a pass "
            f"{row['requests_per_pass'].get('p50')}; phase p99s " + ", ".join(
                f"{name} {values['p99']:.0f}" for name, values in phases.items()))
        out.append(row)
    return out


def run(side: str, connections: int, duration_s: float, steps: int,
        out: Path) -> dict[str, Any]:
    workers = serve_processes("auto", "cpu")
    work = Path(tempfile.mkdtemp(prefix="heron-phase-bench-"))
    bodies = work / "single.txt"
    write_bodies(build_workload(1024).texts, bodies)
    result: dict[str, Any] = {"benchmark": "phase_bench", "connections": connections,
                              "duration_s": duration_s, "workers": workers,
                              "workload": "MiniLM, one text per request, 8-128 tokens",
                              "steps": []}
    if side in ("serve", "both"):
        with start_server(work / "serve.log") as server:
            result["steps"] += measure(f"{server.url}/v1/encode/minilm", bodies,
                                       connections, duration_s, steps, work, "serve")
    if side in ("up", "both"):
        with local_cluster("default", work / "up", workers,
                           threads_per_process(workers)) as (gateway, _):
            result["steps"] += measure(f"{gateway}/v1/encode/minilm", bodies, connections,
                                       duration_s, steps, work, "up")
    out.mkdir(parents=True, exist_ok=True)
    (out / "phase_bench.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("up", "serve", "both"), default="both")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.side, args.connections, args.duration, args.steps, args.out),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
