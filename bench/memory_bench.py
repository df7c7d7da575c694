"""Memory benchmark: RSS drift under sustained load, and models rotating under a budget.

    python -m bench.memory_bench [--quick] [--out DIR]

Both parts run ``heron serve --workers 1``: the RSS and the budget are a worker process's.

1. ``heron serve`` (default bundle, MiniLM, default precision) under wrk at 64 connections:
   20,000 warm-up requests, then 50,000 measured (``--quick``: 4,000 and 10,000). The
   server's RSS is sampled every 2 s. Drift = the last sample against the first measured
   one. Target: under 5%. The warm-up is reported too: kernel caches (oneDNN builds one per
   batch shape) fill during it.
2. ``heron serve`` with three MiniLM-sized models (three ids over MiniLM's weights) and
   ``HERON_MODEL_MEMORY_BUDGET`` at 2.5 models: an SDK client calls them in rotation.
   Target: zero errors; evictions counted in /metrics.

Prints one JSON document and writes DIR/memory_bench.json (DIR: bench/results/); with
matplotlib installed, also DIR/memory_bench.png (RSS over requests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.load import run_wrk, write_bodies
from bench.server import REPO, http, start_server
from bench.texts import build_workload
from heron_sdk import Client, HeronError


def log(message: str) -> None:
    print(f"[memory_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"{re.escape(name)}[{{ ]", line) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_drift(out: Path, total_requests: int, warmup_requests: int) -> dict[str, Any]:
    texts = build_workload(1024).texts
    bodies = out / "memory_bench_bodies.txt"
    write_bodies(texts, bodies)
    samples: list[tuple[int, float]] = []  # (requests answered so far, RSS MB)
    with start_server(out / "memory_bench_serve.log", workers="1") as server:
        proc = psutil.Process(server.pid)
        # One model's weights at the precision served: what the rotation's budget is sized by.
        model_bytes = int(metric(http("GET", f"{server.url}/metrics")[1],
                                 "heron_worker_model_memory_bytes"))
        url = f"{server.url}/v1/encode/minilm"
        done = threading.Event()

        def sample() -> None:
            while not done.wait(2.0):
                text = http("GET", f"{server.url}/metrics")[1]
                answered = int(metric(text, "heron_worker_requests_total", status="200"))
                samples.append((answered, proc.memory_info().rss / 1e6))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        answered, steps = 0, []
        while answered < warmup_requests + total_requests:
            result = run_wrk(url, bodies, connections=64, duration_s=20)
            steps.append(result.summary())
            answered += result.requests
            log(f"{answered} requests, RSS {proc.memory_info().rss / 1e6:.0f} MB")
        done.set()
        sampler.join()
    first = samples[0][1]
    warm = next((mb for n, mb in samples if n >= warmup_requests), samples[-1][1])
    last = samples[-1][1]
    return {"requests": answered, "warmup_requests": warmup_requests,
            "model_bytes": model_bytes,
            "rss_mb_first": round(first, 1), "rss_mb_after_warmup": round(warm, 1),
            "rss_mb_end": round(last, 1), "rss_mb_max": round(max(mb for _, mb in samples), 1),
            "warmup_growth_percent": round(100 * (warm - first) / first, 2),
            "drift_percent": round(100 * (last - warm) / warm, 2),
            "throughput_rps": round(sum(s["requests"] for s in steps)
                                    / sum(s["duration_s"] for s in steps), 1),
            "samples": [[n, round(mb, 1)] for n, mb in samples]}


def rotation(out: Path, rounds: int, model_bytes: int) -> dict[str, Any]:
    models = {"rot/mean": "mean", "rot/cls": "cls", "rot/last": "last"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "models").mkdir()
        minilm = yaml.safe_load((REPO / "bundles/models/all-minilm-l6-v2.yaml").read_text())
        names = []
        for model_id, pooling in models.items():
            name = model_id.replace("/", "-") + ".yaml"
            (root / "models" / name).write_text(yaml.safe_dump({
                "id": model_id, "adapter": "dense", "source": minilm["source"],
                "profiles": {"default": {"pooling": pooling}}}))
            names.append(name)
        (root / "rot.yaml").write_text(
            f"name: rot\nmodels: [{', '.join(names)}]\npreload: []\n")
        budget = int(model_bytes * 2.5)
        os.environ["HERON_MODEL_MEMORY_BUDGET"] = str(budget)
        try:
            with start_server(out / "memory_bench_rotation.log", workers="1",
                              bundle=str(root / "rot.yaml")) as server:
                errors, calls, started = 0, 0, time.monotonic()
                with Client(server.url, timeout=60) as client:
                    for _ in range(rounds):
                        for model_id in models:
                            try:
                                client.encode(model_id, ["rotate through three models"] * 8)
                            except HeronError as exc:
                                errors += 1
                                log(f"error: {exc!r}")
                            calls += 1
                elapsed = time.monotonic() - started
                text = http("GET", f"{server.url}/metrics")[1]
                evictions = {reason: int(metric(text, "heron_worker_model_evictions_total",
                                                reason=reason))
                             for reason in ("budget", "memory", "idle")}
                resident = metric(text, "heron_worker_model_memory_bytes")
        finally:
            os.environ.pop("HERON_MODEL_MEMORY_BUDGET", None)
    return {"models": len(models), "budget_bytes": budget, "calls": calls, "errors": errors,
            "evictions": evictions, "resident_bytes_end": int(resident),
            "seconds": round(elapsed, 1),
            "seconds_per_call": round(elapsed / calls, 3)}


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    samples = report["rss_drift"]["samples"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([n for n, _ in samples], [mb for _, mb in samples], marker=".")
    ax.set_xlabel("requests answered")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title(f"heron serve RSS under load: drift {report['rss_drift']['drift_percent']}%")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    drift = rss_drift(args.out, 10_000 if args.quick else 50_000,
                      4_000 if args.quick else 20_000)
    report = {"benchmark": "memory_bench", "rss_drift": drift,
              "rotation": rotation(args.out, 10 if args.quick else 40, drift["model_bytes"])}
    text = json.dumps(report)
    (args.out / "memory_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.out / "memory_bench.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
