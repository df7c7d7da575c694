"""Cold start: seconds from launching a server to its first answered request.

    python -m bench.startup_bench [--rounds N] [--out DIR]

What a scaled-to-zero pool waits for (the gateway's 202 + Retry-After covers it), and what
every server start in the test suite pays. Three starts, each ``--rounds`` times, one at a
time and interleaved: ``heron serve`` with the null model and with MiniLM (one process),
and ``heron up`` with MiniLM (nats-server, config service, gateway, and ``--workers
auto``'s workers: one a usable CPU, up to 4). A start ends with the first 200 to a
one-text ``POST /v1/encode`` (sent every 50 ms): through ``heron up`` that needs a ready
worker, not only a gateway. Then the server gets SIGTERM.
Writes ``startup_bench.json``: per start, seconds to ready, seconds from SIGTERM to exit,
and the CPU seconds of the server and its children from launch to exit, with medians.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster_bench import log
from bench.server import HOST, REPO, free_port, heron_command, http

POLL_S = 0.05


def _serve(bundle: str, work: Path) -> tuple[list[str], int]:
    port = free_port()
    return [*heron_command(), "serve", "--host", HOST, "--port", str(port), "--bundle", bundle,
            "--workers", "1", "--log-level", "warning"], port


def _up(bundle: str, work: Path) -> tuple[list[str], int]:
    port = free_port()
    return [*heron_command(), "up", "--port", str(port), "--nats-port", str(free_port()),
            "--config-port", "0", "--data-dir", str(work), "--bundle", bundle], port


# name -> (command, bundle, the model a request names)
STARTS = {
    "serve, null model": (_serve, "null", "null-model"),
    "serve, MiniLM": (_serve, "default", "minilm"),
    "up, MiniLM": (_up, "default", "minilm"),
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_and_stop(name: str, work: Path, timeout_s: float = 180.0) -> dict[str, float]:
    """One start: seconds to the first answer (``ready_s``), seconds from SIGTERM to the
    launched process's exit (``stop_s``), and the CPU seconds the server and every process
    it started used from launch to exit (``cpu_s``: what each start and stop in the test
    suite costs the machine)."""
    command, bundle, model = STARTS[name]
    argv, port = command(bundle, work)
    work.mkdir(parents=True, exist_ok=True)
    cpu_before = _children_cpu_s()
    with open(work / "server.log", "wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        ready_s = _wait_ready(name, proc, port, model, work, started, timeout_s)
    finally:
        stopping = time.monotonic()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"ready_s": ready_s, "stop_s": time.monotonic() - stopping,
            "cpu_s": _children_cpu_s() - cpu_before}


def _wait_ready(name: str, proc: subprocess.Popen[bytes], port: int, model: str, work: Path,
                started: float, timeout_s: float) -> float:
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: "
                               f"{(work / 'server.log').read_text()[-2000:]}")
        try:
            if http("POST", f"http://{HOST}:{port}/v1/encode/{model}",
                    {"items": ["ready?"]}, timeout=5)[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"{name} not ready within {timeout_s} s")


def run(rounds: int, out: Path) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="heron-startup-bench-"))
    measures = ("ready_s", "stop_s", "cpu_s")
    results: dict[str, dict[str, list[float]]] = {
        name: {m: [] for m in measures} for name in STARTS}
    for i in range(rounds):
        for name in STARTS:
            one = start_and_stop(name, root / f"{i}-{name.replace(', ', '-')}")
            for m in measures:
                results[name][m].append(round(one[m], 3))
            log(f"round {i + 1}: {name}: ready in {one['ready_s']:.2f} s, stopped in "
                f"{one['stop_s']:.2f} s, {one['cpu_s']:.1f} CPU-s")
    # JSON keys: each start's values, then their medians
    keys = {"ready_s": ("seconds", "median_s"), "stop_s": ("stop_seconds", "median_stop_s"),
            "cpu_s": ("cpu_seconds", "median_cpu_s")}
    result: dict[str, Any] = {"benchmark": "startup", "rounds": rounds}
    for m, (values, median) in keys.items():
        result[values] = {name: r[m] for name, r in results.items()}
        result[median] = {name: round(statistics.median(r[m]), 3)
                          for name, r in results.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup_bench.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.rounds, args.out), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
