"""The cluster path's cost per request: `heron up` against `heron serve` on the same cores,
one text per request (where coalescing at the gateway matters).

    python -m bench.coalesce_bench [--quick] [--part null|messages|minilm|all] [--rounds N]
                                   [--out DIR]

Two layouts of `heron up` run beside `heron serve` (``LAYOUTS``): ``up``, as it starts by
default (one gateway; ``--workers auto``: one worker running a single-thread forward pass
per usable CPU at once, as many as ``heron serve --workers auto`` runs processes), and
``up_worker_per_cpu`` (that many single-thread workers: the default from 2026-11-29 to
2026-11-30).

1. ``null`` (bundle null: real tokenization, no model compute): requests/s at 32 clients
   (the median of ``--rounds`` interleaved steps) and p50 at one client, of `heron serve`
   and both layouts, all up at once; with each 32-client step, the CPU a request of each
   kind of process (user + system time over the step, divided by its requests:
   ``cpu_us_per_request``), so what a request costs the cores can be read process by
   process.
2. ``messages``: NATS messages a request costs (nats-server's /varz in + out), with
   coalescing and with ``--coalesce-max-items 0``, at 1 and 32 clients (null model,
   default layout).
3. ``minilm`` (the default bundle, mixed 8-128-token texts): `heron serve` and both
   layouts up at once (an idle one costs a heartbeat a second) and their steps
   interleaved (the order turning each round) at 32 and then at 64 clients, ``--rounds``
   times; the JSON holds every step and each layout's median ratio to serve's step of
   the same round (steps seconds apart, so the machine's drift cancels out), and each
   step's CPU a request by role, with each role's event loops (main threads) apart as
   ``ROLE_event_loop``: what the path around the model costs each side under the model's
   load.

wrk drives both (one thread). Prints one JSON document and writes DIR/coalesce_bench.json
(DIR: bench/results/), and DIR/coalesce_bench.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench.cluster_bench import local_cluster
from bench.load import run_wrk, write_bodies
from bench.revision_ab import (
    BUNDLE_MODELS,
    cpu_s,
    cpu_us_per_request,
    loop_cpu_s,
    processes,
)
from bench.server import REPO, free_port, start_server
from bench.texts import build_workload
from heron.cli.main import serve_processes, threads_per_process
from tests.support.nats_server import NatsServer


def layouts(processes: int) -> dict[str, dict[str, int]]:
    """`heron up`'s layouts compared, for ``processes`` (what `heron serve --workers auto`
    runs): local_cluster's workers, torch threads and inference threads of each."""
    return {"up": {"workers": 1, "threads": threads_per_process(processes),
                   "inference_threads": processes},
            "up_worker_per_cpu": {"workers": processes,
                                  "threads": threads_per_process(processes),
                                  "inference_threads": 1}}


LAYOUT_LABELS = {"up": "heron up", "up_worker_per_cpu": "heron up\n(a worker per CPU)"}


def start_sides(stack: contextlib.ExitStack, work: Path, bundle: str, workers: int
                ) -> tuple[dict[str, str], dict[str, dict[str, list[psutil.Process]]]]:
    """`heron serve` and `heron up` in each of ``layouts(workers)``, serving ``bundle``,
    up at once (stopped when ``stack`` closes): each side's encode URL and its processes
    by role."""
    model = BUNDLE_MODELS[bundle]
    server = stack.enter_context(start_server(work / f"serve-{model}.log", bundle=bundle))
    urls = {"serve": f"{server.url}/v1/encode/{model}"}
    procs = {"serve": serve_procs(server.pid)}
    for side, layout in layouts(workers).items():
        gateway, _ = stack.enter_context(local_cluster(bundle, work / f"{side}-{model}",
                                                       **layout))
        urls[side] = f"{gateway}/v1/encode/{model}"
        procs[side] = processes(work / f"{side}-{model}")
    return urls, procs


def turned(sides: list[str], index: int) -> list[str]:
    """``sides`` in round ``index``'s order: each round starts one further along, so the
    machine's drift (the second of a pair ran 10-15% slower on some days) favours none."""
    turn = index % len(sides)
    return sides[turn:] + sides[:turn]


def log(message: str) -> None:
    print(f"[coalesce_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def step(url: str, bodies: Path, connections: int, duration_s: float) -> dict[str, Any]:
    return run_wrk(url, bodies, connections=connections, duration_s=duration_s).summary()


def measured_step(url: str, bodies: Path, connections: int, duration_s: float,
                  procs: dict[str, list[psutil.Process]],
                  read_cpu: Callable[[dict[str, list[psutil.Process]]],
                                     dict[str, float]] = cpu_s) -> dict[str, Any]:
    """``step``, with the CPU a request of each kind of process in ``procs`` (µs), as
    ``read_cpu`` reads it (``loop_cpu_s``: the event loops apart)."""
    before = read_cpu(procs)
    summary = step(url, bodies, connections, duration_s)
    summary["cpu_us_per_request"] = cpu_us_per_request(before, read_cpu(procs),
                                                       summary["requests"])
    return summary


def serve_procs(pid: int) -> dict[str, list[psutil.Process]]:
    """`heron serve`'s processes (the one started and its children) as one role."""
    server = psutil.Process(pid)
    return {"serve": [server, *server.children(recursive=True)]}


def median_cpu(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Each role's median CPU a request over ``measured_step`` summaries."""
    return {role: statistics.median(s["cpu_us_per_request"][role] for s in steps)
            for role in steps[0]["cpu_us_per_request"]}


def brief(summary: dict[str, Any]) -> str:
    lat = summary["latency_ms"]
    return (f"{summary['throughput_rps']}/s p50 {lat['p50']} p99 {lat['p99']} ms"
            + (f" non-2xx {summary['non_2xx']}" if summary["non_2xx"] else ""))


def null_part(work: Path, bodies: Path, workers: int, duration: float,
              rounds: int) -> dict[str, Any]:
    """`heron serve` and `heron up` in both ``layouts(workers)``, all up at once; their
    32-client steps interleaved ``rounds`` times (the order turning each round: the
    second of a pair ran 10-15% slower on some days), then one 1-client step each.
    Medians over the rounds."""
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        urls, procs = start_sides(stack, work, "null", workers)
        for url in urls.values():
            step(url, bodies, 8, 2.0)  # warm-up
        steps: dict[str, list[dict[str, Any]]] = {side: [] for side in urls}
        for index in range(rounds):
            order = turned(list(urls), index)
            for side in order:
                steps[side].append(measured_step(urls[side], bodies, 32, duration,
                                                 procs[side]))
            log(f"null c32 round {index}: " + "; ".join(
                f"{side} {brief(steps[side][-1])}" for side in order))
        for side, url in urls.items():
            c32 = {"steps": steps[side], "throughput_rps": statistics.median(
                s["throughput_rps"] for s in steps[side]),
                   "cpu_us_per_request": median_cpu(steps[side])}
            out[side] = {"c1": step(url, bodies, 1, duration), "c32": c32}
            log(f"null, {side}: c1 {brief(out[side]['c1'])}; c32 median "
                f"{c32['throughput_rps']}/s, CPU a request {c32['cpu_us_per_request']} µs")
    for side in layouts(workers):
        out[f"{side}_to_serve_c32"] = round(out[side]["c32"]["throughput_rps"]
                                            / out["serve"]["c32"]["throughput_rps"], 3)
    return out


def _nats_messages(monitor: str) -> int:
    varz = json.loads(urllib.request.urlopen(f"{monitor}/varz", timeout=5).read())
    return int(varz["in_msgs"]) + int(varz["out_msgs"])


def messages_part(work: Path, bodies: Path, workers: int, duration: float) -> dict[str, Any]:
    """NATS messages a request costs (the server's in + out counts: a message published and
    delivered counts twice), with coalescing and without it, at 1 and 32 clients."""
    out: dict[str, Any] = {}
    for label, env in (("coalescing", {}), ("off", {"HERON_GATEWAY_COALESCE_MAX_ITEMS": "0"})):
        nats = NatsServer(work / f"nats-{label}", monitor_port=free_port()).start()
        monitor = f"http://127.0.0.1:{nats.monitor_port}"
        try:
            with local_cluster("null", work / f"msgs-{label}", **layouts(workers)["up"],
                               extra_args=("--nats", nats.url), extra_env=env) as (gateway, _):
                url = f"{gateway}/v1/encode/null-model"
                step(url, bodies, 8, 2.0)
                row: dict[str, Any] = {}
                for c in (1, 32):
                    before = _nats_messages(monitor)
                    summary = step(url, bodies, c, duration)
                    row[f"c{c}"] = {"requests_per_s": summary["throughput_rps"],
                                    "messages_per_request": round(
                                        (_nats_messages(monitor) - before)
                                        / max(1, summary["requests"]), 2)}
                out[label] = row
        finally:
            nats.stop()
        log(f"NATS messages a request, {label}: {out[label]}")
    return out


def minilm_part(work: Path, bodies: Path, workers: int, duration: float,
                rounds: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    sides = ["serve", *layouts(workers)]
    with contextlib.ExitStack() as stack:
        urls, procs = start_sides(stack, work, "default", workers)
        for url in urls.values():
            step(url, bodies, 16, 3.0)  # warm-up
        for index in range(rounds):
            for c in (32, 64):
                row: dict[str, Any] = {"round": index, "connections": c}
                for side in turned(sides, index):
                    row[side] = measured_step(urls[side], bodies, c, duration, procs[side],
                                              loop_cpu_s)
                for side in sides[1:]:
                    row[f"{side}_ratio"] = round(row[side]["throughput_rps"]
                                                 / row["serve"]["throughput_rps"], 3)
                    row[f"{side}_p99_ratio"] = round(row[side]["latency_ms"]["p99"]
                                                     / row["serve"]["latency_ms"]["p99"], 3)
                log(f"minilm c={c}: " + "; ".join(
                    f"{side} {brief(row[side])}"
                    + (f" ({row[f'{side}_ratio']})" if side != "serve" else "")
                    for side in sides))
                steps.append(row)
    summary: dict[str, Any] = {}
    for c in (32, 64):
        rows = [r for r in steps if r["connections"] == c]
        summary[f"c{c}"] = {"serve_rps": statistics.median(
            r["serve"]["throughput_rps"] for r in rows)}
        for side in sides[1:]:
            summary[f"c{c}"][side] = {
                "median_ratio": statistics.median(r[f"{side}_ratio"] for r in rows),
                "median_p99_ratio": statistics.median(r[f"{side}_p99_ratio"] for r in rows),
                "rps": statistics.median(r[side]["throughput_rps"] for r in rows)}
        summary[f"c{c}"]["cpu_us_per_request"] = {side: median_cpu([r[side] for r in rows])
                                                  for side in sides}
    return {"steps": steps, "summary": summary}


def plot(result: dict[str, Any], path: Path) -> bool:
    """requests/s of heron serve and heron up side by side; False without matplotlib (an
    optional dependency, as for bench.plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels: list[tuple[str, list[tuple[str, float]]]] = []
    if "null" in result:
        null = result["null"]
        panels.append(("null model\n32 clients", [
            ("heron serve", null["serve"]["c32"]["throughput_rps"]),
            *((label, null[side]["c32"]["throughput_rps"])
              for side, label in LAYOUT_LABELS.items() if side in null)]))
    for c in (32, 64):
        row = result.get("minilm", {}).get("summary", {}).get(f"c{c}")
        if row:
            panels.append((f"MiniLM\n{c} clients", [
                ("heron serve", row["serve_rps"]),
                *((label, row[side]["rps"]) for side, label in LAYOUT_LABELS.items()
                  if side in row)]))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.8),
                             squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#c44e52"]
    for ax, (label, bars) in zip(axes[0], panels, strict=True):
        ax.bar([name for name, _ in bars], [value for _, value in bars],
               color=colors[:len(bars)])
        ax.set(title=label, ylabel="requests / s")
        for x, (_, value) in enumerate(bars[1:], start=1):
            ax.text(x, value, f"{value / bars[0][1]:.0%}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(part: str, quick: bool, rounds: int, out: Path) -> dict[str, Any]:
    duration = 4.0 if quick else 10.0
    workers = serve_processes("auto", "cpu")
    work = Path(tempfile.mkdtemp(prefix="heron-coalesce-bench-"))
    texts = build_workload(256 if quick else 1024).texts
    bodies = work / "single.txt"
    write_bodies(texts, bodies)
    result: dict[str, Any] = {"benchmark": "coalesce_bench", "cpu_count": os.cpu_count(),
                              "workers": workers, "duration_s": duration,
                              "workload": "one text per request, 8-128 tokens"}
    if part in ("null", "all"):
        log(f"null model: heron serve and heron up (two layouts) interleaved, {rounds} "
            "round(s)")
        result["null"] = null_part(work, bodies, workers, duration, rounds)
    if part in ("messages", "all"):
        log("NATS messages a request, with and without coalescing")
        result["messages"] = messages_part(work, bodies, workers, duration)
    if part in ("minilm", "all"):
        log(f"MiniLM: heron serve and heron up interleaved, {rounds} round(s)")
        result["minilm"] = minilm_part(work, bodies, workers, duration, rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coalesce_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "coalesce_bench.png")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=("null", "messages", "minilm", "all"),
                        default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(json.dumps(run(args.part, args.quick, args.rounds, args.out), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
