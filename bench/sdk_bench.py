"""SDK benchmark: what the Python client adds on top of the HTTP API.

    python -m bench.sdk_bench [--quick] [--out DIR]

Against ``heron serve --bundle null`` (real tokenizer, no model compute, so the client and
the HTTP path are all there is), on loopback:

1. Sequential single-text calls: p50/p99 latency and calls/s for raw httpx + JSON (the
   floor), the SDK over msgpack and the SDK over JSON.
2. Bulk: one call of 256 texts, repeated: items/s for the same three, and 5,000 texts in
   one SDK call (split into 2048-item requests and stitched).
3. AsyncClient with 32 concurrent single-text calls: calls/s.

Prints one JSON document and writes DIR/sdk_bench.json (DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.server import REPO, start_server
from heron_sdk import AsyncClient, Client

MODEL = "heron/null"


def timed(call: Callable[[], Any], count: int) -> dict[str, float]:
    call()  # warm the connection
    latencies = []
    started = time.perf_counter()
    for _ in range(count):
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"calls_per_s": round(count / elapsed, 1),
            "p50_ms": round(statistics.median(latencies) * 1000, 3),
            "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 3)}


def sequential(url: str, count: int) -> dict[str, Any]:
    body = {"items": ["the heron waits in the shallows"]}
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url) as raw:
        out["httpx_json"] = timed(lambda: raw.post(f"/v1/encode/{MODEL}", json=body).json(),
                                  count)
    for wire in ("msgpack", "json"):
        with Client(url, wire=wire) as client:
            out[f"sdk_{wire}"] = timed(lambda c=client: c.encode(MODEL, body["items"]), count)
    return out


def bulk(url: str, count: int) -> dict[str, Any]:
    texts = [f"text number {n} about herons and shallows" for n in range(256)]
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url) as raw:
        stats = timed(lambda: raw.post(f"/v1/encode/{MODEL}", json={"items": texts}).json(),
                      count)
        out["httpx_json_items_per_s"] = round(stats["calls_per_s"] * len(texts))
    for wire in ("msgpack", "json"):
        with Client(url, wire=wire) as client:
            stats = timed(lambda c=client: c.encode(MODEL, texts).dense, count)
            out[f"sdk_{wire}_items_per_s"] = round(stats["calls_per_s"] * len(texts))
    many = [f"item {n}" for n in range(5000)]
    with Client(url) as client:
        started = time.perf_counter()
        result = client.encode(MODEL, many)
        elapsed = time.perf_counter() - started
    assert len(result) == len(many)
    out["split_5000_items_s"] = round(elapsed, 3)
    return out


async def concurrent(url: str, calls: int, width: int = 32) -> dict[str, Any]:
    async with AsyncClient(url) as client:
        await client.encode(MODEL, ["warm"])
        gate = asyncio.Semaphore(width)

        async def one(n: int) -> None:
            async with gate:
                await client.encode(MODEL, [f"concurrent call {n}"])

        started = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(calls)))
        elapsed = time.perf_counter() - started
    return {"concurrency": width, "calls_per_s": round(calls / elapsed, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    scale = 0.2 if args.quick else 1.0
    args.out.mkdir(parents=True, exist_ok=True)
    with start_server(args.out / "sdk_bench_serve.log", bundle="null") as server:
        report = {
            "server": "heron serve --bundle null (no model compute), loopback",
            "sequential_single_text": sequential(server.url, int(2000 * scale)),
            "bulk_256_texts": bulk(server.url, int(100 * scale)),
            "async_concurrent": asyncio.run(concurrent(server.url, int(4000 * scale))),
        }
    text = json.dumps(report, indent=2)
    (args.out / "sdk_bench.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
