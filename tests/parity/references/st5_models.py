"""The same sentence-transformers checkpoints as st_models.py, written by ST 5 (its older
file layout: module types such as sentence_transformers.models.Pooling).
# reference venv: parity
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv = [sys.argv[0], sys.argv[1], "st5-"]
    runpy.run_path(str(Path(__file__).with_name("st_models.py")), run_name="__main__")
