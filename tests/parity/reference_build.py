"""The parity suite's reference outputs, built in the background from the end of collection.

Every script in ``references/`` runs once (three at a time, each in its library's venv) and
writes its cases' checkpoints and expected outputs (tests/parity/conftest.py). Together they
take 84 s of wall time on a 2-core machine, the largest part of the parity suite's setup, and
they need nothing from the tests that run before it. So the root conftest starts them as soon
as collection shows that a parity test will run (``start``), at the lowest CPU priority
(``nice 19``): they use the cycles the earlier tests leave idle (a full run in one process
keeps the 2 cores about 59% busy) and hardly slow those tests down. The parity fixtures take the
result with ``wait`` (test_gliner.py waits for its one script only), which starts the build
when nothing did (a run of one file under another root, say, or a pytest-xdist process:
each collects every test, so none starts the build before the parity suite, which runs
first in one of them, asks for it). ``stop`` ends any script still running when the
session ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tests.support.servers import REPO

REFERENCES = Path(__file__).parent / "references"
PARITY_DIR = Path(__file__).parent
SCRIPT_TIMEOUT_S = 1800  # niced behind a loaded machine, a script may wait its turn a while
CONCURRENT_SCRIPTS = 3


def reference_python(script: Path) -> str:
    """The python of the venv a script names on its second line (``# reference venv:``):
    main (this one), parity (``.venv-parity``) or gliner (``.venv-gliner``)."""
    venv = "main"
    for line in script.read_text().splitlines()[:3]:
        if line.startswith("# reference venv:"):
            venv = line.split(":", 1)[1].strip()
    if venv == "main":
        return sys.executable
    python = REPO / f".venv-{venv}" / "bin" / "python"
    if not python.exists():
        raise MissingVenv(f"{script.name} runs in {python.parent.parent}, which is missing: "
                          f"`make {venv}-venv` builds it (`make test` does)")
    return str(python)


class MissingVenv(RuntimeError):
    """A reference script's venv is not built."""


def selected_scripts() -> list[Path]:
    scripts = sorted(p for p in REFERENCES.glob("*.py") if not p.name.startswith("_"))
    only = os.environ.get("HERON_PARITY_ONLY")  # "st_models,pylate_colbert": while iterating
    if only:
        scripts = [p for p in scripts if p.stem in only.split(",")]
    return scripts


class ReferenceBuild:
    """Every selected reference script run into ``root / <script stem>``, three at a time."""

    def __init__(self, root: Path, scripts: list[Path], *, nice: bool) -> None:
        self.root = root
        self.scripts = scripts
        self.nice = nice
        self._stopping = False
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._pool = ThreadPoolExecutor(CONCURRENT_SCRIPTS,
                                        thread_name_prefix="parity-reference")
        self._futures: dict[str, Future[None]] = {}

    def start(self) -> ReferenceBuild:
        for script in self.scripts:
            self._futures[script.stem] = self._pool.submit(self._build, script)
        self._pool.shutdown(wait=False)
        return self

    def wait(self, stem: str | None = None) -> Path:
        """The folder holding the scripts' outputs, once every script (or the one named
        ``stem``) has run; a script's failure raised again."""
        if stem is not None and stem not in self._futures:
            raise RuntimeError(f"reference script {stem}.py is not selected "
                               f"(HERON_PARITY_ONLY={os.environ.get('HERON_PARITY_ONLY')})")
        for name, future in self._futures.items():
            if stem is None or name == stem:
                future.result()
        return self.root

    def stop(self) -> None:
        """Kill what still runs (the session ends) and remove the outputs."""
        with self._lock:
            self._stopping = True
            running = list(self._running)
        for proc in running:
            proc.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _build(self, script: Path) -> None:
        out = self.root / script.stem
        out.mkdir(parents=True, exist_ok=True)
        cmd = [reference_python(script), str(script), str(out)]
        if self.nice:
            cmd = ["nice", "-n", "19", *cmd]
        with self._lock:
            if self._stopping:
                raise RuntimeError("the session ended before the reference scripts ran")
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"})
            self._running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise RuntimeError(f"{script.name} ran past {SCRIPT_TIMEOUT_S} s:\n{stdout}\n"
                               f"{stderr}") from None
        finally:
            with self._lock:
                self._running.discard(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"{script.name} failed (exit {proc.returncode}):\n{stdout}\n"
                               f"{stderr}")


_build: ReferenceBuild | None = None


def start() -> None:
    """Start the build in the background (once a session)."""
    global _build
    if _build is None:
        root = Path(tempfile.mkdtemp(prefix="heron-parity-"))
        _build = ReferenceBuild(root, selected_scripts(), nice=True).start()


def wait(stem: str | None = None) -> Path:
    """The outputs' folder once every script (or the one named ``stem``) has run: the
    background build's, or one started now."""
    global _build
    if _build is None:
        root = Path(tempfile.mkdtemp(prefix="heron-parity-"))
        _build = ReferenceBuild(root, selected_scripts(), nice=False).start()
    return _build.wait(stem)


def stop() -> None:
    global _build
    if _build is not None:
        _build.stop()
        _build = None
