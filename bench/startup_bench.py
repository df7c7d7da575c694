"""Cold start: seconds from launching a server to its first answered request.

    python -m bench.startup_bench [--rounds N] [--out DIR]

What a scaled-to-zero pool waits for (the gateway's 202 + Retry-After covers it), and what
every server start in the test suite pays. Three starts, each ``--rounds`` times, one at a
time and interleaved: ``heron serve`` with the null model and with MiniLM (one process),
and ``heron up`` with MiniLM (nats-server, config service, gateway, one worker). A start
ends with the first 200 to a one-text ``POST /v1/encode`` (sent every 50 ms): through
``heron up`` that needs a ready worker, not only a gateway. Writes ``startup_bench.json``:
each start's seconds and their median.
"""

from __future__ import annotations

import argparse
import json
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


def time_to_ready(name: str, work: Path, timeout_s: float = 180.0) -> float:
    command, bundle, model = STARTS[name]
    argv, port = command(bundle, work)
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "server.log", "wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
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
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(rounds: int, out: Path) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="heron-startup-bench-"))
    seconds: dict[str, list[float]] = {name: [] for name in STARTS}
    for i in range(rounds):
        for name in STARTS:
            took = time_to_ready(name, root / f"{i}-{name.replace(', ', '-')}")
            seconds[name].append(round(took, 3))
            log(f"round {i + 1}: {name}: ready in {took:.2f} s")
    result = {"benchmark": "startup", "rounds": rounds, "seconds": seconds,
              "median_s": {name: round(statistics.median(s), 3)
                           for name, s in seconds.items()}}
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
