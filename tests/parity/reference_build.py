"""The parity suite's reference outputs, built in the background from the end of collection.

Every script in ``references/`` runs once, in its library's venv, and writes its cases'
checkpoints and expected outputs (tests/parity/conftest.py). The scripts of one venv are
forked from one process that imported their libraries (``references/_fork_runner.py``, two
at a time): 70-74 s of wall time and 135-143 CPU-seconds on an idle 2-core machine, against
81-88 s and 160 with a process a script. It is the largest part of the parity suite's setup, and
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

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from tests.support.servers import REPO

REFERENCES = Path(__file__).parent / "references"
PARITY_DIR = Path(__file__).parent
SCRIPT_TIMEOUT_S = 1800  # niced behind a loaded machine, a script may wait its turn a while
JOBS_PER_VENV = 2  # scripts a runner runs at once; three venvs, so up to 5 on 2 cores
RUNNER = REFERENCES / "_fork_runner.py"


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
    """Every selected reference script run into ``root / <script stem>``: the scripts of one
    venv by one ``references/_fork_runner.py``, which imports their libraries once and forks
    a child a script (10-15 s of imports a script on 2 cores, most of its time: the build
    took 163 s of the parity process's wait in a CI run, one process a script)."""

    def __init__(self, root: Path, scripts: list[Path], *, nice: bool) -> None:
        self.root = root
        self.scripts = scripts
        self.nice = nice
        self._stopping = False
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._futures: dict[str, Future[None]] = {s.stem: Future() for s in scripts}
        self._threads: list[threading.Thread] = []

    def start(self) -> ReferenceBuild:
        groups: dict[str, list[Path]] = {}
        for script in self.scripts:
            try:
                groups.setdefault(reference_python(script), []).append(script)
            except MissingVenv as missing:  # that script's tests fail; the others run
                self._futures[script.stem].set_exception(missing)
        for python, scripts in groups.items():
            thread = threading.Thread(target=self._run_group, args=(python, scripts),
                                      name="parity-reference", daemon=True)
            thread.start()
            self._threads.append(thread)
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
        for proc in running:  # each runner leads a process group of its own: its children
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for thread in self._threads:
            thread.join(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def _run_group(self, python: str, scripts: list[Path]) -> None:
        futures = {script.stem: self._futures[script.stem] for script in scripts}
        try:
            self._run_runner(python, scripts, futures)
        except BaseException as error:  # every waiter must hear of it
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)

    def _run_runner(self, python: str, scripts: list[Path],
                    futures: dict[str, Future[None]]) -> None:
        cmd = [python, str(RUNNER), str(self.root), str(JOBS_PER_VENV),
               *(str(script) for script in scripts)]
        if self.nice:
            cmd = ["nice", "-n", "19", *cmd]
        with self._lock:
            if self._stopping:
                raise RuntimeError("the session ended before the reference scripts ran")
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
                env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"})
            self._running.add(proc)
        timer = threading.Timer(SCRIPT_TIMEOUT_S, self._kill_group, args=(proc,))
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                stem, code = line.split()
                log = self.root / f"{stem}.log"
                if code == "0":
                    futures[stem].set_result(None)
                else:
                    futures[stem].set_exception(RuntimeError(
                        f"{stem}.py failed (exit {code}):\n{_read(log)}"))
            proc.wait()
        finally:
            timer.cancel()
            with self._lock:
                self._running.discard(proc)
        stderr = proc.stderr.read() if proc.stderr is not None else ""
        for stem, future in futures.items():
            if not future.done():
                future.set_exception(RuntimeError(
                    f"{stem}.py did not finish: its runner ended with exit {proc.returncode} "
                    f"(killed past {SCRIPT_TIMEOUT_S} s, or the session ended):\n{stderr}\n"
                    f"{_read(self.root / f'{stem}.log')}"))

    @staticmethod
    def _kill_group(proc: subprocess.Popen[str]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


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
