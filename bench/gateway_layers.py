"""Where a gateway's CPU goes, layer by layer: `heron up` (null model) with the gateway cut
short at one layer at a time (bench/gateway_stubs.py), wrk at 32 clients, one text a
request.

    python -m bench.gateway_layers [--rounds N] [--duration S] [--out DIR]

Modes, each adding a layer to the one before: ``route`` (the HTTP edge, the front, model
and pool resolution), ``dispatch`` (the dispatch and the answer's assembly), ``wake`` (a
request's suspension and wake-up), ``coalesce`` (coalescing, the shared work item's
result decoded and split, answered in-process), ``full`` (NATS, the workers). Each step
records requests/s, the gateway's CPU a request (user and system, /proc) and how often
it was preempted a request (involuntary context switches). The modes run in turn, the
order turning each round; the JSON holds every step and each mode's medians. Writes
DIR/gateway_layers.json (DIR: bench/results/).

A stubbed step is not a server anyone runs: only the differences between modes mean
something, and only on the same machine in the same minutes (its speed varies by 2.5
times from day to day).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.cluster_bench import local_cluster
from bench.gateway_stubs import MODES
from bench.load import run_wrk, write_bodies
from bench.revision_ab import processes
from bench.server import REPO
from bench.texts import build_workload
from heron.cli.main import threads_per_process

# The gateway process only ("gateway" is its subcommand), before anything is imported.
# Python reports an exception in sitecustomize and goes on, which would measure the whole
# path under a stub's name: a stub that fails to install stops the gateway instead.
SITECUSTOMIZE = """import os, sys, traceback
if os.environ.get("HERON_BENCH_STUB") and "gateway" in sys.orig_argv:
    try:
        from bench.gateway_stubs import install
        install(os.environ["HERON_BENCH_STUB"])
    except BaseException:
        traceback.print_exc()
        os._exit(3)
"""
CLIENTS = 32
WORKERS = 2  # heron up's default on 2 cores


def log(message: str) -> None:
    print(f"[gateway_layers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def gateway_counters(gateway: psutil.Process) -> tuple[float, float, int]:
    """(user seconds, system seconds, involuntary context switches) of the gateway."""
    cpu = gateway.cpu_times()
    return cpu.user, cpu.system, gateway.num_ctx_switches().involuntary


def step(mode: str, hook: Path, bodies: Path, work: Path, duration_s: float
         ) -> dict[str, Any]:
    env = {"HERON_BENCH_STUB": mode, "PYTHONPATH": f"{hook}:{REPO}"}
    data = work / f"up-{mode}"
    with local_cluster("null", data, WORKERS, threads_per_process(WORKERS),
                       extra_env=env) as (gateway_url, _):
        url = f"{gateway_url}/v1/encode/null-model"
        run_wrk(url, bodies, connections=CLIENTS, duration_s=4)  # warm-up
        (gateway,) = processes(data)["gateway"]
        before = gateway_counters(gateway)
        result = run_wrk(url, bodies, connections=CLIENTS, duration_s=duration_s)
        after = gateway_counters(gateway)
    n = max(1, result.requests)
    user, system, preempted = (a - b for a, b in zip(after, before, strict=True))
    out = {"mode": mode, "requests_per_s": round(result.rps, 1),
           "gateway_user_us": round(user / n * 1e6, 1),
           "gateway_system_us": round(system / n * 1e6, 1),
           "gateway_cpu_us": round((user + system) / n * 1e6, 1),
           "gateway_preempted_per_request": round(preempted / n, 3)}
    log(json.dumps(out))
    return out


def run(rounds: int, duration_s: float, out: Path) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="heron-layers-") as tmp:
        work = Path(tmp)
        hook = work / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        bodies = work / "bodies.txt"
        write_bodies(build_workload(1000).texts, bodies)
        for round_no in range(rounds):
            order = MODES if round_no % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                steps.append({"round": round_no, **step(mode, hook, bodies, work,
                                                        duration_s)})
    medians = {mode: {key: statistics.median(s[key] for s in steps if s["mode"] == mode)
                      for key in ("requests_per_s", "gateway_cpu_us", "gateway_user_us",
                                  "gateway_system_us", "gateway_preempted_per_request")}
               for mode in MODES}
    report = {"bench": "gateway_layers", "clients": CLIENTS, "workers": WORKERS,
              "rounds": rounds, "duration_s": duration_s, "medians": medians,
              "steps": steps}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway_layers.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a wrk step")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.rounds, args.duration, args.out)["medians"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
