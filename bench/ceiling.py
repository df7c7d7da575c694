"""The raw-model ceiling: MiniLM through transformers alone, no server, no HTTP.

Run in its own process after the server has stopped, so the two never share the CPU:

    python -m bench.ceiling TEXTS_JSON [--seconds S] [--batch-size 32] [--threads N]

Texts are sorted by token length and run in batches (inference_mode, mean pooling,
L2-normalised; fp32, or with ``--precision bf16`` under bf16 autocast exactly as the
server runs it), pass after pass until the time budget is spent. A pass times the whole
path from texts to vectors (tokenize + forward + pool); its forward share is reported too.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from bench.server import on_cpus
from bench.texts import model_dir

MAX_LENGTH = 256  # the bundle's max_sequence_length for MiniLM


def _embed(model: Any, tokenizer: Any, texts: list[str],
           autocast: torch.dtype | None = None) -> tuple[torch.Tensor, float]:
    """Vectors and the seconds spent in tokenization."""
    started = time.perf_counter()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH,
                    return_tensors="pt")
    tokenize_s = time.perf_counter() - started
    if autocast is None:
        hidden = model(**enc).last_hidden_state
    else:
        with torch.autocast("cpu", dtype=autocast):
            hidden = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=-1), tokenize_s


def measure(texts: list[str], *, seconds: float, batch_size: int, min_passes: int = 2,
            max_passes: int = 10, precision: str = "fp32") -> dict[str, Any]:
    autocast = torch.bfloat16 if precision == "bf16" else None
    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).float().eval()
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True,
                                             max_length=MAX_LENGTH)["input_ids"]]
    ordered = [t for _, t in sorted(zip(lengths, texts, strict=True), key=lambda p: p[0])]
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    passes: list[dict[str, float]] = []
    with torch.inference_mode():
        for batch in (batches[0], batches[-1]):  # warm-up: shortest and longest batch
            _embed(model, tokenizer, batch, autocast)
        budget_end = time.perf_counter() + seconds
        while len(passes) < max_passes and (len(passes) < min_passes
                                            or time.perf_counter() < budget_end):
            tokenize_s = 0.0
            started = time.perf_counter()
            for batch in batches:
                tokenize_s += _embed(model, tokenizer, batch, autocast)[1]
            elapsed = time.perf_counter() - started
            passes.append({"seconds": round(elapsed, 3),
                           "sentences_per_s": round(len(texts) / elapsed, 1),
                           "forward_only_per_s": round(len(texts) / (elapsed - tokenize_s), 1)})
    rates = sorted(p["sentences_per_s"] for p in passes)
    return {
        "sentences_per_s": rates[-1],  # best pass: a ceiling
        "sentences_per_s_median": rates[len(rates) // 2],
        "forward_only_per_s": max(p["forward_only_per_s"] for p in passes),
        "batch_size": batch_size,
        "dtype": "bfloat16" if autocast is not None else "float32",
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "n_texts": len(texts),
        "passes": passes,
    }


def run_separately(texts_file: Path, *, seconds: float, batch_size: int = 32,
                   dtype: str | None = None, threads: int = 0,
                   processes: int = 1, cpus: set[int] | None = None) -> dict[str, Any]:
    """This module in its own process (the server must be stopped first), at the precision
    a server reported as its ``dtype`` (``bfloat16`` -> bf16 autocast).

    ``processes`` > 1 runs that many at once, ``threads`` each, the way ``heron serve
    --workers`` splits the CPU; the result's ``sentences_per_s`` is their sum. ``cpus``
    confines them to those CPUs."""
    cmd = [sys.executable, "-m", "bench.ceiling", str(texts_file), "--seconds", f"{seconds:g}",
           "--batch-size", str(batch_size),
           "--precision", "bf16" if dtype == "bfloat16" else "fp32"]
    if threads:
        cmd += ["--threads", str(threads)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent,
                              preexec_fn=on_cpus(cpus))
             for _ in range(processes)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=seconds * 10 + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"ceiling run failed (exit {proc.returncode}):\n{err}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    if processes == 1:
        return results[0]
    combined = dict(results[0])
    for key in ("sentences_per_s", "sentences_per_s_median", "forward_only_per_s"):
        combined[key] = round(sum(r[key] for r in results), 1)
    combined.update(processes=processes, per_process=[r["sentences_per_s"] for r in results])
    return combined


def best_ceiling(texts_file: Path, *, seconds: float, dtype: str | None,
                 processes: int = 1, threads: int = 0, batch_size: int = 32,
                 log: Any = None, cpus: set[int] | None = None) -> dict[str, Any]:
    """The ceiling for a server of ``processes`` x ``threads``: the raw model in one process
    with all threads, and, for several server processes, the same layout of raw-model
    processes at once. The better of the two is the ceiling; both are reported."""
    single = run_separately(texts_file, seconds=seconds, batch_size=batch_size, dtype=dtype,
                            threads=0 if processes > 1 else threads, cpus=cpus)
    if processes == 1:
        return single
    if log is not None:
        log(f"ceiling in the server's layout: {processes} processes x {threads} threads")
    layout = run_separately(texts_file, seconds=seconds, batch_size=batch_size, dtype=dtype,
                            threads=threads, processes=processes, cpus=cpus)
    best = max((single, layout), key=lambda c: c["sentences_per_s"])
    return {**best, "one_process": single["sentences_per_s"],
            "server_layout": layout["sentences_per_s"]}


def interleaved_pairs(pairs: int, ceiling: Callable[[], float],
                      server_step: Callable[[], dict[str, Any]], *,
                      log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``pairs`` x (the ceiling, then at once a 64-client step on the server): ratios of
    measurements taken seconds apart, so a drift of the machine's speed over minutes
    (5-12% seen on the CI machine) cancels out. The server stays up, idle, while the
    ceiling runs."""
    runs = []
    for i in range(pairs):
        top = ceiling()
        step = server_step()
        ratio = step["throughput_rps"] / top
        runs.append({"ceiling": top, "server": step["throughput_rps"],
                     "latency_ms": step["latency_ms"], "non_2xx": step["non_2xx"],
                     "ratio": round(ratio, 3)})
        if log is not None:
            log(f"pair {i + 1}/{pairs}: ceiling {top}/s, server {step['throughput_rps']}/s "
                f"at 64 clients: {ratio:.1%}")
    ratios = sorted(r["ratio"] for r in runs)
    return {"connections": 64, "runs": runs, "median_ratio": ratios[len(ratios) // 2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", type=Path, help="JSON file: a list of strings")
    parser.add_argument("--seconds", type=float, default=20.0, help="time budget for passes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: under bf16 autocast, as heron serves on such CPUs")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = json.loads(args.texts.read_text())
    result = measure(texts, seconds=args.seconds, batch_size=args.batch_size,
                     precision=args.precision)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
