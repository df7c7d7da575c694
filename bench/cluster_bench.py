"""Cluster benchmark: the gateway -> JetStream -> worker -> inbox path against the same
worker served directly, and Heron's own overhead with the null model.

    python -m bench.cluster_bench [--quick] [--out DIR]

1. ``heron up`` (one worker, default bundle, MiniLM) on free loopback ports. wrk drives the
   worker's own HTTP API (direct) and the gateway (cluster path) with the same single-text
   requests at 1, 8, 32 and 64 connections; the ratio is cluster / direct throughput.
2. ``heron up --bundle null`` (no model compute): items/s through the cluster path with
   64-item requests, and the latency the cluster path adds at one connection.
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

from bench.ceiling import run_separately
from bench.load import run_wrk, write_bodies
from bench.server import REPO, free_port, http
from bench.texts import LONG_TAIL, build_workload


def log(message: str) -> None:
    print(f"[cluster_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


@contextlib.contextmanager
def local_cluster(bundle: str, data_dir: Path) -> Iterator[tuple[str, str]]:
    """(gateway URL, worker URL) of a ready ``heron up`` with one worker."""
    port, nats_port = free_port(), free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "up.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "heron.cli", "up", "--port", str(port), "--nats-port",
             str(nats_port), "--config-port", "0", "--data-dir", str(data_dir), "--bundle",
             bundle, "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ})
    gateway = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        worker = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text())
            found = re.search(r"worker \S+ starting \((http://[^)]+)\)", log_path.read_text())
            worker = found.group(1) if found else None
            with contextlib.suppress(OSError):
                if worker and http("GET", f"{gateway}/readyz", timeout=2)[0] == 200 and \
                        http("GET", f"{worker}/readyz", timeout=2)[0] == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"cluster not ready:\n{log_path.read_text()}")
        assert worker is not None
        yield gateway, worker
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def step(url: str, bodies: Path, connections: int, duration_s: float) -> dict[str, Any]:
    return run_wrk(url, bodies, connections=connections, duration_s=duration_s).summary()


def run(quick: bool, out: Path, long_tail: bool = False) -> dict[str, Any]:
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

    log("MiniLM: direct worker vs gateway path")
    rows = []
    with local_cluster("default", work / "minilm") as (gateway, worker):
        dtype = http("GET", f"{worker}/v1/models/minilm")[1].get("dtype")
        for path in (f"{worker}/v1/encode/minilm", f"{gateway}/v1/encode/minilm"):
            step(path, single, 8, 3.0)  # warm-up
        for c in connections:
            direct = step(f"{worker}/v1/encode/minilm", single, c, duration)
            cluster = step(f"{gateway}/v1/encode/minilm", single, c, duration)
            row = {"connections": c, "direct": direct, "cluster": cluster,
                   "ratio": round(cluster["throughput_rps"] /
                                  max(direct["throughput_rps"], 1e-9), 3)}
            log(f"c={c}: direct {direct['throughput_rps']}/s, cluster "
                f"{cluster['throughput_rps']}/s (ratio {row['ratio']})")
            rows.append(row)
    result["minilm"] = rows
    log(f"the raw-model ceiling ({dtype}), with the cluster stopped")
    texts_file = work / "texts.json"
    texts_file.write_text(json.dumps(texts))
    ceiling = run_separately(texts_file, seconds=6.0 if quick else 20.0, dtype=dtype)
    result["ceiling"] = {k: ceiling[k] for k in ("sentences_per_s", "dtype", "batch_size")}
    for row in rows:
        for side in ("direct", "cluster"):
            row[f"{side}_to_ceiling"] = round(row[side]["throughput_rps"]
                                              / ceiling["sentences_per_s"], 3)

    log("null model: Heron's own overhead")
    batch = work / "batch64.txt"
    batch.write_text("".join(json.dumps({"items": texts[i:i + 64]}) + "\n"
                             for i in range(0, len(texts) - 63, 64)))
    with local_cluster("null", work / "null") as (gateway, worker):
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
    args = parser.parse_args(argv)
    print(json.dumps(run(args.quick, args.out, args.long_tail), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
