"""Fault benchmark: the fault suite's two acceptance runs at full size, on real processes.

    python -m bench.faults_bench [--only leader|overload] [--out DIR]

1. ``leader``: a 3-node JetStream cluster (every stream at three replicas), one gateway and
   ``--workers`` (1) MiniLM workers given all three URLs; ``--clients`` (300) closed-loop
   clients send single-text requests with a 30 s client timeout; ``--kill-at`` (10) s in,
   the node leading the pool's work stream is killed -9; the load runs ``--duration``
   (40) s. Reported: non-200 answers (by status and code), client timeouts, wrong vectors,
   the longest request, 200s per second before the kill, in the 5 s after it (a loopback
   election takes about 5 s) and after that, and a per-second timeline.
2. ``overload``: one nats-server, a gateway and ``--overload-workers`` (2) workers;
   ``--burst`` (2,000) clients each send one single-text request at once with
   ``timeout_s: 10`` in the body and a 10 s client timeout. Reported: client timeouts, 200s
   and their latency (p50/p99/max), 429/503 refusals and theirs, how many refusals had
   Retry-After, other statuses, the gateway's peak RSS during the burst, and whether a
   request right after is answered 200.

Processes are started as the fault tests start them (tests/faults/harness.py), with fp32
so a 200's vector can be compared with the one taken before the fault at 1e-5. The load
generator (tests/faults/traffic.py) runs in this process, one HTTP/1.1 connection per
client over asyncio streams (httpx's pool answered 85 requests/s at 400 connections where
the gateway could answer 4,800: tests/faults/rawhttp.py); it records each request's
status, latency and Retry-After, which wrk cannot, and a client's timeout bounds the whole
request. It shares the machine's CPUs with the cluster.
Prints one JSON document and writes DIR/faults_bench.json (DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.server import REPO
from heron.runtime.nats_names import work_consumer, work_stream
from tests.faults.harness import Rig, start_rig
from tests.faults.traffic import (
    Answer,
    at,
    burst,
    closed_loop,
    latency,
    non_200,
    rates_around,
    summary,
)
from tests.support.cluster_procs import ChildProcess
from tests.support.nats_server import NatsCluster, NatsServer

# As the test suite runs its processes (tests/conftest.py): fp32, so answers compare at
# 1e-5 across batch compositions; no hub; one tokenizer thread per process.
CHILD_ENV = {"HERON_PRECISION": "fp32", "HF_HUB_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false"}


def log(message: str) -> None:
    print(f"[faults_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def timeline(answers: list[Answer], end_s: float) -> list[dict[str, int]]:
    """Per second of the run: 200s and other answers finished in it."""
    seconds = [{"ok": 0, "other": 0} for _ in range(int(end_s) + 1)]
    for a in answers:
        second = min(int(a.ended), len(seconds) - 1)
        seconds[second]["ok" if a.status == 200 else "other"] += 1
    return seconds


def leader_kill(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    work_dir.mkdir(parents=True)
    nats = NatsCluster(work_dir / "nats").start()
    rig: Rig | None = None
    try:
        rig = start_rig(nats.url, work_dir, workers=args.workers,
                        env={**CHILD_ENV, "HERON_STREAM_REPLICAS": "3"},
                        gateway_id=f"bench{uuid.uuid4().hex[:6]}", tag="leader")
        stream = work_stream(rig.pool)
        nats.wait_replicas_current(stream, (work_consumer(rig.pool),))
        leader = nats.stream_leader(stream)
        roles = {"killed": leader.name,
                 "led_consumer": nats.consumer_leader(stream, work_consumer(rig.pool))
                 is leader,
                 "had_gateway": nats.node_of_connection(rig.gateway.nats_connection_name)
                 is leader}
        log(f"{args.clients} clients for {args.duration:g} s; kill -9 {leader.name} "
            f"(stream leader) at {args.kill_at:g} s")

        async def run() -> tuple[list[Answer], float]:
            t0 = time.monotonic()
            answers, struck = await asyncio.gather(
                closed_loop(rig.gateway.url, rig.texts, args.clients, args.duration,
                            timeout_s=30.0, t0=t0),
                at(args.kill_at, leader.kill))
            return answers, struck - t0

        answers, struck = asyncio.run(run())
        result = {**summary(answers, rig.ref), **roles, "clients": args.clients,
                  "client_timeout_s": 30.0, "duration_s": args.duration,
                  "kill_at_s": round(struck, 2), "non_200": len(non_200(answers)),
                  "client_timeouts": sum(a.error == "ClientTimeout" for a in answers),
                  **rates_around(answers, struck, args.duration),
                  "stream_leader_after": nats.stream_leader(stream).name,
                  "timeline": timeline(answers, max(a.ended for a in answers))}
        return result
    finally:
        if rig is not None:
            rig.stop()
        nats.stop()


@contextmanager
def peak_rss(proc: ChildProcess, every_s: float = 0.05) -> Iterator[dict[str, int]]:
    """The process's highest resident memory while the block runs."""
    peak = {"bytes": proc.rss_bytes()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak["bytes"] = max(peak["bytes"], proc.rss_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


def overload(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    work_dir.mkdir(parents=True)
    nats = NatsServer(work_dir / "nats").start()
    rig: Rig | None = None
    try:
        rig = start_rig(nats.url, work_dir, workers=args.overload_workers, env=CHILD_ENV,
                        tag="overload")
        rss_before = rig.gateway.rss_bytes()
        log(f"{args.burst} clients at once, timeout_s 10 (body and client)")
        with peak_rss(rig.gateway) as peak:
            started = time.monotonic()
            answers = asyncio.run(burst(rig.gateway.url, rig.texts, args.burst, args.burst,
                                        timeout_s=10.0, body_timeout_s=10.0))
            took = time.monotonic() - started
        after = httpx.post(f"{rig.gateway.url}/v1/encode/minilm",
                           json={"items": ["right after"], "timeout_s": 10}, timeout=30)
        ok = [a for a in answers if a.status == 200]
        refused = [a for a in answers if a.status in (429, 503)]
        return {**summary(answers, rig.ref), "clients": args.burst,
                "workers": args.overload_workers, "burst_took_s": round(took, 2),
                "client_timeouts": sum(a.error == "ClientTimeout" for a in answers),
                "ok_latency": latency(ok), "refused_latency": latency(refused),
                "refused_with_retry_after": sum(bool(a.retry_after) for a in refused),
                "refused_without_retry_after": sum(not a.retry_after for a in refused),
                "other_statuses": {s: n for s, n in summary(answers)["statuses"].items()
                                   if s not in (0, 200, 429, 503)},
                "gateway_rss_mib_before": round(rss_before / 2**20, 1),
                "gateway_rss_mib_peak": round(peak["bytes"] / 2**20, 1),
                "after_status": after.status_code}
    finally:
        if rig is not None:
            rig.stop()
        nats.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["leader", "overload"], default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--kill-at", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--overload-workers", type=int, default=2)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}}
    work_dir = Path(tempfile.mkdtemp(prefix="faults-bench-"))  # kept: the processes' logs
    log(f"logs in {work_dir}")
    if args.only in (None, "leader"):
        result["leader_kill"] = leader_kill(args, work_dir / "leader")
        shown = {k: v for k, v in result["leader_kill"].items() if k != "timeline"}
        log(f"leader kill: {json.dumps(shown)}")
    if args.only in (None, "overload"):
        result["overload"] = overload(args, work_dir / "overload")
        log(f"overload: {json.dumps(result['overload'])}")
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults_bench.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
