"""The cluster path's cost per request: `heron up` against `heron serve` on the same cores,
one text per request (where coalescing at the gateway matters).

    python -m bench.coalesce_bench [--quick] [--part null|messages|minilm|all] [--rounds N]
                                   [--out DIR]

1. ``null`` (bundle null: real tokenization, no model compute): requests/s at 32 clients
   (the median of ``--rounds`` interleaved steps) and p50 at one client, of `heron serve`,
   `heron up` as it starts by default (one gateway, ``--workers auto``: as many workers
   as ``heron serve --workers auto`` runs processes, the cores split between them) and
   `heron up --workers 1` (one worker with all the cores' threads, the default before
   2026-11-29), all three up at once; with each 32-client step, the CPU a request of each
   kind of process (user + system time over the step, divided by its requests:
   ``cpu_us_per_request``), so what a request costs the cores can be read process by
   process.
2. ``messages``: NATS messages a request costs (nats-server's /varz in + out), with
   coalescing and with ``--coalesce-max-items 0``, at 1 and 32 clients (null model).
3. ``minilm`` (the default bundle, mixed 8-128-token texts): both servers up at once (the
   idle one costs a heartbeat a second) and their steps interleaved (serve then cluster,
   cluster then serve in the next round) at 32 and then at 64 clients, ``--rounds``
   times; the JSON holds every step and the median ratio of each pair (steps seconds
   apart, so the machine's drift cancels out), and each step's CPU a request by role,
   with each role's event loops (main threads) apart as ``ROLE_event_loop``: what the
   path around the model costs each side under the model's load.

wrk drives both (one thread). Prints one JSON document and writes DIR/coalesce_bench.json
(DIR: bench/results/), and DIR/coalesce_bench.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
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
from bench.revision_ab import cpu_s, cpu_us_per_request, loop_cpu_s, processes
from bench.server import REPO, free_port, start_server
from bench.texts import build_workload
from heron.cli.main import serve_processes, threads_per_process
from tests.support.nats_server import NatsServer


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
    """`heron serve`, `heron up` as it starts by default (``workers`` workers, as serve runs
    processes) and `heron up --workers 1` (one worker, every core's threads),
    all up at once; their 32-client steps interleaved ``rounds`` times (the order turning
    each round: the second of a pair ran 10-15% slower on some days), then one 1-client
    step each. Medians over the rounds."""
    out: dict[str, Any] = {}
    with start_server(work / "serve-null.log", bundle="null") as server, \
            local_cluster("null", work / "up-null", workers,
                          threads_per_process(workers)) as (gateway, _), \
            local_cluster("null", work / "up-null-one-worker", 1,
                          threads_per_process(1)) as (one_worker_gateway, _):
        urls = {"serve": f"{server.url}/v1/encode/null-model",
                "up": f"{gateway}/v1/encode/null-model",
                "up_one_worker": f"{one_worker_gateway}/v1/encode/null-model"}
        for url in urls.values():
            step(url, bodies, 8, 2.0)  # warm-up
        procs = {"serve": serve_procs(server.pid), "up": processes(work / "up-null"),
                 "up_one_worker": processes(work / "up-null-one-worker")}
        steps: dict[str, list[dict[str, Any]]] = {side: [] for side in urls}
        for index in range(rounds):
            order = list(urls)[index % 3:] + list(urls)[:index % 3]
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
    for side in ("up", "up_one_worker"):
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
            with local_cluster("null", work / f"msgs-{label}", workers,
                               threads_per_process(workers), extra_args=("--nats", nats.url),
                               extra_env=env) as (gateway, _):
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
    with start_server(work / "serve-minilm.log") as server, \
            local_cluster("default", work / "up-minilm", workers,
                          threads_per_process(workers)) as (gateway, _):
        urls = {"serve": f"{server.url}/v1/encode/minilm",
                "up": f"{gateway}/v1/encode/minilm"}
        for url in urls.values():
            step(url, bodies, 16, 3.0)  # warm-up
        procs = {"serve": serve_procs(server.pid), "up": processes(work / "up-minilm")}
        for index in range(rounds):
            for c in (32, 64):
                row: dict[str, Any] = {"round": index, "connections": c}
                sides = list(urls) if index % 2 == 0 else list(reversed(urls))
                for side in sides:  # the order turns each round: drift favours neither
                    row[side] = measured_step(urls[side], bodies, c, duration, procs[side],
                                              loop_cpu_s)
                row["ratio"] = round(row["up"]["throughput_rps"]
                                     / row["serve"]["throughput_rps"], 3)
                row["p99_ratio"] = round(row["up"]["latency_ms"]["p99"]
                                         / row["serve"]["latency_ms"]["p99"], 3)
                log(f"minilm c={c}: serve {brief(row['serve'])}; up {brief(row['up'])}; "
                    f"ratio {row['ratio']}")
                steps.append(row)
    summary = {}
    for c in (32, 64):
        rows = [r for r in steps if r["connections"] == c]
        summary[f"c{c}"] = {
            "median_ratio": statistics.median(r["ratio"] for r in rows),
            "median_p99_ratio": statistics.median(r["p99_ratio"] for r in rows),
            "serve_rps": statistics.median(r["serve"]["throughput_rps"] for r in rows),
            "up_rps": statistics.median(r["up"]["throughput_rps"] for r in rows),
            "cpu_us_per_request": {side: median_cpu([r[side] for r in rows])
                                   for side in ("serve", "up")}}
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
        bars = [("heron serve", null["serve"]["c32"]["throughput_rps"]),
                ("heron up", null["up"]["c32"]["throughput_rps"])]
        if "up_one_worker" in null:
            bars.append(("heron up\n(one worker)",
                         null["up_one_worker"]["c32"]["throughput_rps"]))
        panels.append(("null model\n32 clients", bars))
    for c in (32, 64):
        row = result.get("minilm", {}).get("summary", {}).get(f"c{c}")
        if row:
            panels.append((f"MiniLM\n{c} clients",
                           [("heron serve", row["serve_rps"]), ("heron up", row["up_rps"])]))
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
