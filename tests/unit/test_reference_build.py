"""The parity suite's reference build: scripts forked from one runner a venv still run each in
a process of its own, a test waits for its own script only, a failing script's traceback
reaches the test that needs it, and stopping the build ends its processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.parity import reference_build
from tests.parity.references._fork_runner import top_level_imports


def _script(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text("# a test script\n# reference venv: main\n" + body)
    return path


def test_scripts_run_in_processes_of_their_own_and_report_alone(tmp_path: Path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    body = ("import os, pathlib, sys\n"
            "import json\n"
            "json.dumps = None  # changes this process only\n"
            "pathlib.Path(sys.argv[1], 'pid').write_text(str(os.getpid()))\n")
    good = [_script(scripts, name, body) for name in ("first", "second", "third")]
    bad = _script(scripts, "broken", "raise ValueError('a reference library refused')\n")
    exits = _script(scripts, "exits", "import sys\nsys.exit(3)\n")
    build = reference_build.ReferenceBuild(tmp_path / "out", [*good, bad, exits],
                                           nice=True).start()
    try:
        # Each waits for its own script only (two run at a time: "third" can end first).
        pids = {(build.wait(name) / name / "pid").read_text()
                for name in ("first", "second", "third")}
        assert len(pids) == 3 and str(os.getpid()) not in pids
        with pytest.raises(RuntimeError, match=r"(?s)broken\.py failed.*a reference library"):
            build.wait("broken")
        with pytest.raises(RuntimeError, match=r"exits\.py failed \(exit 3\)"):
            build.wait("exits")
        with pytest.raises(RuntimeError, match=r"broken\.py failed"):
            build.wait()
    finally:
        build.stop()
    assert not (tmp_path / "out").exists()


def test_stopping_the_build_ends_a_running_script(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    slow = _script(tmp_path, "slow", "import os, pathlib, sys, time\n"
                   f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
                   "time.sleep(120)\n")
    build = reference_build.ReferenceBuild(tmp_path / "out", [slow], nice=True).start()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(marker.read_text())
    build.stop()
    with pytest.raises(RuntimeError, match=r"slow\.py did not finish"):
        build.wait("slow")
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the script's process outlived the build"


def test_the_runner_preloads_what_a_script_imports_at_its_top(tmp_path: Path) -> None:
    script = _script(tmp_path, "imports", "import json, os.path\n"
                     "from collections import OrderedDict, deque\n"
                     "from tests.parity.texts import QUERY\n"
                     "from . import local\n"
                     "def main():\n    import csv\n")
    assert top_level_imports(script) == [("json", []), ("os.path", []),
                                         ("collections", ["OrderedDict", "deque"])]
