"""Run a command as if the model stack were not installed (the control image has none)."""

from __future__ import annotations

from pathlib import Path

MODEL_STACK = ("torch", "transformers", "tokenizers", "safetensors", "sentencepiece",
               "huggingface_hub")
BLOCKER = f'''"""Test helper: the model stack is not installed, as in the control image."""
import sys

for name in {MODEL_STACK!r}:
    sys.modules[name] = None
'''


def without_model_stack(tmp_path: Path) -> dict[str, str]:
    """Environment for a child process in which ``import torch`` (and the rest of the
    model stack) raises ModuleNotFoundError: a sitecustomize on PYTHONPATH puts None in
    sys.modules for each."""
    site = tmp_path / "no-torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": str(site)}
