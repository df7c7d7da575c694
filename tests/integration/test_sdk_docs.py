"""docs/sdk.md and the README's Python run against live servers.

Every ```python block of docs/sdk.md runs, in order, in one namespace (later blocks use
the ``client`` of the first), against the session's `heron serve`, in a folder holding the
image files the image example opens. Blocks that lease a pool run against the session's
cluster gateway, with a worker for the pool. The README's
python blocks run too, and the ```bash block of `heron ...` lines runs each command.
Public model names map to the test bundle's stand-ins, as for docs/api.md.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import heron_sdk
from tests.integration.test_docs_examples import DOC_MODEL_ALIASES
from tests.support.gateway_harness import FakeWorker
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO
from tests.support.tiny_vision import image_bytes

SDK_MD = REPO / "docs" / "sdk.md"
DOC_URL = "http://127.0.0.1:8080"
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def blocks(path: Path, lang: str) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(path.read_text()) if m.group(1) == lang]


def for_tests(code: str, url: str) -> str:
    code = code.replace(DOC_URL, url)
    for public, stand_in in DOC_MODEL_ALIASES.items():
        code = code.replace(f'"{public}"', f'"{stand_in}"')
    return code


def run_python(code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<docs>", "exec"), namespace)  # our own docs, nothing else
    return out.getvalue()


def test_sdk_md_python_blocks_run(base_url: str, cluster_url: str, nats_server: NatsServer,
                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The image examples open cat.jpg and dog.png (the tiny CLIP takes any size)
    (tmp_path / "cat.jpg").write_bytes(image_bytes(40, 30, "JPEG", seed=1))
    (tmp_path / "dog.png").write_bytes(image_bytes(24, 36, "PNG", seed=2))
    monkeypatch.chdir(tmp_path)
    code_blocks = blocks(SDK_MD, "python")
    assert len(code_blocks) >= 8
    namespace: dict = {"gateway_url": cluster_url}
    printed = []
    for code in code_blocks:
        if ".pool(" not in code:
            printed.append(run_python(for_tests(code, base_url), namespace))
            continue
        # The cluster fixture's bundle is the test bundle ("test"); a worker for the pool
        # answers with stand-in vectors.
        worker = FakeWorker(nats_server.url, "team-a", "test").start()
        try:
            code = for_tests(code, cluster_url).replace('bundle="default"', 'bundle="test"')
            printed.append(run_python(code, namespace))
        finally:
            worker.stop()
    text = "".join(printed)
    assert "sentence-transformers/all-MiniLM-L6-v2" in text and "(2, 384)" in text
    assert "404 MODEL_NOT_FOUND" in text and "422 INVALID_FIELD dims" in text
    assert "team-a lease" in text and "[]" in text
    assert "(3, 16)" in text  # the image example: three items of the tiny CLIP's 16 dims
    namespace["client"].close()


def test_readme_python_blocks_run(base_url: str) -> None:
    for code in blocks(REPO / "README.md", "python"):
        assert run_python(for_tests(code, base_url), {}).strip()


def test_sdk_md_cli_lines_run(base_url: str) -> None:
    lines = [line for block in blocks(SDK_MD, "bash") for line in block.splitlines()
             if line.startswith("heron ")]
    assert len(lines) == 5
    for line in lines:
        args = shlex.split(for_tests(line, base_url))[1:]
        args = [DOC_MODEL_ALIASES.get(a, a) for a in args]
        out = subprocess.run([sys.executable, "-m", "heron.cli", *args], capture_output=True,
                             text=True, timeout=60, cwd=REPO,
                             env={**os.environ, "HERON_URL": base_url})
        assert out.returncode == 0, f"{line}: {out.stderr}"
        assert out.stdout.startswith("{"), line


@pytest.mark.parametrize("path", [SDK_MD, REPO / "README.md"])
def test_docs_name_only_existing_sdk_names(path: Path) -> None:

    for name in re.findall(r"from heron_sdk import ([\w, ]+)", path.read_text()):
        for part in name.split(","):
            assert hasattr(heron_sdk, part.strip()), f"{path.name}: heron_sdk has no {part.strip()}"
