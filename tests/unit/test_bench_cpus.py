"""The benchmarks' CPU placement (bench/cluster_bench.py --split-cores): a child started with
``on_cpus`` stays on those CPUs, and ``pin_process`` moves every thread of a running process,
threads it already started included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.server import on_cpus, pin_process
from heron.worker.cpus import parse_cpu_list

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")

# Starts 3 threads that sleep, then prints a line and waits for stdin to close.
CHILD = """
import sys, threading, time
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("up", flush=True)
sys.stdin.read()
"""


def allowed(pid: int, tid: str) -> set[int]:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
    return set(parse_cpu_list(line.split(":", 1)[1]))


def test_child_starts_on_the_cpus_given_and_every_thread_moves() -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=on_cpus({first}))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tids) == 4
        assert all(allowed(proc.pid, t) == {first} for t in tids)

        pin_process(proc.pid, {second})  # sched_setaffinity applies at once
        assert [allowed(proc.pid, t) for t in tids] == [{second}] * 4
    finally:
        proc.kill()
        proc.wait(10)


def test_no_cpus_means_no_constraint() -> None:
    assert on_cpus(None) is None
