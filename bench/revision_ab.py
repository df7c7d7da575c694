"""The cluster path of this tree against an earlier commit's, on the same machine in the
same minutes: what a change did, in numbers a slower or faster day cannot move.

    python -m bench.revision_ab --rev cd6a2ac [--rounds N] [--duration S] [--out DIR]

Both trees' `heron up` (bundle null: real tokenization, no model compute; one worker,
each tree's default threads) are up at once. Each round runs wrk at 32 connections (one
text a request) against each, then 400 requests from one client, alternating which
tree goes first, since the step that runs second in a round comes out slower. Each
step records requests/s, its p50/p99, and the CPU each process spent a request (/proc).
The JSON holds every step and the ratios (this tree over the other) per round, their
geometric mean and median. Writes DIR/revision_ab.json (DIR: bench/results/).

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

# Import name -> folder, as pyproject.toml's [tool.setuptools.package-dir] maps them, plus
# the client (sdk/ installs as heron_sdk).
LAYOUT = {"heron/gateway": "../gateway", "heron/worker": "../worker",
          "heron/config_service": "../config_service", "heron_sdk": "sdk"}
MODEL = "null-model"
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


def post(port: int, body: bytes) -> tuple[int, bytes]:
    """One encode request on a connection of its own: (status, body); 0 when refused."""
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request("POST", f"/v1/encode/{MODEL}", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def write_bodies(texts: list[str], path: Path, no_cache: bool) -> None:
    extra = {"cache": False} if no_cache else {}
    path.write_text("".join(json.dumps({"items": [t], **extra}) + "\n" for t in texts))


def processes(data_dir: Path) -> dict[str, psutil.Process]:
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
                out[role] = child
    return out


def cpu_s(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {role: sum(p.cpu_times()[:2]) for role, p in procs.items()}


def one_client_p50(port: int, body: bytes) -> float:
    """p50 in ms over ONE_CLIENT_REQUESTS requests on one keep-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    latencies = []
    try:
        for _ in range(ONE_CLIENT_REQUESTS):
            started = time.perf_counter()
            conn.request("POST", f"/v1/encode/{MODEL}", body,
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"one-client request answered {response.status}")
            latencies.append((time.perf_counter() - started) * 1000)
    finally:
        conn.close()
    return statistics.median(latencies)


def run(rev: str, rounds: int, duration_s: float, out: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="heron-revision-ab-"))
    other = work / "tree"
    commit = export(rev, other)
    trees = {"this": REPO, "rev": other}
    texts = build_workload(1000).texts
    result: dict[str, Any] = {
        "benchmark": "revision_ab", "rev": rev, "commit": commit, "cpu_count": os.cpu_count(),
        "duration_s": duration_s, "workload": "null model, one text a request, 8-128 tokens",
        "steps": []}
    with contextlib.ExitStack() as stack:
        ports, procs, bodies = {}, {}, {}
        for name, tree in trees.items():
            log(f"starting heron up of {name} ({tree})")
            gateway, _ = stack.enter_context(local_cluster("null", work / name, tree=tree))
            ports[name] = int(gateway.rsplit(":", 1)[1])
            procs[name] = processes(work / name)
            takes_cache = post(ports[name], b'{"items": ["x"], "cache": false}')[0] == 200
            bodies[name] = work / f"{name}.txt"
            write_bodies(texts, bodies[name], no_cache=takes_cache)
            run_wrk(f"http://{HOST}:{ports[name]}/v1/encode/{MODEL}", bodies[name],
                    connections=8, duration_s=2)  # warm-up
        one_body = {name: path.read_text().splitlines()[5].encode()
                    for name, path in bodies.items()}
        for round_no in range(rounds):
            order = ["rev", "this"] if round_no % 2 == 0 else ["this", "rev"]
            for name in order:
                before = cpu_s(procs[name])
                summary = run_wrk(f"http://{HOST}:{ports[name]}/v1/encode/{MODEL}",
                                  bodies[name], connections=32,
                                  duration_s=duration_s).summary()
                after = cpu_s(procs[name])
                requests = max(1, summary["requests"])
                result["steps"].append({
                    "round": round_no, "tree": name, "clients": 32,
                    "throughput_rps": summary["throughput_rps"],
                    "latency_ms": summary["latency_ms"], "non_2xx": summary["non_2xx"],
                    "cpu_us_per_request": {role: round((after[role] - before[role])
                                                       / requests * 1e6)
                                           for role in before}})
                log(f"round {round_no} {name}: {summary['throughput_rps']} requests/s")
                time.sleep(1)
            for name in order:
                p50 = one_client_p50(ports[name], one_body[name])
                result["steps"].append({"round": round_no, "tree": name, "clients": 1,
                                        "p50_ms": round(p50, 3)})
                log(f"round {round_no} {name}: one client p50 {p50:.2f} ms")
    result["summary"] = summarize(result["steps"], rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "revision_ab.json").write_text(json.dumps(result, indent=2))
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
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(json.dumps(run(args.rev, args.rounds, args.duration, args.out)["summary"],
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
