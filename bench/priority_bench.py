"""Priority benchmark: under saturation, priority-0 requests' latency against priority-1's.

    python -m bench.priority_bench [--quick] [--out DIR]

``heron serve`` (default bundle, MiniLM) is saturated by 64 closed-loop clients sending
single-text requests: 16 at priority 0 and 48 at priority 1, for 20 s (``--quick``: 8 s)
after a warm-up. An asyncio client (httpx) drives them. It shares the CPU with the server,
so absolute throughput is lower than with wrk; the comparison between priorities is the
point. Target: priority 0's p99 under a third of priority 1's.

Prints one JSON document and writes DIR/priority_bench.json (DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.server import REPO, start_server
from bench.texts import build_workload


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(url: str, texts: list[str], clients: dict[int, int], seconds: float,
                warmup_s: float) -> dict[int, list[float]]:
    latencies: dict[int, list[float]] = {p: [] for p in clients}
    limits = httpx.Limits(max_connections=sum(clients.values()))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        started = time.monotonic()
        stop = started + warmup_s + seconds

        async def one_client(priority: int, n: int) -> None:
            i = n
            while time.monotonic() < stop:
                body = {"items": [texts[i % len(texts)]], "priority": priority}
                t0 = time.monotonic()
                r = await client.post("/v1/encode/minilm", json=body)
                r.raise_for_status()
                if t0 >= started + warmup_s:
                    latencies[priority].append(time.monotonic() - t0)
                i += 7

        await asyncio.gather(*(one_client(p, n) for p, count in clients.items()
                               for n in range(count)))
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = 8.0 if args.quick else 20.0
    clients = {0: 16, 1: 48}
    texts = build_workload(1024).texts
    with start_server(args.out / "priority_bench_serve.log") as server:
        latencies = asyncio.run(drive(server.url, texts, clients, seconds, warmup_s=3.0))
    report: dict[str, Any] = {"benchmark": "priority_bench", "seconds": seconds,
                              "clients": {str(p): c for p, c in clients.items()}}
    for priority, values in latencies.items():
        report[f"priority_{priority}"] = {
            "requests": len(values), "throughput_rps": round(len(values) / seconds, 1),
            "p50_ms": round(percentile(values, 0.5) * 1000, 1),
            "p99_ms": round(percentile(values, 0.99) * 1000, 1)}
    report["p99_ratio_p0_to_p1"] = round(report["priority_0"]["p99_ms"]
                                         / report["priority_1"]["p99_ms"], 3)
    (args.out / "priority_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
