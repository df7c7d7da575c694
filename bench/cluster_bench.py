"""Cluster benchmark: the gateway -> JetStream -> worker -> inbox path against the same
worker served directly, and Heron's own overhead with the null model.

    python -m bench.cluster_bench [--quick] [--out DIR]

1. ``heron up`` (default bundle, MiniLM) on free loopback ports, with ``--workers`` worker
   processes (default: as many as ``heron serve --workers auto`` runs, the CPUs split
   between them). wrk drives the gateway (cluster path) with single-text requests at 1, 8,
   32 and 64 connections, against the raw-model ceiling in the same layout. With one
   worker, it also drives that worker's own HTTP API (direct) and reports cluster / direct.
2. ``heron up --bundle null`` (no model compute): items/s through the cluster path with
   64-item requests, and the latency the cluster path adds at one connection.

``--split-cores``: the layout the cluster is deployed in (deploy/k8s), where the gateway and
NATS run on other nodes than the model, scaled down to one machine: one worker with one
torch thread, and nats-server, the config service, the gateway and wrk kept off the first
usable CPU (CPU 0 here). The worker runs with ``--inference-cpus`` set to that CPU
(worker.cpus): its inference thread has the core to itself while its event loop shares
the others. ``--free-inference``: the worker's threads free on all CPUs instead. The
ceiling is the raw model with one thread on that CPU: the same threads and precision.
The raw-model ceiling runs before the cluster starts and again after it stops; the JSON
records both (``ceiling.before_cluster``, ``ceiling.drift``), and a drift over 5% is
logged as a warning: the machine's speed changed, so the run's ratios are suspect.
``--pairs N`` (default 3; 0: none): then N interleaved pairs, each the ceiling (run while
the cluster sits idle) followed at once by a 64-client step on the cluster path; each
pair's ratio compares two measurements seconds apart, so a drift of the machine's speed
over minutes cancels out. The JSON's ``pairs`` holds them and their median ratio.
Prints one JSON document and writes DIR/cluster_bench.json (DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench.ceiling import best_ceiling, interleaved_pairs
from bench.load import run_wrk, write_bodies
from bench.server import REPO, free_port, http, on_cpus, pin_process
from bench.texts import LONG_TAIL, build_workload
from heron.cli.main import serve_processes, threads_per_process
from heron.worker.registry import cpu_has_native_bf16

DRIFT_WARN = 0.05  # ceiling before vs after the cluster: beyond this, the run is suspect


def log(message: str) -> None:
    print(f"[cluster_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


@contextlib.contextmanager
def local_cluster(bundle: str, data_dir: Path, workers: int = 1, threads: int = 0,
                  worker_cpus: set[int] | None = None,
                  other_cpus: set[int] | None = None,
                  inference_cpus: set[int] | None = None, extra_args: tuple[str, ...] = (),
                  extra_env: dict[str, str] | None = None,
                  tree: Path = REPO,
                  inference_threads: int = 0) -> Iterator[tuple[str, str]]:
    """(gateway URL, a worker's URL) of a ready ``heron up`` with ``workers`` workers of
    ``threads`` torch threads each (0: torch's default), each running up to
    ``inference_threads`` forward passes at once (0: the worker's default, one).
    ``worker_cpus`` and ``other_cpus``:
    where the workers and everything else (nats-server, config service, gateway) run.
    ``inference_cpus``: the workers' ``--inference-cpus`` (their other threads stay on
    ``other_cpus``). ``extra_args``/``extra_env``: more for ``heron up`` (``--nats URL``).
    ``tree``: run another checkout's code, first on its path (bench.revision_ab)."""
    env = {**os.environ, **(extra_env or {})}
    if tree != REPO:
        env["PYTHONPATH"] = str(tree)
    if threads:
        env["HERON_THREADS"] = str(threads)
    if inference_threads:
        env["HERON_INFERENCE_THREADS"] = str(inference_threads)
    if inference_cpus:
        env["HERON_INFERENCE_CPUS"] = ",".join(map(str, sorted(inference_cpus)))
    port, nats_port = free_port(), free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "up.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "heron.cli", "up", "--port", str(port), "--nats-port",
             str(nats_port), "--config-port", "0", "--data-dir", str(data_dir), "--bundle",
             bundle, "--workers", str(workers), "--min-workers", str(workers), *extra_args],
            stdout=out, stderr=subprocess.STDOUT, cwd=tree, preexec_fn=on_cpus(other_cpus),
            env=env)
    gateway = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        worker = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text())
            found = re.findall(r"worker \S+ starting \((http://[^)]+)\)", log_path.read_text())
            worker = found[0] if found else None
            with contextlib.suppress(OSError):
                if len(found) >= workers and http("GET", f"{gateway}/readyz",
                                                  timeout=2)[0] == 200 and all(
                        http("GET", f"{w}/readyz", timeout=2)[0] == 200 for w in found):
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"cluster not ready:\n{log_path.read_text()}")
        assert worker is not None
        if worker_cpus is not None and not inference_cpus:  # inherited other_cpus
            for child in psutil.Process(proc.pid).children(recursive=True):
                if " worker " in " ".join(child.cmdline()):
                    pin_process(child.pid, worker_cpus)
        yield gateway, worker
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(quick: bool, out: Path, long_tail: bool = False, workers: int = 1,
        split_cores: bool = False, free_inference: bool = False,
        pairs: int = 0) -> dict[str, Any]:
    duration = 4.0 if quick else 10.0
    connections = [1, 8, 32, 64]
    work = Path(tempfile.mkdtemp(prefix="heron-cluster-bench-"))
    texts = build_workload(256 if quick else 1024, **(LONG_TAIL if long_tail else {})).texts
    single = work / "single.txt"
    write_bodies(texts, single)
    result: dict[str, Any] = {"benchmark": "cluster_bench", "mode": "quick" if quick else "full",
                              "cpu_count": os.cpu_count(), "duration_s": duration,
                              "workload": "8-256 tokens (LONG_TAIL)" if long_tail
                              else "8-128 tokens"}
    threads = 0 if workers == 1 else threads_per_process(workers)
    worker_cpus = other_cpus = ceiling_cpus = inference_cpus = None
    if split_cores:
        # The CPUs this process may use (a cpuset need not start at 0 or be contiguous).
        worker_cpus = os.sched_getaffinity(0)
        if len(worker_cpus) < 2:
            raise SystemExit("cluster_bench --split-cores needs at least 2 usable CPUs")
        workers, threads, ceiling_cpus = 1, 1, {min(worker_cpus)}
        other_cpus = worker_cpus - ceiling_cpus
        inference_cpus = None if free_inference else ceiling_cpus
        where = ("its threads on any CPU" if free_inference else
                 f"its inference thread on CPU {min(worker_cpus)} (--inference-cpus), "
                 f"the rest of it on CPUs {sorted(other_cpus)}")
        result["layout"] = (f"split cores: 1 worker with 1 torch thread, {where}; "
                            "nats-server, config service, gateway and wrk on CPUs "
                            f"{sorted(other_cpus)}; the ceiling (1 thread) on CPU "
                            f"{min(worker_cpus)}")
    result.update(workers=workers, threads_per_worker=threads or "torch default")

    def step(url: str, bodies: Path, connections: int, duration_s: float) -> dict[str, Any]:
        return run_wrk(url, bodies, connections=connections, duration_s=duration_s,
                       cpus=other_cpus).summary()

    texts_file = work / "texts.json"
    texts_file.write_text(json.dumps(texts))
    # The ceiling before the cluster as well as after it: this machine's speed has drifted
    # by 5-12% within minutes, which would pass for a change in the ratio.
    expected_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"  # precision auto
    # Same budget both times: the ceiling is the best pass, and more passes find a better one.
    ceiling_s = 6.0 if quick else 20.0
    log("the raw-model ceiling before the cluster starts (drift check)")
    before = best_ceiling(texts_file, seconds=ceiling_s, dtype=expected_dtype,
                          processes=workers, threads=threads, cpus=ceiling_cpus)

    log(f"MiniLM: {workers} worker(s); gateway path" + (" and direct" if workers == 1 else ""))
    rows = []
    with local_cluster("default", work / "minilm", workers, threads, worker_cpus,
                       other_cpus, inference_cpus) as (gateway, worker):
        dtype = http("GET", f"{worker}/v1/models/minilm")[1].get("dtype")
        sides = {"cluster": f"{gateway}/v1/encode/minilm"}
        if workers == 1:
            sides["direct"] = f"{worker}/v1/encode/minilm"
        for path in sides.values():
            step(path, single, 8, 3.0)  # warm-up
        for c in connections:
            row: dict[str, Any] = {"connections": c}
            row.update({side: step(url, single, c, duration) for side, url in sides.items()})
            if "direct" in row:
                row["ratio"] = round(row["cluster"]["throughput_rps"]
                                     / max(row["direct"]["throughput_rps"], 1e-9), 3)
            log(f"c={c}: " + ", ".join(f"{side} {row[side]['throughput_rps']}/s"
                                        for side in sides))
            rows.append(row)
        if pairs:
            result["pairs"] = interleaved_pairs(
                pairs, lambda: best_ceiling(texts_file, seconds=ceiling_s / 2, dtype=dtype,
                                            processes=workers, threads=threads,
                                            cpus=ceiling_cpus)["sentences_per_s"],
                lambda: step(sides["cluster"], single, 64, duration), log=log)
    result["minilm"] = rows
    log(f"the raw-model ceiling ({dtype}), with the cluster stopped")
    ceiling = best_ceiling(texts_file, seconds=ceiling_s, dtype=dtype,
                           processes=workers, threads=threads, log=log, cpus=ceiling_cpus)
    result["ceiling"] = {k: ceiling[k] for k in ("sentences_per_s", "dtype", "batch_size",
                                                 "one_process", "server_layout")
                         if k in ceiling}
    if dtype == expected_dtype:
        drift = ceiling["sentences_per_s"] / before["sentences_per_s"] - 1
        result["ceiling"].update(before_cluster=before["sentences_per_s"], drift=round(drift, 3))
        if abs(drift) > DRIFT_WARN:
            log(f"warning: the ceiling moved {drift:+.1%} between before and after the "
                "cluster; the machine's speed drifted, so compare this run with care")
    else:
        log(f"no drift check: the worker ran {dtype}, the ceiling before it {expected_dtype}")
    for row in rows:
        for side in ("direct", "cluster"):
            if side in row:
                row[f"{side}_to_ceiling"] = round(row[side]["throughput_rps"]
                                                  / ceiling["sentences_per_s"], 3)

    log("null model: Heron's own overhead")
    batch = work / "batch64.txt"
    batch.write_text("".join(json.dumps({"items": texts[i:i + 64], "cache": False}) + "\n"
                             for i in range(0, len(texts) - 63, 64)))
    with local_cluster("null", work / "null", 1, 0, worker_cpus,
                       other_cpus, inference_cpus) as (gateway, worker):
        step(f"{gateway}/v1/encode/null-model", single, 8, 3.0)
        one_direct = step(f"{worker}/v1/encode/null-model", single, 1, duration)
        one_cluster = step(f"{gateway}/v1/encode/null-model", single, 1, duration)
        items = {}
        for c in (8, 32):
            s = step(f"{gateway}/v1/encode/null-model", batch, c, duration)
            items[c] = {"requests_per_s": s["throughput_rps"],
                        "items_per_s": round(s["throughput_rps"] * 64, 1),
                        "latency_ms": s["latency_ms"], "non_2xx": s["non_2xx"]}
            log(f"null, 64-item requests, c={c}: {items[c]['items_per_s']} items/s")
    result["null"] = {
        "one_connection": {"direct": one_direct, "cluster": one_cluster,
                           "added_p50_ms": round(one_cluster["latency_ms"]["p50"] -
                                                 one_direct["latency_ms"]["p50"], 2),
                           "added_p99_ms": round(one_cluster["latency_ms"]["p99"] -
                                                 one_direct["latency_ms"]["p99"], 2)},
        "items_per_s_64_item_requests": items,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_bench.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--long-tail", action="store_true",
                        help="8-256-token workload (median 32) instead of 8-128")
    parser.add_argument("--split-cores", action="store_true",
                        help="1 worker x 1 thread; gateway, NATS and wrk off the first CPU")
    parser.add_argument("--free-inference", action="store_true",
                        help="with --split-cores: the worker's threads free on all CPUs "
                             "(no --inference-cpus)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="interleaved (ceiling, 64-client cluster step) pairs after the "
                             "sweep (0: none)")
    parser.add_argument("--workers", default="auto",
                        help="worker processes (auto: as many as heron serve --workers auto)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so local_cluster stops the `heron up` it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workers = serve_processes(args.workers, "auto")
    print(json.dumps(run(args.quick, args.out, args.long_tail, workers, args.split_cores,
                         args.free_inference, args.pairs), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
