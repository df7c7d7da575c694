"""The worker's result cache (worker/result_cache.py) under a workload where a share of the
texts repeat: items/s of `heron serve` with the cache on (the default) against the same
server with ``--result-cache-bytes 0``.

    python -m bench.cache_bench [--quick] [--rounds N] [--duration S] [--connections C]
                                [--workers 1|auto] [--repeat 0.2] [--batch N] [--out DIR]

The workload: ``--batch`` texts per request (default 1; bench/texts.py's mixed 8-128-token
texts). Each step gets texts of its own (no text of an earlier step comes back); inside a
step, a share ``--repeat`` of the texts repeat one sent in the last ``--window`` texts (a
re-submitted document, a popular query), the others are new. A hit skips the model but not
the request's HTTP, parsing and tokenization, so the gain grows with the share of a
request's cost that is compute: larger with ``--batch 32`` (a corpus re-indexed in
batches) than with single-text requests. Both servers are up at once
(the idle one costs nothing but memory) and their steps alternate, each round starting
with the other one, so the machine's drift cancels out in the median ratio.

With ``--workers auto`` each process has a cache of its own and wrk's connections are
spread over the processes, so a repeat finds its text only when it reaches the process
that computed it: the default ``--workers 1`` measures the cache itself.

wrk drives both (one thread). Prints one JSON document and writes DIR/cache_bench.json
(DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.load import run_wrk
from bench.server import REPO, Server, http, start_server
from bench.texts import build_workload

CACHE_ITEMS = re.compile(r'^heron_worker_result_cache_items_total\{result="(\w+)"\} (\S+)$')


def log(message: str) -> None:
    print(f"[cache_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_step_bodies(base: list[str], step: int, n: int, repeat: float, window: int,
                      path: Path, batch: int = 1) -> float:
    """Encode bodies of ``batch`` texts, ``n`` texts in all, for one step; returns the
    share of texts that repeat."""
    rng = random.Random(step)
    fresh = iter(f"{t} (step {step})" for t in base)  # new to this step's server
    sent: list[str] = []
    repeats = 0
    for _ in range(n):
        if sent and rng.random() < repeat:
            sent.append(sent[rng.randrange(max(0, len(sent) - window), len(sent))])
            repeats += 1
        else:
            sent.append(next(fresh))
    path.write_text("".join(json.dumps({"items": sent[i:i + batch]}) + "\n"
                            for i in range(0, len(sent) - batch + 1, batch)))
    return repeats / n


def cache_counts(server: Server) -> dict[str, float]:
    status, text = http("GET", f"{server.url}/metrics", timeout=10.0)
    counts = {"hit": 0.0, "join": 0.0, "miss": 0.0}
    if status == 200 and isinstance(text, str):
        for line in text.splitlines():
            match = CACHE_ITEMS.match(line)
            if match:
                counts[match.group(1)] += float(match.group(2))
    return counts


def run_step(server: Server, bodies: Path, connections: int, duration: float
             ) -> dict[str, Any]:
    before = cache_counts(server)
    summary = run_wrk(f"{server.url}/v1/encode/minilm", bodies, connections=connections,
                      duration_s=duration).summary()
    after = cache_counts(server)
    summary["cache"] = {k: int(after[k] - before[k]) for k in after}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 5 s steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per step")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", default="1", help="heron serve --workers")
    parser.add_argument("--repeat", type=float, default=0.2,
                        help="share of requests that repeat a recent text")
    parser.add_argument("--window", type=int, default=1000,
                        help="a repeat is of one of this many previous requests")
    parser.add_argument("--batch", type=int, default=1, help="texts per request")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    rounds, duration = (1, 5.0) if args.quick else (args.rounds, args.duration)
    # More bodies than a step can send (a CPU serves a few hundred a second): wrk cycles
    # through its file, and a second pass would repeat every text.
    per_step = max(2000, int(duration * 1500))
    log(f"building {per_step} texts")
    base = list(dict.fromkeys(build_workload(per_step).texts))
    configs = {"cache_on": (), "cache_off": ("--result-cache-bytes", "0")}
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with start_server(work / "on.log", workers=args.workers,
                          extra_args=configs["cache_on"]) as on, \
                start_server(work / "off.log", workers=args.workers,
                             extra_args=configs["cache_off"]) as off:
            servers = {"cache_on": on, "cache_off": off}
            # Warm both (first requests of a process are slower), on texts of no step.
            warm = work / "warm.jsonl"
            write_step_bodies(base, 10_000, 500, 0.0, 1, warm)
            for server in servers.values():
                run_wrk(f"{server.url}/v1/encode/minilm", warm, connections=8,
                        duration_s=2.0)
            step = 0
            for r in range(rounds):
                order = list(configs) if r % 2 == 0 else list(reversed(configs))
                for name in order:
                    step += 1
                    bodies = work / f"step{step}.jsonl"
                    share = write_step_bodies(base, step, per_step, args.repeat,
                                              args.window, bodies, args.batch)
                    result = run_step(servers[name], bodies, args.connections, duration)
                    result["items_per_s"] = round(result["throughput_rps"] * args.batch, 1)
                    result.update(round=r, step=step, repeat_share=round(share, 3))
                    steps[name].append(result)
                    log(f"round {r} {name}: {result['items_per_s']} items/s p50 "
                        f"{result['latency_ms']['p50']} p99 {result['latency_ms']['p99']} ms "
                        f"cache {result['cache']}")
    ratios = [a["items_per_s"] / b["items_per_s"]
              for a, b in zip(steps["cache_on"], steps["cache_off"], strict=True)
              if b["items_per_s"]]
    report = {
        "bench": "cache_bench",
        "workers": args.workers, "connections": args.connections, "duration_s": duration,
        "repeat": args.repeat, "window": args.window, "batch": args.batch, "rounds": rounds,
        "items_per_s": {name: [s["items_per_s"] for s in runs]
                        for name, runs in steps.items()},
        "median_ratio_on_off": round(statistics.median(ratios), 3) if ratios else None,
        "steps": steps,
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cache_bench.json" if args.batch == 1 else f"cache_bench_batch{args.batch}.json"
    (args.out / name).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
