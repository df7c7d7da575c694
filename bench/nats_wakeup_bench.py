"""What one NATS round trip between two processes costs on this machine, back to back and
after the processes sat idle: the floor under the cluster path's one-client latency.

    python -m bench.nats_wakeup_bench [--rounds N] [--requests N] [--out DIR]

A lone request through `heron up` crosses six process wakeups in a row (client to
gateway, gateway to nats-server, nats-server to a worker and back, back to the client),
`heron serve` two. A process that sat idle wakes slower than one that is busy, by how much
depends on the host (a VM's idle vCPUs cost the most): on 2026-11-29 that difference was
0.8-1.5 ms of the 4-5 ms 1-client gap between `heron up` and `heron serve`
(docs/benchmarks.md#cluster-path-cost-per-request).

Measured with nats-py, the client the gateway and the workers use, against one local
nats-server with JetStream (a temporary store):
- ``request``: a core request/reply to a responder in another process (4 wakeups: the
  server, the responder, the server, the caller);
- ``publish``: a JetStream publish and its acknowledgement (2 wakeups: the server stores
  the message and answers);
each back to back and after ``gap`` ms of idling (1 and 5; a one-client `heron up` request
takes 5-7 ms on the slow days). Rounds alternate the order of the gaps. Prints one JSON
document and writes DIR/nats_wakeup_bench.json (DIR: bench/results/) and a PNG beside it
when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from bench.server import REPO
from tests.support.nats_server import NatsServer

GAPS_MS = (0.0, 1.0, 5.0)
SUBJECT = "bench.echo"
PAYLOAD = b"x" * 300  # about a one-text work item's size


async def _responder(url: str) -> None:
    nc = await nats.connect(url)

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(SUBJECT, cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _timed(call: Any, gap_s: float, count: int) -> list[float]:
    """Milliseconds of ``count`` calls, each after ``gap_s`` of sleeping."""
    out = []
    for _ in range(count):
        if gap_s:
            await asyncio.sleep(gap_s)
        started = time.perf_counter()
        await call()
        out.append((time.perf_counter() - started) * 1000)
    return out


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": round(statistics.median(ordered), 3),
            "p90": round(ordered[int(len(ordered) * 0.9)], 3)}


async def _measure(url: str, rounds: int, requests: int) -> dict[str, Any]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="BENCH_WAKEUP", subjects=["bench.work"])
    calls = {"request": lambda: nc.request(SUBJECT, PAYLOAD, timeout=5),
             "publish": lambda: js.publish("bench.work", PAYLOAD, timeout=5)}
    for call in calls.values():  # warm-up: connections, interest, the stream's files
        await _timed(call, 0.0, 200)
    samples: dict[str, dict[float, list[float]]] = {
        kind: {gap: [] for gap in GAPS_MS} for kind in calls}
    for index in range(rounds):
        gaps = GAPS_MS if index % 2 == 0 else tuple(reversed(GAPS_MS))
        for gap in gaps:
            for kind, call in calls.items():
                samples[kind][gap] += await _timed(call, gap / 1000, requests)
    await nc.close()
    result: dict[str, Any] = {}
    for kind, by_gap in samples.items():
        hot = statistics.median(by_gap[0.0])
        result[kind] = [{"idle_gap_ms": gap, **_percentiles(values),
                         "p50_over_back_to_back": round(statistics.median(values) / hot, 2)}
                        for gap, values in by_gap.items()]
    return result


def run(rounds: int, requests: int, out: Path) -> dict[str, Any]:
    store = Path(tempfile.mkdtemp(prefix="heron-wakeup-bench-"))
    server = NatsServer(store).start()
    responder = subprocess.Popen([sys.executable, "-m", "bench.nats_wakeup_bench",
                                  "--responder", server.url], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert responder.stdout is not None and responder.stdout.readline().strip() == "ready"
        measured = asyncio.run(_measure(server.url, rounds, requests))
    finally:
        responder.kill()
        responder.wait()
        server.stop()
    result = {"benchmark": "nats_wakeup_bench", "cpu_count": os.cpu_count(),
              "rounds": rounds, "calls_per_step": requests, "payload_bytes": len(PAYLOAD),
              **measured}
    out.mkdir(parents=True, exist_ok=True)
    (out / "nats_wakeup_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "nats_wakeup_bench.png")
    return result


def plot(result: dict[str, Any], path: Path) -> bool:
    """p50 of each call against the idle gap before it; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = {"request": "core request/reply (4 wakeups)",
              "publish": "JetStream publish + ack (2 wakeups)"}
    for kind, label in labels.items():
        steps = result[kind]
        ax.plot([s["idle_gap_ms"] for s in steps], [s["p50"] for s in steps], "o-",
                label=label)
    ax.set(xlabel="idle before each call (ms)", ylabel="p50 (ms)", ylim=(0, None),
           title=f"A NATS round trip after idling ({result['cpu_count']} CPUs)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400, help="calls a step")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--responder", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.responder:
        asyncio.run(_responder(args.responder))
        return 0
    print(json.dumps(run(args.rounds, args.requests, args.out), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
