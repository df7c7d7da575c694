"""The client installs alone: the heron-sdk wheel in a fresh venv runs the README's SDK
example against a live server, and nothing of the server comes with it.

The example is read from README.md at test time (the python block under "### Python SDK"),
so the README cannot drift from what a user of the wheel gets. pip fetches httpx, msgpack,
numpy and orjson from the configured index (its cache makes that quick: about 5 s here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import REPO
from tests.support.wheels import SDK_SOURCES, build_wheel

README = REPO / "README.md"
DOC_URL = "http://127.0.0.1:8080"
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def readme_sdk_example() -> str:
    """The first python block of README.md's "### Python SDK" section."""
    section = README.read_text().split("\n### Python SDK\n", 1)[1]
    # Up to the next section heading (a "# " line may be a comment inside a code block).
    section = re.split(r"^#{2,3} ", section, maxsplit=1, flags=re.MULTILINE)[0]
    blocks = [m.group(2) for m in _FENCE.finditer(section) if m.group(1) == "python"]
    assert blocks, "README.md: no python block under ### Python SDK"
    return blocks[0]


def _run(python: Path, args: list[str], cwd: Path, timeout: float = 300) -> \
        subprocess.CompletedProcess[str]:
    # Outside the repository and with no PYTHONPATH: only what the venv installed imports.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_the_sdk_wheel_alone_runs_the_readme_example(base_url: str, tmp_path: Path) -> None:
    wheel = build_wheel(SDK_SOURCES, tmp_path / "build")
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run(python, ["-m", "pip", "install", "--quiet", str(wheel.path)], tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    code = readme_sdk_example().replace(DOC_URL, base_url)
    ran = _run(python, ["-c", code], tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stderr
    shape, ranked = ran.stdout.strip().splitlines()
    assert shape == "(2, 384)"  # encode: two MiniLM vectors, as numpy
    index, score = ranked.split()
    assert index == "1" and 0 < float(score) <= 1  # score: Paris ranks first

    for server_module in ("torch", "transformers", "starlette", "uvicorn", "nats", "boto3",
                          "heron"):
        tried = _run(python, ["-c", f"import {server_module}"], tmp_path, timeout=60)
        assert tried.returncode != 0 and "ModuleNotFoundError" in tried.stderr, server_module
