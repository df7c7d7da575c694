"""MaxSim scoring micro-benchmark: one query against 100 documents of about 128 tokens.

    python -m bench.maxsim_bench --url http://127.0.0.1:8080 --model MODEL [--calls 50]
                                 [--out FILE]

MODEL is a multi-vector (ColBERT) model served by a running ``heron serve``. Sequential SDK
``score`` calls (the documents are encoded on every call, as a reranker's are), then the
MaxSim step alone, in process, on random unit vectors of the same shape
(``worker/adapters/multi_vector.py``'s ``maxsim_scores``). Prints one JSON document (and
writes it to FILE with ``--out``): docs/s and p50/p99 latency of the calls, and the
in-process MaxSim time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from heron_sdk import Client

DOCUMENTS = 100
DOC_WORDS = 120  # common words, about one token each: ~128 tokens with the special tokens
QUERY = "where does the heron fish in the morning light?"
_WORDS = ("the heron stood in shallow water of river while small fish moved around its legs "
          "and morning light came over hills city market price garden kitchen window table "
          "letter paper book library museum science history music sport travel weather "
          "law medicine people world life hand part child place work case point").split()


def documents(count: int = DOCUMENTS, words: int = DOC_WORDS, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(count)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def served(url: str, model: str, calls: int) -> dict[str, Any]:
    docs = documents()
    latencies: list[float] = []
    tokens = 0
    with Client(url) as client:
        for _ in range(3):  # warm the connection and the model
            client.score(model, QUERY, docs)
        for _ in range(calls):
            started = time.perf_counter()
            result = client.score(model, QUERY, docs)
            latencies.append(time.perf_counter() - started)
        tokens = int(result.raw.get("usage", {}).get("tokens", 0))
    total = sum(latencies)
    return {"calls": calls, "documents_per_call": len(docs),
            "tokens_per_call": tokens, "docs_per_s": round(calls * len(docs) / total, 1),
            "p50_ms": round(statistics.median(latencies) * 1000, 2),
            "p99_ms": round(_percentile(latencies, 0.99) * 1000, 2)}


def maxsim_only(dim: int = 128, query_tokens: int = 32, doc_tokens: int = 128,
                repeats: int = 200) -> dict[str, Any]:
    """The scoring step alone: what ``similarity`` costs once the vectors exist."""
    from heron.worker.adapters.multi_vector import maxsim_scores

    rng = np.random.default_rng(0)

    def unit(n: int) -> np.ndarray:
        x = rng.standard_normal((n, dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    query, docs = unit(query_tokens), [unit(doc_tokens) for _ in range(DOCUMENTS)]
    maxsim_scores(query, docs)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        maxsim_scores(query, docs)
        times.append(time.perf_counter() - started)
    p50 = statistics.median(times)
    return {"dim": dim, "query_tokens": query_tokens, "doc_tokens": doc_tokens,
            "p50_ms": round(p50 * 1000, 3), "docs_per_s": round(DOCUMENTS / p50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running heron serve (omit: in-process MaxSim only)")
    parser.add_argument("--model", help="a multi-vector model it serves")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"maxsim_in_process": maxsim_only()}
    if args.url:
        if not args.model:
            parser.error("--model is needed with --url")
        report["served"] = {"model": args.model, **served(args.url, args.model, args.calls)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
