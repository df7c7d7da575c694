"""Every .tf file parses, and the interfaces of modules and examples hold together."""

from __future__ import annotations

import re

import pytest

from .conftest import EXAMPLES, MODULES, ROOT, TF_FILES, load_dir, parse

DIRS = {f"modules/{k}": v for k, v in MODULES.items()} | {
    f"examples/{k}": v for k, v in EXAMPLES.items()
}


def test_layout():
    assert set(MODULES) == {"aws", "gcp"}
    assert set(EXAMPLES) == {"aws", "gcp"}
    for d in DIRS.values():
        assert list(d.glob("*.tf")), d


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_parses(path):
    assert parse(path), f"{path} has no blocks"


@pytest.mark.parametrize("name", sorted(DIRS))
def test_variables_have_description_and_type(name):
    variables = load_dir(DIRS[name]).get("variable", {})
    assert variables
    for var, body in variables.items():
        assert body.get("description", "").strip(), f"{name}: variable {var} has no description"
        assert "type" in body, f"{name}: variable {var} has no type"


@pytest.mark.parametrize("name", sorted(DIRS))
def test_outputs_have_description(name):
    outputs = load_dir(DIRS[name]).get("output", {})
    assert outputs
    for out, body in outputs.items():
        assert body.get("description", "").strip(), f"{name}: output {out} has no description"


@pytest.mark.parametrize("cloud", sorted(EXAMPLES))
def test_example_calls_module_with_its_variables(cloud):
    """Every input the example passes exists in the module, every required module input is
    passed, and every module output the example reads exists."""
    example = load_dir(EXAMPLES[cloud])
    module = load_dir(MODULES[cloud])
    variables = module["variable"]
    calls = {n: b for n, b in example["module"].items() if b["source"] == f"../../modules/{cloud}"}
    assert len(calls) == 1, calls
    (call_name, call), = calls.items()
    inputs = {k for k in call if k not in {"source", "version", "providers", "depends_on"}}
    assert inputs <= set(variables), f"not variables of modules/{cloud}: {inputs - set(variables)}"
    required = {v for v, body in variables.items() if "default" not in body}
    assert required <= inputs, f"required inputs not passed: {required - inputs}"

    used = set()
    for body in example["output"].values():
        used |= set(re.findall(rf"module\.{call_name}\.(\w+)", str(body["value"])))
    assert used, "the example exposes none of the module's outputs"
    assert used <= set(module["output"]), used - set(module["output"])


@pytest.mark.parametrize("cloud", sorted(EXAMPLES))
def test_example_outputs_what_the_manifests_need(cloud):
    outputs = set(load_dir(EXAMPLES[cloud])["output"])
    identity = {"aws": "worker_role_arn", "gcp": "gsa_email"}[cloud]
    assert {"cluster_name", "bucket_name", "weights_s3_url", identity} <= outputs


@pytest.mark.parametrize("name", sorted(DIRS))
def test_readme_documents_inputs_and_outputs(name):
    """Each module and example has a README whose tables name every variable and output."""
    readme = DIRS[name] / "README.md"
    assert readme.exists(), f"{name} has no README.md"
    text = readme.read_text()
    parsed = load_dir(DIRS[name])
    for kind in ("variable", "output"):
        for item in parsed[kind]:
            assert re.search(rf"^\|\s*`{item}`\s*\|", text, re.M), (
                f"{name}/README.md: {kind} {item} is not in a table"
            )
