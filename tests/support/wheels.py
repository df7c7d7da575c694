"""Build Heron's two wheels (the heron-sdk client and the heron server) the way a release
would, and read what a user's pip would see in them: file list, top-level names and
Requires-Dist.

The sources are copied to a temporary folder first, so a build leaves no ``build/`` or
egg-info in the working tree. ``--no-build-isolation`` builds with this venv's setuptools
and ``--no-index`` keeps it offline: about a second per wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from tests.support.servers import REPO

# What each distribution is built from, relative to the repository root.
SDK_SOURCES = ("sdk",)
SERVER_SOURCES = ("pyproject.toml", "README.md", "heron", "gateway", "worker", "config_service")
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalized(name: str) -> str:
    """PEP 503 name normalization: ``Nats_Py`` and ``nats-py`` are the same project."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Requirement:
    """One Requires-Dist line: the project it names and the marker it carries, if any."""

    name: str
    marker: str

    @classmethod
    def parse(cls, line: str) -> Requirement:
        match = _NAME.match(line)
        assert match, line
        _, _, marker = line.partition(";")
        return cls(normalized(match.group(1)), marker.strip())

    @property
    def extra(self) -> str | None:
        match = re.search(r"""extra\s*==\s*["']([^"']+)["']""", self.marker)
        return match.group(1) if match else None


@dataclass(frozen=True)
class BuiltWheel:
    path: Path

    def names(self) -> list[str]:
        with zipfile.ZipFile(self.path) as zf:
            return zf.namelist()

    def dist_info(self, name: str) -> str:
        with zipfile.ZipFile(self.path) as zf:
            (member,) = [n for n in zf.namelist()
                         if n.split("/")[0].endswith(".dist-info") and n.endswith("/" + name)]
            return zf.read(member).decode()

    def requirements(self) -> list[Requirement]:
        metadata = Parser().parsestr(self.dist_info("METADATA"))
        return [Requirement.parse(line) for line in metadata.get_all("Requires-Dist") or []]

    def base_requirements(self) -> set[str]:
        """What ``pip install <this>`` pulls in: requirements without an extra marker."""
        return {r.name for r in self.requirements() if r.extra is None}

    def extra_requirements(self, extra: str) -> set[str]:
        return {r.name for r in self.requirements() if r.extra == extra}

    def top_level(self) -> list[str]:
        return self.dist_info("top_level.txt").split()

    def modules(self) -> list[str]:
        """The wheel's files outside its .dist-info folder."""
        return [n for n in self.names()
                if not n.endswith("/") and not n.split("/")[0].endswith(".dist-info")]


def build_wheel(sources: tuple[str, ...], workdir: Path) -> BuiltWheel:
    """Copy ``sources`` (repo-relative) under ``workdir/src`` and build one wheel from it.

    ``sources`` is either one folder holding a pyproject.toml (the SDK) or the root's
    pyproject.toml with the folders it maps (the server)."""
    src = workdir / "src"
    src.mkdir(parents=True)
    for rel in sources:
        origin = REPO / rel
        if origin.is_dir():
            shutil.copytree(origin, src / rel, ignore=_JUNK)
        else:
            shutil.copy2(origin, src / rel)
    project = src / sources[0] if len(sources) == 1 else src
    out = workdir / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(out), str(project)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("*.whl")
    return BuiltWheel(wheel)
