"""GLiNER zero-shot extraction under closed-loop HTTP load: items/s at 1 and 8 clients.

    python -m bench.gliner_bench [--seconds 10] [--clients 1,8] [--threads N] [--out FILE]

Serves a tiny random-weight GLiNER span model (tests/support/tiny_models.py's stand-in: a
2-layer, 32-wide BERT backbone, an LSTM and the span layers, in gliner's saved format) with
``heron serve --workers 1`` on the CPU, and sends one-text ``extract`` requests from N
client threads, each request with one of four label sets (2 to 6 labels, threshold 0.5) in
turn, so concurrent requests carry different labels and share batches. The texts are
bench/texts.py's workload (about 20 tokens, 8 to 128). Prints one JSON document (and writes
it to FILE, default bench/results/gliner_bench.json): per step, items/s and p50/p99
latency, and the machine's load average before the run. The load generator is Python and
shares the machine's cores with the server. ``--threads``: the server's torch threads
(default: its own choice).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.server import REPO, start_server
from bench.texts import build_workload

LABEL_SETS = [["person", "location"],
              ["organization", "date", "money"],
              ["person", "organization", "location", "product"],
              ["city", "country", "event", "person", "date", "law"]]
MODEL = "bench/tiny-gliner"


def _bundle(root: Path) -> Path:
    from tests.support.tiny_models import build_gliner_model  # torch: only when run

    model = build_gliner_model(root / "tiny-gliner")
    (root / "models").mkdir()
    config = {"id": MODEL, "source": {"path": str(model)}}
    (root / "models" / "gliner.yaml").write_text(yaml.safe_dump(config))
    bundle = root / "gliner.yaml"
    bundle.write_text(yaml.safe_dump({"name": "gliner-bench", "models": ["gliner.yaml"]}))
    return bundle


def _step(url: str, texts: list[str], clients: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(index: int) -> None:
        nonlocal errors
        with httpx.Client(base_url=url, timeout=60) as http:
            n = index
            while time.monotonic() < stop:
                body = {"items": [texts[n % len(texts)]], "labels": LABEL_SETS[n % 4],
                        "threshold": 0.5}
                started = time.perf_counter()
                try:
                    status = http.post(f"/v1/extract/{MODEL}", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                took = time.perf_counter() - started
                with lock:
                    if status == 200:
                        latencies.append(took)
                    else:
                        errors += 1
                n += clients

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - began
    ordered = sorted(latencies)
    return {"clients": clients, "items": len(latencies), "errors": errors,
            "items_per_s": round(len(latencies) / elapsed, 1),
            "p50_ms": round(statistics.median(ordered) * 1000, 2) if ordered else None,
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2)
            if ordered else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" /
                        "gliner_bench.json")
    args = parser.parse_args()
    texts = build_workload(512).texts
    steps = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with start_server(root / "serve.log", bundle=str(_bundle(root)), workers="1",
                          threads=args.threads) as server:
            _step(server.url, texts, 4, 2.0)  # warm-up
            for clients in (int(c) for c in args.clients.split(",")):
                steps.append(_step(server.url, texts, clients, args.seconds))
    if any(step["errors"] or not step["items"] for step in steps):
        raise SystemExit(f"requests failed: {steps}")
    result = {"bench": "gliner", "model": "tiny random GLiNER span model (BERT 2x32, LSTM)",
              "device": "cpu", "cpus": os.cpu_count(), "load_avg_before": load_before,
              "server": "heron serve --workers 1" + (f" --threads {args.threads}"
                                                     if args.threads else ""),
              "label_sets": LABEL_SETS, "seconds_per_step": args.seconds, "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
