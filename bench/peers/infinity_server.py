"""The Infinity peer (infinity-emb): its own CLI, ``infinity_emb v2``, exec'd in place.

Torch engine on the CPU, fp32 (``--precision bf16``: Infinity's ``--dtype bfloat16``),
Infinity's dynamic batching with ``--batch-size`` (its
default, 32); no vector disk cache; the model served under the name ``minilm``.
``--batch-wait-ms`` is accepted for a uniform command line but Infinity has no such
setting: its batch handler takes whatever is queued when the model is free.

    POST /embeddings {"model": "minilm", "input": ["..."]} (OpenAI style)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import peer_common

ARGS = peer_common.parse_args(__doc__ or "")

if __name__ == "__main__":
    cli = Path(sys.executable).with_name("infinity_emb")
    dtype = "bfloat16" if ARGS.precision == "bf16" else "float32"
    argv = [str(cli), "v2", "--model-id", ARGS.model, "--served-model-name", "minilm",
            "--engine", "torch", "--device", "cpu", "--dtype", dtype,
            "--batch-size", str(ARGS.batch_size), "--no-vector-disk-cache",
            "--host", ARGS.host, "--port", str(ARGS.port), "--log-level", "warning"]
    os.execv(argv[0], argv)
