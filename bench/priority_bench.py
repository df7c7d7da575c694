"""Priority benchmark: under saturation, priority-0 requests' latency against priority-1's.

    python -m bench.priority_bench [--quick] [--workers auto|N] [--cluster] [--out DIR]

``heron serve`` (default bundle, MiniLM, as shipped) is saturated by 256 closed-loop wrk
connections sending single-text requests at once: 16 at priority 0 and 240 at priority 1,
for 20 s (``--quick``: 8 s) after a warm-up. Saturated means more work waits than one
batch takes (64 items): with 64 connections every queued item fits the next batch and
priority has nothing to reorder (p0 and p1 measured alike). wrk is a C load generator: an
asyncio Python client took most of the CPU it shared with the server and never saturated
it. Target: priority 0's p99 under a third of priority 1's. ``--cluster``: the same load
through ``heron up`` in its default layout (one gateway; one worker running as many passes
at once as ``heron serve`` runs processes, bench.coalesce_bench.layouts), where small
requests are coalesced into shared work items (only requests of one priority share).

Prints one JSON document and writes DIR/priority_bench.json (DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench.cluster_bench import local_cluster
from bench.coalesce_bench import layouts
from bench.load import WrkResult, run_wrk
from bench.server import REPO, start_server
from bench.texts import build_workload
from heron.cli.main import serve_processes


def write_priority_bodies(texts: list[str], priority: int, path: Path) -> None:
    """``cache: false``: wrk cycles through its texts, and the result cache would answer
    the repeats without the scheduler this measures (2,000 requests/s, all hits)."""
    path.write_text("".join(json.dumps({"items": [t], "priority": priority,
                                        "cache": False}) + "\n" for t in texts))


def drive(url: str, bodies: dict[int, Path], clients: dict[int, int],
          seconds: float) -> dict[int, WrkResult]:
    """One wrk per priority, all at once."""
    results: dict[int, WrkResult] = {}

    def one(priority: int) -> None:
        results[priority] = run_wrk(url, bodies[priority], connections=clients[priority],
                                    duration_s=seconds)

    threads = [threading.Thread(target=one, args=(p,)) for p in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--workers", default="auto", help="heron serve --workers")
    parser.add_argument("--cluster", action="store_true",
                        help="through heron up (gateway, JetStream, workers)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = 8.0 if args.quick else 20.0
    clients = {0: 16, 1: 240}
    texts = build_workload(1024).texts
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.cluster:
            gateway, _ = stack.enter_context(local_cluster(
                "default", Path(tmp) / "up",
                **layouts(serve_processes(args.workers, "cpu"))["up"]))
            url = f"{gateway}/v1/encode/minilm"
        else:
            server = stack.enter_context(start_server(args.out / "priority_bench_serve.log",
                                                      workers=args.workers))
            url = f"{server.url}/v1/encode/minilm"
        bodies = {p: Path(tmp) / f"p{p}.jsonl" for p in clients}
        for p, path in bodies.items():
            write_priority_bodies(texts, p, path)
        drive(url, bodies, clients, 3.0)  # warm-up
        results = drive(url, bodies, clients, seconds)
    report: dict[str, Any] = {"benchmark": "priority_bench", "seconds": seconds,
                              "workers": args.workers,
                              "path": "heron up" if args.cluster else "heron serve",
                              "clients": {str(p): c for p, c in clients.items()}}
    for priority, result in results.items():
        summary = result.summary()
        report[f"priority_{priority}"] = {
            "requests": summary["requests"], "throughput_rps": summary["throughput_rps"],
            "p50_ms": summary["latency_ms"]["p50"], "p99_ms": summary["latency_ms"]["p99"],
            "non_2xx": summary["non_2xx"]}
    report["p99_ratio_p0_to_p1"] = round(report["priority_0"]["p99_ms"]
                                         / report["priority_1"]["p99_ms"], 3)
    name = "priority_bench_cluster.json" if args.cluster else "priority_bench.json"
    (args.out / name).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
