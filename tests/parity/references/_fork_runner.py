"""Run several reference scripts of one venv from one import of their libraries.

``python _fork_runner.py OUT JOBS SCRIPT...`` imports every package the scripts import at
their top level (torch, transformers, sentence-transformers...: 10-15 s a process on the
2-core machine, most of a script's 15-30 s), then forks one child a script, at most JOBS at
a time. A child runs its script as ``__main__`` with ``OUT/<stem>`` as its argument, its
stdout and stderr in ``OUT/<stem>.log``: each script still runs in a process of its own,
so one cannot change another's state. As each child ends the runner prints ``<stem> <exit
code>`` on a line of its own (reference_build.py reads them, so a test that needs one
script waits for that one only). A package that fails to import here is left to the
script, whose own import then fails with its traceback in its log.
"""

from __future__ import annotations

import ast
import importlib
import os
import runpy
import sys
import traceback
from pathlib import Path

LOCAL_ROOTS = {"__future__", "tests", "heron", "heron_sdk"}


def top_level_imports(script: Path) -> list[tuple[str, list[str]]]:
    """What a script imports outside any function: (module, the names taken from it)."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return [(module, names) for module, names in found
            if module.split(".")[0] not in LOCAL_ROOTS]


def preload(scripts: list[Path]) -> None:
    """Import what the scripts import, and take each name they take: transformers and
    sentence-transformers load a class's module only when it is first asked for (7 of
    st_models.py's 14 s of imports)."""
    for script in scripts:
        for module, names in top_level_imports(script):
            try:
                loaded = importlib.import_module(module)
                for name in names:
                    getattr(loaded, name, None)
            except Exception:  # the script's own import reports it, in its log
                pass


def run_child(script: Path, out: Path) -> None:
    """In the forked child: the script as ``__main__``; never returns."""
    code = 0
    try:
        log = os.open(out.parent / f"{script.stem}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        out.mkdir(parents=True, exist_ok=True)
        sys.argv = [str(script), str(out)]
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main() -> None:
    out_root, jobs = Path(sys.argv[1]), int(sys.argv[2])
    scripts = [Path(arg) for arg in sys.argv[3:]]
    out_root.mkdir(parents=True, exist_ok=True)
    preload(scripts)
    waiting = list(scripts)
    running: dict[int, str] = {}
    while waiting or running:
        while waiting and len(running) < jobs:
            script = waiting.pop(0)
            sys.stdout.flush()  # nothing buffered may be written twice by the child
            pid = os.fork()
            if pid == 0:
                run_child(script, out_root / script.stem)
            running[pid] = script.stem
        pid, status = os.wait()
        stem = running.pop(pid)
        print(stem, os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
