"""docs/frameworks.md runs: each framework's ```python block against the session's
`heron serve` (public model names mapped to the test bundle's stand-ins, as for
docs/sdk.md), printing what its comments say; and each install line names an extra that
sdk/pyproject.toml defines."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.integration.test_sdk_docs import blocks, for_tests, run_python
from tests.support.servers import REPO

FRAMEWORKS_MD = REPO / "docs" / "frameworks.md"
_PRINTED = re.compile(r"print\(.*\)\s*#\s*(.+)$")


def _promised(code: str) -> list[str]:
    """What the block's ``print(...)  # ...`` comments say it prints, in order (the page
    prints no reranker's choice: the test bundle's reranker is a random tiny model)."""
    return [m.group(1).strip() for line in code.splitlines()
            if (m := _PRINTED.search(line))]


@pytest.mark.parametrize("index", range(3), ids=["langchain", "llama_index", "haystack"])
def test_each_python_block_runs_and_prints_what_it_says(base_url: str, index: int) -> None:
    code = blocks(FRAMEWORKS_MD, "python")[index]
    printed = run_python(for_tests(code, base_url), {"__name__": "__docs__"})
    assert printed.splitlines() == _promised(code)


def test_one_example_and_one_install_line_per_framework() -> None:
    assert len(blocks(FRAMEWORKS_MD, "python")) == 3
    extras = tomllib.loads((REPO / "sdk" / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = [re.search(r"\./sdk\[(\w+)\]", line).group(1)
             for block in blocks(FRAMEWORKS_MD, "sh") for line in block.splitlines()]
    assert named == ["langchain", "llamaindex", "haystack"]
    assert set(named) <= set(extras)
