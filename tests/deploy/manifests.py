"""Shared helpers for the deploy tests: render the Kustomize overlays, parse Dockerfiles."""

from __future__ import annotations

import functools
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
CRDS = Path(__file__).resolve().parent / "crds"
OVERLAYS = ("local", "gke", "eks")
# The Kubernetes version the manifests are validated against (bundled with
# kubernetes-validate; the lifecycle `sleep` action needs 1.30 or newer).
K8S_VERSION = "1.32.0"
CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"  # `make test` installs it (own venv)


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise AssertionError("kubectl is needed to render deploy/k8s (kubectl kustomize)")
    return path


@functools.cache
def render_text(overlay: str) -> str:
    proc = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    return proc.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(overlay)) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def crd_schema(api_version: str, kind: str) -> dict[str, Any] | None:
    group, _, version = api_version.rpartition("/")
    path = CRDS / f"{group}_{version}_{kind}.json"
    return json.loads(path.read_text()) if path.exists() else None


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or the valueFrom dict."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---- Dockerfiles -------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfiles() -> list[Path]:
    return sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages with their (INSTRUCTION, arguments) pairs; continuation lines joined."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, f"{path.name}: the last line continues into nothing"
    stages: list[Stage] = []
    for line in lines:
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif stages:
            stages[-1].instructions.append((instr, args.strip()))
        else:
            assert instr == "ARG", f"{path.name}: {instr} before the first FROM"
    return stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def flags_removed(args: str) -> list[str]:
    """COPY/ADD words without their --flags."""
    return [w for w in shlex.split(args) if not w.startswith("--")]


def image_argv() -> dict[str, list[str]]:
    """Image name (as the manifests name it) -> ENTRYPOINT + CMD of its final stage."""
    out: dict[str, list[str]] = {}
    for path in dockerfiles():
        final = parse_dockerfile(path)[-1]
        entry: list[str] = []
        cmd: list[str] = []
        for instr, args in final.instructions:
            if instr == "ENTRYPOINT":
                entry, cmd = exec_form(args), []
            elif instr == "CMD":
                cmd = exec_form(args)
        out["heron-" + path.name.removeprefix("Dockerfile.")] = entry + cmd
    return out
