"""The adapter table (heron/runtime/adapters.py) is the one list of model families.

The worker's classes take their tasks and output types from it, every adapter file in
worker/adapters/ has its entry, the gateway reads it without importing torch, and
docs/models.md describes the same families and the same two steps to add one.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from heron.runtime.adapters import ADAPTER_FAMILIES, ADAPTERS, AUTO, adapter_family
from heron.runtime.modelconfig import ADAPTERS as CONFIG_ADAPTERS
from heron.runtime.modelconfig import ConfigError, parse_model_config
from tests.support.servers import REPO, loaded_after_import

ADAPTER_DIR = REPO / "worker" / "adapters"
# The package, the contract and its helpers
NOT_FAMILIES = {"__init__", "base", "cuda_graphs", "plain_bert", "scripted_bert", "packing",
                "special_tokens"}
TASKS = {"encode", "score", "extract"}


def test_every_entry_names_a_worker_class_that_agrees() -> None:
    from heron.worker.adapters import Adapter, adapter_class

    assert len(ADAPTER_FAMILIES) == 10 and "null" in ADAPTER_FAMILIES
    # "auto" is resolved to a family when the worker reads the checkpoint: no class of its own
    assert ADAPTER_FAMILIES[AUTO].implementation == ""
    for name, family in ADAPTER_FAMILIES.items():
        if name == AUTO:
            continue
        cls = adapter_class(name)
        assert issubclass(cls, Adapter) and cls.name == name
        assert (cls.tasks, cls.task, cls.output_types) == \
            (family.tasks, family.tasks[0], family.output_types)
        assert family.tasks and set(family.tasks) <= TASKS, name
        # encode's output types exist exactly when the family encodes
        assert bool(family.output_types) == ("encode" in family.tasks), name


def test_every_adapter_file_has_its_entry() -> None:
    from heron.worker.adapters import Adapter

    implementations = {f.implementation for f in ADAPTER_FAMILIES.values() if f.implementation}
    found = set()
    for path in sorted(ADAPTER_DIR.glob("*.py")):
        if path.stem in NOT_FAMILIES:
            continue
        module = importlib.import_module(f"heron.worker.adapters.{path.stem}")
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if issubclass(c, Adapter) and c is not Adapter
                   and c.__module__ == module.__name__]
        assert len(classes) == 1, f"{path.name}: one family per file, found {classes}"
        found.add(f"{module.__name__}:{classes[0].__name__}")
    assert found == implementations


def test_configs_accept_the_tables_names_and_reject_others() -> None:
    assert CONFIG_ADAPTERS == ADAPTERS == tuple(ADAPTER_FAMILIES)
    config = {"id": "m", "adapter": "null", "source": {"path": "/nowhere"}}
    assert parse_model_config(config, "m.yaml").adapter == "null"
    with pytest.raises(ConfigError, match="adapter: must be one of"):
        parse_model_config({**config, "adapter": "colbert"}, "m.yaml")
    with pytest.raises(KeyError, match="unknown adapter 'colbert'; known: dense"):
        adapter_family("colbert")


def test_the_table_and_the_gateway_import_no_torch() -> None:
    assert loaded_after_import(
        ["heron.runtime.adapters", "heron.runtime.modelconfig", "heron.gateway.registry"],
        ("torch", "transformers", "heron.worker")) == []


def test_models_md_lists_the_same_families_and_the_two_steps() -> None:
    text = (REPO / "docs" / "models.md").read_text()
    adapters = text.split("\n## Adapters\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", adapters, re.MULTILINE)
    assert rows == list(ADAPTERS)
    adding = text.split("\n## Adding a model family", 1)[1].split("\n## ", 1)[0]
    assert "heron/runtime/adapters.py" in adding and "ADAPTER_FAMILIES" in adding
    assert "worker/adapters/" in adding
    # No count to keep true by hand: the bundle default is every family in the table.
    assert "| all of them (and `auto`) |" in text
