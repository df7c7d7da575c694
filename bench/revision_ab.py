"""The cluster path of this tree against an earlier commit's, on the same machine in the
same minutes: what a change did, in numbers a slower or faster day cannot move.

    python -m bench.revision_ab --rev cd6a2ac [--rounds N] [--duration S] [--workers N]
                                [--inference-threads N] [--bundle null|default] [--out DIR]

Both trees' `heron up` (bundle null: real tokenization, no model compute, or ``--bundle
default``: MiniLM; one worker with each tree's default threads, or ``--workers N`` and
``--inference-threads N`` with the cores split between their passes, as ``heron up
--workers auto`` splits them; a tree from before ``--inference-threads`` runs one pass at
a time with that share) are up at once. Each
round runs wrk at 32 connections (one text a request) against each, then 400 requests from
one client, alternating which tree goes first, since the step that runs second in a round
comes out slower. Each step records requests/s (or the one client's p50), its p50/p99, and
the CPU each role's processes spent a request (/proc). The JSON holds every step and the
ratios (this tree over the other) per round, their geometric mean and median. Writes
DIR/revision_ab.json (DIR: bench/results/).

Why against a commit and not a stored number: an issue's "today" is the code when it
was filed, and this machine's speed varies by up to 2.5 times from day to day (a
pure-Python loop took 1.0 to 3.7 s), so only steps taken side by side compare.

The other tree is exported with ``git archive`` and run by this venv's Python with the
tree first on its path; its import layout is rebuilt with links (heron.gateway is
gateway/, and so on, as pyproject.toml's package-dir maps them), so any commit with that
layout runs. A tree whose API refuses ``"cache": false`` (from before the result cache)
gets bodies without it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.cluster_bench import local_cluster
from bench.load import run_wrk
from bench.server import HOST, REPO
from bench.texts import build_workload
from heron.cli.main import threads_per_process

# Import name -> folder, as pyproject.toml's [tool.setuptools.package-dir] maps them, plus
# the client (sdk/ installs as heron_sdk).
LAYOUT = {"heron/gateway": "../gateway", "heron/worker": "../worker",
          "heron/config_service": "../config_service", "heron_sdk": "sdk"}
# --bundle -> the model its requests name: null (tokenization only) or default (MiniLM)
BUNDLE_MODELS = {"null": "null-model", "default": "minilm"}
ONE_CLIENT_REQUESTS = 400


def log(message: str) -> None:
    print(f"[revision_ab {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def export(rev: str, into: Path) -> str:
    """``rev``'s tree, runnable from ``into``; its full commit id."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.strip()
    archive = into.with_suffix(".tar")
    subprocess.run(["git", "archive", "-o", str(archive), commit], cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    for link, target in LAYOUT.items():
        if not (into / link).exists():
            (into / link).symlink_to(target)
    return commit


def post(port: int, body: bytes, model: str) -> tuple[int, bytes]:
    """One encode request on a connection of its own: (status, body); 0 when refused."""
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request("POST", f"/v1/encode/{model}", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def write_bodies(texts: list[str], path: Path, no_cache: bool) -> None:
    extra = {"cache": False} if no_cache else {}
    path.write_text("".join(json.dumps({"items": [t], **extra}) + "\n" for t in texts))


def processes(data_dir: Path) -> dict[str, list[psutil.Process]]:
    """The nats-server, gateway and worker processes of the `heron up` whose data folder
    is ``data_dir``, by role."""
    up = next(p for p in psutil.process_iter(["cmdline"])
              if " up " in " ".join(p.info["cmdline"] or ())
              and str(data_dir) in (p.info["cmdline"] or ()))
    out = {}
    for child in up.children(recursive=True):
        command = " ".join(child.cmdline())
        for role in ("nats-server", "gateway", "worker"):
            if role in command:
                out.setdefault(role, []).append(child)
    return out


def cpu_s(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """CPU-seconds each role's processes have spent (the workers' summed)."""
    return {role: sum(sum(p.cpu_times()[:2]) for p in group) for role, group in procs.items()}


def loop_cpu_s(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """``cpu_s``, and for each Heron role ROLE_event_loop: the CPU-seconds of its processes'
    main threads alone, which run the event loop (HTTP or NATS, parsing, short texts'
    tokenizing, answering); the other threads run the forward passes (and long texts'
    tokenizing). Not for nats-server: a Go program's work is on no thread in particular."""
    out = cpu_s(procs)
    for role, group in procs.items():
        if role == "nats-server":
            continue
        loop = 0.0
        for process in group:
            with contextlib.suppress(psutil.Error):
                loop += sum(t.user_time + t.system_time for t in process.threads()
                            if t.id == process.pid)
        out[f"{role}_event_loop"] = loop
    return out


def cpu_us_per_request(before: dict[str, float], after: dict[str, float],
                       requests: int) -> dict[str, int]:
    """Each role's CPU a request (µs) between two readings (``cpu_s``, ``loop_cpu_s``)."""
    return {role: round((after[role] - value) / max(1, requests) * 1e6)
            for role, value in before.items()}


def takes_cache_field(port: int, model: str, timeout_s: float = 120.0) -> bool:
    """Whether the tree's API takes ``"cache": false`` (a 200), or refuses it (a 4xx): asked
    until one of the two comes back. A 202 (the pool's worker not heard from yet) or a
    refused connection is no answer: taken for a refusal once, it sent the other tree's
    bodies without the field, and wrk's repeated texts came from the result cache."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = post(port, b'{"items": ["x"], "cache": false}', model)
        if status == 200 or 400 <= status < 500:
            return status == 200
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer to a probe in {timeout_s} s: {status} {body[:200]!r}")
        time.sleep(0.5)


def one_client_p50(port: int, body: bytes, model: str) -> float:
    """p50 in ms over ONE_CLIENT_REQUESTS requests on one keep-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    latencies = []
    try:
        for _ in range(ONE_CLIENT_REQUESTS):
            started = time.perf_counter()
            conn.request("POST", f"/v1/encode/{model}", body,
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"one-client request answered {response.status}")
            latencies.append((time.perf_counter() - started) * 1000)
    finally:
        conn.close()
    return statistics.median(latencies)


def run(rev: str, rounds: int, duration_s: float, out: Path, workers: int = 1,
        bundle: str = "null", inference_threads: int = 1) -> dict[str, Any]:
    model = BUNDLE_MODELS[bundle]
    work = Path(tempfile.mkdtemp(prefix="heron-revision-ab-"))
    other = work / "tree"
    commit = export(rev, other)
    trees = {"this": REPO, "rev": other}
    texts = build_workload(1000).texts
    result: dict[str, Any] = {
        "benchmark": "revision_ab", "rev": rev, "commit": commit, "cpu_count": os.cpu_count(),
        "duration_s": duration_s, "workers": workers, "inference_threads": inference_threads,
        "bundle": bundle, "workload": f"{model}, one text a request, 8-128 tokens",
        "steps": []}
    with contextlib.ExitStack() as stack:
        ports, procs, bodies = {}, {}, {}
        for name, tree in trees.items():
            log(f"starting heron up of {name} ({tree})")
            passes = workers * inference_threads
            gateway, _ = stack.enter_context(local_cluster(
                bundle, work / name, workers, threads_per_process(passes) if passes > 1 else 0,
                tree=tree, inference_threads=inference_threads))
            ports[name] = int(gateway.rsplit(":", 1)[1])
            procs[name] = processes(work / name)
            takes_cache = takes_cache_field(ports[name], model)
            bodies[name] = work / f"{name}.txt"
            write_bodies(texts, bodies[name], no_cache=takes_cache)
            run_wrk(f"http://{HOST}:{ports[name]}/v1/encode/{model}", bodies[name],
                    connections=8, duration_s=2)  # warm-up
        one_body = {name: path.read_text().splitlines()[5].encode()
                    for name, path in bodies.items()}
        for round_no in range(rounds):
            order = ["rev", "this"] if round_no % 2 == 0 else ["this", "rev"]
            for name in order:
                before = cpu_s(procs[name])
                summary = run_wrk(f"http://{HOST}:{ports[name]}/v1/encode/{model}",
                                  bodies[name], connections=32,
                                  duration_s=duration_s).summary()
                after = cpu_s(procs[name])
                result["steps"].append({
                    "round": round_no, "tree": name, "clients": 32,
                    "throughput_rps": summary["throughput_rps"],
                    "latency_ms": summary["latency_ms"], "non_2xx": summary["non_2xx"],
                    "cpu_us_per_request": cpu_us_per_request(before, after,
                                                             summary["requests"])})
                log(f"round {round_no} {name}: {summary['throughput_rps']} requests/s")
                time.sleep(1)
            for name in order:
                before = cpu_s(procs[name])
                p50 = one_client_p50(ports[name], one_body[name], model)
                after = cpu_s(procs[name])
                result["steps"].append({
                    "round": round_no, "tree": name, "clients": 1, "p50_ms": round(p50, 3),
                    "cpu_us_per_request": cpu_us_per_request(before, after,
                                                             ONE_CLIENT_REQUESTS)})
                log(f"round {round_no} {name}: one client p50 {p50:.2f} ms, CPU a request "
                    f"{result['steps'][-1]['cpu_us_per_request']} us")
    result["summary"] = summarize(result["steps"], rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "revision_ab.json").write_text(json.dumps(result, indent=2))
    # The exported tree and the clusters' data and logs (9 MB); kept when a run failed.
    shutil.rmtree(work, ignore_errors=True)
    return result


def summarize(steps: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per-round ratios (this tree over the other) and their geometric mean and median."""
    def value(tree: str, clients: int, key: str, round_no: int) -> float:
        return next(s[key] for s in steps if s["tree"] == tree and s["clients"] == clients
                    and s["round"] == round_no)

    rps = [value("this", 32, "throughput_rps", r) / value("rev", 32, "throughput_rps", r)
           for r in range(rounds)]
    p50 = [value("this", 1, "p50_ms", r) / value("rev", 1, "p50_ms", r)
           for r in range(rounds)]
    return {"rps_ratio_per_round": [round(x, 3) for x in rps],
            "rps_ratio_geomean": round(statistics.geometric_mean(rps), 3),
            "rps_ratio_median": round(statistics.median(rps), 3),
            "one_client_p50_ratio_per_round": [round(x, 3) for x in p50],
            "one_client_p50_ratio_geomean": round(statistics.geometric_mean(p50), 3),
            "rps_median": {tree: statistics.median(value(tree, 32, "throughput_rps", r)
                                                   for r in range(rounds))
                           for tree in ("this", "rev")},
            "one_client_p50_ms_median": {tree: statistics.median(
                value(tree, 1, "p50_ms", r) for r in range(rounds)) for tree in ("this", "rev")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a wrk step")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--bundle", choices=sorted(BUNDLE_MODELS), default="null")
    parser.add_argument("--workers", type=int, default=1,
                        help="each cluster's workers (heron up's default: 1)")
    parser.add_argument("--inference-threads", type=int, default=1,
                        help="each worker's forward passes at once (heron up's default here: "
                             "one per usable CPU, up to 4)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args.rev, args.rounds, args.duration, args.out, args.workers, args.bundle,
                 args.inference_threads)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
