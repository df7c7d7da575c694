"""Serving benchmark: ``heron serve`` under closed-loop HTTP load vs. the raw-model ceiling.

    python -m bench.serve_bench [--quick] [--out DIR] [--plot]

1. Build a deterministic mixed-length workload (bench/texts.py).
2. Start ``heron serve`` on a free 127.0.0.1 port, wait for /readyz, warm up, then run wrk
   (bench/wrk_encode.lua: one text per POST /v1/encode/minilm) at each concurrency.
3. Stop the server, then measure the raw-model ceiling in its own process (bench/ceiling.py).
4. Print one JSON document and write it to DIR/serve_bench.json (DIR: bench/results/).

Progress goes to stderr; stdout carries only the JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.ceiling import best_ceiling, interleaved_pairs
from bench.load import find_wrk, run_wrk, write_bodies
from bench.server import Server, http, start_server
from bench.texts import LONG_TAIL, Workload, build_workload
from heron.cli.main import serve_processes, threads_per_process

MODEL = "minilm"
DEFAULT_OUT = Path(__file__).with_name("results")
# Per-step means of the worker's batch histograms: result key -> Prometheus histogram.
BATCH_METRICS = {"mean_batch_items": "heron_worker_batch_items",
                 "mean_padding_ratio": "heron_worker_batch_padding_ratio",
                 "mean_batch_inference_s": "heron_worker_batch_inference_seconds"}


@dataclass(frozen=True, slots=True)
class ServeBenchSettings:
    mode: str
    n_texts: int
    seed: int
    connections: tuple[int, ...]
    duration_s: float
    warmup_s: float
    wrk_threads: int
    ceiling_s: float
    ceiling_batch: int
    threads: int  # torch threads for server and ceiling; 0: torch's default
    long_tail: bool = False  # the 8-256-token workload (bench.texts.LONG_TAIL)
    workers: str = "auto"  # heron serve --workers
    pairs: int = 3  # interleaved (ceiling, 64-client step) pairs after the steps

    @property
    def layout(self) -> tuple[int, int]:
        """(server processes, torch threads each; 0: torch's default)."""
        processes = serve_processes(self.workers, "auto")
        if processes == 1:
            return 1, self.threads
        return processes, self.threads or threads_per_process(processes)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchSettings:
        quick = args.quick
        return cls(
            mode="quick" if quick else "full",
            n_texts=args.texts or (256 if quick else 1024),
            seed=args.seed,
            connections=tuple(int(c) for c in args.connections.split(",")),
            duration_s=args.duration or (4.0 if quick else 10.0),
            warmup_s=2.0 if quick else 5.0,
            wrk_threads=args.wrk_threads,
            ceiling_s=6.0 if quick else 20.0,
            ceiling_batch=32,
            threads=args.threads or int(os.environ.get("HERON_THREADS", "0") or 0),
            long_tail=args.long_tail,
            workers=args.workers,
            pairs=args.pairs,
        )


def log(message: str) -> None:
    print(f"[serve_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine_info() -> dict[str, Any]:
    model_name = ""
    try:
        with open("/proc/cpuinfo") as f:
            model_name = next((ln.split(":", 1)[1].strip() for ln in f
                               if ln.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": model_name,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }


def check_server(server: Server, workload: Workload) -> dict[str, Any]:
    """One real request (the longest text) before any load: fail early, not in wrk."""
    longest = max(range(len(workload.texts)), key=workload.tokens.__getitem__)
    status, body = http("POST", f"{server.url}/v1/encode/{MODEL}",
                        {"items": [workload.texts[longest]]})
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"encode check failed: HTTP {status}: {body!r}"[:2000])
    item = body["items"][0]
    info: dict[str, Any] = {"model_id": body.get("model"), "dims": len(item.get("dense", [])),
                            "tokens_match": item.get("tokens") == workload.tokens[longest]}
    status, desc = http("GET", f"{server.url}/v1/models/{MODEL}")
    if status == 200 and isinstance(desc, dict):
        info.update(device=desc.get("device"), dtype=desc.get("dtype"),
                    max_sequence_length=desc.get("max_sequence_length"))
    return info


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of the server: its process and, with --workers, the ones it started."""
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        try:
            times = p.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def load_steps(server: Server, bodies: Path, settings: ServeBenchSettings) -> list[dict[str, Any]]:
    url = f"{server.url}/v1/encode/{MODEL}"
    log(f"warm-up: {settings.warmup_s:g} s at 8 connections")
    run_wrk(url, bodies, connections=8, duration_s=settings.warmup_s,
            threads=settings.wrk_threads)
    proc = psutil.Process(server.pid)
    steps = []
    for connections in settings.connections:
        before = {name: server.metric_sums(name) for name in BATCH_METRICS.values()}
        cpu_before, started = _cpu_s(proc), time.monotonic()
        result = run_wrk(url, bodies, connections=connections, duration_s=settings.duration_s,
                         threads=settings.wrk_threads)
        server_cores = (_cpu_s(proc) - cpu_before) / (time.monotonic() - started)
        step = result.summary()
        step["server_cpu_cores"] = round(server_cores, 2)
        for key, name in BATCH_METRICS.items():  # server-side batching, when exposed
            first, last = before[name], server.metric_sums(name)
            if first and last and last[1] > first[1]:
                step[key] = round((last[0] - first[0]) / (last[1] - first[1]), 4)
                if key == "mean_batch_inference_s":  # share of wall time in forward passes
                    step["inference_busy"] = round((last[0] - first[0]) / result.duration_s, 3)
        (server.log_path.parent / f"wrk_c{connections}.txt").write_text(result.output)
        log(f"c={connections}: {step['throughput_rps']} req/s, p50 "
            f"{step['latency_ms']['p50']} ms, p99 {step['latency_ms']['p99']} ms, "
            f"non-2xx {step['non_2xx']}, socket errors {sum(step['socket_errors'].values())}")
        steps.append(step)
    return steps


def run_ceiling(texts_file: Path, settings: ServeBenchSettings, dtype: str | None,
                seconds: float | None = None) -> dict[str, Any]:
    """The raw model at the precision the server reported (``dtype``), in its layout."""
    processes, threads = settings.layout
    return best_ceiling(texts_file, seconds=seconds or settings.ceiling_s, dtype=dtype,
                        processes=processes, threads=threads,
                        batch_size=settings.ceiling_batch, log=log)


def run(settings: ServeBenchSettings, out: Path) -> dict[str, Any]:
    find_wrk()  # fail before any work if it is missing
    machine = machine_info()
    log(f"workload: {settings.n_texts} texts (seed {settings.seed})")
    shape = LONG_TAIL if settings.long_tail else {}
    workload = build_workload(settings.n_texts, seed=settings.seed, **shape)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="heron-bench-") as tmp:
        bodies, texts_file = Path(tmp) / "bodies.jsonl", Path(tmp) / "texts.json"
        write_bodies(workload.texts, bodies)
        texts_file.write_text(json.dumps(workload.texts))
        log("starting heron serve")
        with start_server(out / "server.log", threads=settings.threads,
                          workers=settings.workers) as server:
            log(f"server pid {server.pid} ready on {server.url}")
            server_info = check_server(server, workload)
            steps = load_steps(server, bodies, settings)
            pairs = None
            if settings.pairs:
                pairs = interleaved_pairs(
                    settings.pairs,
                    lambda: run_ceiling(texts_file, settings, server_info.get("dtype"),
                                        seconds=settings.ceiling_s / 2)["sentences_per_s"],
                    lambda: run_wrk(f"{server.url}/v1/encode/{MODEL}", bodies,
                                    connections=64, duration_s=settings.duration_s,
                                    threads=settings.wrk_threads).summary(), log=log)
        log("server stopped; measuring the raw-model ceiling")
        ceiling = run_ceiling(texts_file, settings, server_info.get("dtype"))
    log(f"ceiling: {ceiling['sentences_per_s']} sentences/s")
    machine.update(torch_version=ceiling["torch_version"], torch_threads=ceiling["torch_threads"],
                   loadavg_after=[round(x, 2) for x in os.getloadavg()])
    for step in steps:
        step["ratio_to_ceiling"] = round(step["throughput_rps"] / ceiling["sentences_per_s"], 3)
    return {
        "benchmark": "serve_bench",
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": settings.mode,
        "model": MODEL,
        "machine": machine,
        "workload": {**workload.stats(), "seed": settings.seed,
                     "distribution": workload_text(settings)},
        "settings": {"duration_s": settings.duration_s, "warmup_s": settings.warmup_s,
                     "wrk_threads": settings.wrk_threads, "items_per_request": 1,
                     "server_threads": settings.threads or "torch default",
                     "server_processes": settings.layout[0],
                     "threads_per_process": settings.layout[1] or "torch default",
                     "ceiling_batch_size": settings.ceiling_batch},
        "server": server_info,
        "concurrency": steps,
        "ceiling": ceiling,
        "ratio": {str(s["connections"]): s["ratio_to_ceiling"] for s in steps},
        "pairs": pairs,
    }


def workload_text(settings: ServeBenchSettings) -> str:
    if settings.long_tail:
        return (f"log-normal target lengths, median {LONG_TAIL['median_tokens']} tokens, "
                f"sigma {LONG_TAIL['sigma']}, clipped to [8, {LONG_TAIL['max_tokens']}]")
    return "log-normal target lengths, median 20 tokens, clipped to [8, 128]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter steps, fewer texts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--plot", action="store_true", help="also write serve_bench.png")
    parser.add_argument("--connections", default="1,8,32,64", help="comma-separated")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--texts", type=int, default=0, help="workload size")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--long-tail", action="store_true",
                        help="8-256-token workload (median 32) instead of 8-128 (median 20)")
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--workers", default="auto",
                        help="heron serve --workers (auto: as shipped)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="interleaved (ceiling with the server idle, 64-client step) "
                             "pairs after the steps (0: none)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for server and ceiling (0: torch's default)")
    args = parser.parse_args(argv)
    settings = ServeBenchSettings.from_args(args)
    try:
        result = run(settings, args.out)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        log(f"failed: {exc}")
        return 1
    text = json.dumps(result, indent=2)
    (args.out / "serve_bench.json").write_text(text + "\n")
    print(text)
    if args.plot:
        from bench.plot import plot

        png = args.out / "serve_bench.png"
        log(f"plot written to {png}" if plot(result, png)
            else "--plot: matplotlib is not installed; no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
