"""The model catalogue: its configs parse and pin Hub commits, its bundle loads, and
``heron models --catalog`` and docs/models.md show the same table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from heron.cli.catalog import CatalogEntry, load_catalog, parse_description
from heron.runtime.adapters import ADAPTER_FAMILIES, AUTO
from heron.runtime.modelconfig import ConfigError, load_bundle, parse_model_config
from tests.support.servers import REPO

CATALOG_DIR = REPO / "bundles" / "models" / "catalog"
CATALOG_FILES = sorted(CATALOG_DIR.glob("*.yaml"))
SHA = re.compile(r"[0-9a-f]{40}")
# The families a catalogue config may name or detect to.
FAMILIES = ("dense", "sparse", "multi_vector", "cross_encoder", "bge_m3")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "heron.cli", "models", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture(scope="module")
def entries() -> list[CatalogEntry]:
    return load_catalog()


def test_the_catalogue_has_its_models() -> None:
    assert len(CATALOG_FILES) >= 25


@pytest.mark.parametrize("path", CATALOG_FILES, ids=lambda p: p.stem)
def test_each_config_parses_and_pins_a_hub_commit(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    config = parse_model_config(data, str(path))
    assert config.source.hub == config.id
    revision = config.source.revision
    # A found commit, or "main" where none was found (listed in the catalogue's report).
    assert revision == "main" or SHA.fullmatch(revision or ""), revision
    assert config.adapter == AUTO or config.adapter in FAMILIES
    # Where each value came from is the file's first comment lines.
    comments = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(line.startswith("# revision: ") for line in comments)
    assert any(line.startswith("# metadata: ") for line in comments)


@pytest.mark.parametrize("path", CATALOG_FILES, ids=lambda p: p.stem)
def test_each_description_is_a_table_row_that_agrees_with_the_config(path: Path) -> None:
    config = parse_model_config(yaml.safe_load(path.read_text()), str(path))
    row = parse_description(config.description, str(path))
    assert row["family"] in FAMILIES
    if config.adapter != AUTO:
        assert row["family"] == config.adapter
    outputs = [o.strip() for o in row["outputs"].split(",")]
    if row["family"] == "cross_encoder":
        assert outputs == ["score"] and row["dims"] == "-"
    else:
        assert set(outputs) <= ADAPTER_FAMILIES[row["family"]].output_types
        assert row["dims"].isdigit()
    assert row["max_length"] == "-" or row["max_length"].isdigit()
    assert row["license"]


def test_a_description_out_of_form_names_the_file() -> None:
    with pytest.raises(ConfigError, match=r"x\.yaml: description: .*family: VALUE"):
        parse_description("a dense model", "x.yaml")
    with pytest.raises(ConfigError, match="description"):
        parse_description("family: dense | outputs: dense | dims: 1 | max length: 2", "x.yaml")


def test_ids_are_unique_and_the_bundle_lists_every_file(entries: list[CatalogEntry]) -> None:
    ids = [e.id for e in entries]
    assert len(ids) == len(set(ids))
    bundle = yaml.safe_load((REPO / "bundles" / "catalog.yaml").read_text())
    assert sorted(bundle["models"]) == sorted(f"catalog/{p.name}" for p in CATALOG_FILES)


def test_the_bundle_loads_and_downloads_nothing_at_start() -> None:
    bundle = load_bundle("catalog")
    assert bundle.name == "catalog"
    assert len(bundle.models) == len(CATALOG_FILES)
    assert bundle.preload == ()
    assert all(m.source.hub for m in bundle.models)


def _docs_rows() -> list[tuple[str, ...]]:
    text = (REPO / "docs" / "models.md").read_text()
    section = text.split("\n## Model catalogue\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("Model", "---"):
            continue
        rows.append((cells[0].strip("`"), *cells[1:]))
    return rows


def test_the_docs_table_is_the_catalogue(entries: list[CatalogEntry]) -> None:
    assert _docs_rows() == [e.row() for e in entries]


def test_heron_models_catalog_prints_the_table(entries: list[CatalogEntry]) -> None:
    proc = _run("--catalog")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "FAMILY", "OUTPUTS", "DIMS", "MAX", "LENGTH",
                                "LICENSE"]
    for entry, line in zip(entries, lines[1:], strict=True):
        assert line.startswith(entry.id + " ")
        assert line.split()[-1] == entry.license


def test_heron_models_catalog_json_matches_the_docs() -> None:
    proc = _run("--catalog", "--json")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert [(m["id"], m["family"], m["outputs"], m["dims"], m["max_length"], m["license"])
            for m in printed] == _docs_rows()
    assert all(m["hub"] == m["id"] and m["revision"] for m in printed)
