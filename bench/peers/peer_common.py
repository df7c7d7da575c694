"""Shared by the peer servers: command line, offline MiniLM loading.

Each peer script runs under bench/peers/.venv (bench/peers/setup.sh), never the project's
venv, and takes the same arguments:

    bench/peers/.venv/bin/python bench/peers/NAME_server.py --port P --model DIR
        [--host 127.0.0.1] [--batch-size 32] [--batch-wait-ms 10] [--precision fp32]

The model loads from the local directory only (HF_HUB_OFFLINE=1): no hub here.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# Before anything imports huggingface_hub: local files only, no telemetry.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_ENV = "PEER_MODEL_DIR"


def parse_args(description: str, *, batching: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=os.environ.get(MODEL_ENV, ""),
                        help="local sentence-transformers directory (all-MiniLM-L6-v2)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: bf16 weights (sentence-transformers' model_kwargs dtype)")
    if batching:
        parser.add_argument("--batch-size", type=int, default=32, help="largest batch")
        parser.add_argument("--batch-wait-ms", type=float, default=10.0,
                            help="longest wait for a batch to fill")
    args, _ = parser.parse_known_args()  # mosec parses the same argv for its own options
    if not args.model:
        parser.error(f"--model (or ${MODEL_ENV}) is required")
    os.environ[MODEL_ENV] = args.model  # for worker processes a framework spawns
    return args


def load_model(path: str, precision: str = "fp32") -> Any:
    """sentence-transformers on CPU, torch's default thread count; fp32, or bf16 weights
    (sentence-transformers' own way; it returns float32 vectors either way)."""
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs = {"torch_dtype": torch.bfloat16} if precision == "bf16" else {}
    model = SentenceTransformer(path, device="cpu", local_files_only=True, model_kwargs=kwargs)
    return model.eval()
