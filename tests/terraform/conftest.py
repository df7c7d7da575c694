"""Terraform under terraform/, parsed with python-hcl2 (no providers, no network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hcl2
import pytest

ROOT = Path(__file__).resolve().parents[2] / "terraform"
TF_FILES = sorted(ROOT.rglob("*.tf"))
MODULES = {p.name: p for p in sorted((ROOT / "modules").iterdir()) if p.is_dir()}
EXAMPLES = {p.name: p for p in sorted((ROOT / "examples").iterdir()) if p.is_dir()}


def unquote(value: Any) -> Any:
    """python-hcl2 keeps the quotes of block labels and string literals; drop them."""
    if isinstance(value, str):
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1]
        return value
    if isinstance(value, list):
        return [unquote(v) for v in value]
    if isinstance(value, dict):
        return {unquote(k): unquote(v) for k, v in value.items() if k != "__is_block__"}
    return value


def parse(path: Path) -> dict[str, list[Any]]:
    with path.open() as f:
        return unquote(hcl2.load(f))


def load_dir(directory: Path) -> dict[str, dict[str, Any]]:
    """One Terraform directory as {kind: {name: body}}: kind is "variable", "output",
    "module", "resource.<type>" or "data.<type>"."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.tf")):
        doc = parse(path)
        for kind in ("variable", "output", "module", "locals"):
            for block in doc.get(kind, []):
                for name, body in block.items():
                    out.setdefault(kind, {})[name] = body
        for kind in ("resource", "data"):
            for block in doc.get(kind, []):
                for rtype, named in block.items():
                    for name, body in named.items():
                        out.setdefault(f"{kind}.{rtype}", {})[name] = body
    return out


@pytest.fixture(scope="session")
def aws() -> dict[str, dict[str, Any]]:
    return load_dir(MODULES["aws"])


@pytest.fixture(scope="session")
def gcp() -> dict[str, dict[str, Any]]:
    return load_dir(MODULES["gcp"])


def one(blocks: Any) -> dict[str, Any]:
    """A nested block that must appear exactly once (hcl2 gives a list of them)."""
    assert isinstance(blocks, list) and len(blocks) == 1, blocks
    return blocks[0]
