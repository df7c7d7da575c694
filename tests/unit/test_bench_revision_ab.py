"""bench/revision_ab.py: an earlier commit's tree comes out runnable (its import layout
rebuilt), each ratio pairs the two trees' steps of one round, and a process's CPU is read
with its event loop's apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from bench.revision_ab import export, loop_cpu_s, summarize
from bench.server import REPO


def test_an_exported_commit_imports_from_its_own_tree(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    commit = export("HEAD", tree)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert commit == head
    probe = ("import heron.gateway.app, heron.worker.consumer, heron.config_service.app, "
             "heron_sdk; print(heron.gateway.app.__file__); print(heron_sdk.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(tree)}).stdout
    gateway_file, sdk_file = out.split()
    assert gateway_file.startswith(str(tree)) and sdk_file.startswith(str(tree))


def test_ratios_pair_the_two_trees_steps_of_each_round() -> None:
    steps = []
    for round_no, (this, rev, this_p50, rev_p50) in enumerate([(1400.0, 700.0, 5.0, 6.0),
                                                               (1200.0, 400.0, 6.0, 6.0)]):
        steps += [
            {"round": round_no, "tree": "this", "clients": 32, "throughput_rps": this},
            {"round": round_no, "tree": "rev", "clients": 32, "throughput_rps": rev},
            {"round": round_no, "tree": "rev", "clients": 1, "p50_ms": rev_p50},
            {"round": round_no, "tree": "this", "clients": 1, "p50_ms": this_p50}]
    summary = summarize(steps, rounds=2)
    assert summary["rps_ratio_per_round"] == [2.0, 3.0]
    assert summary["rps_ratio_geomean"] == round(6 ** 0.5, 3)
    assert summary["rps_ratio_median"] == 2.5
    assert summary["one_client_p50_ratio_per_round"] == [round(5 / 6, 3), 1.0]
    assert summary["rps_median"] == {"this": 1300.0, "rev": 550.0}


def test_the_event_loop_threads_cpu_is_read_apart_from_the_other_threads() -> None:
    # The main thread spins 0.4 s of CPU, a second thread 0.8 s, then both idle.
    code = ("import threading, time, sys\n"
            "def spin(s):\n"
            "    end = time.thread_time() + s\n"
            "    while time.thread_time() < end: pass\n"
            "t = threading.Thread(target=spin, args=(0.8,)); t.start(); spin(0.4); t.join()\n"
            "print('spun', flush=True); sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        cpu = loop_cpu_s({"server": [psutil.Process(child.pid)]})
    finally:
        child.communicate("")
    assert cpu["server"] >= 1.1
    assert 0.35 <= cpu["server_event_loop"] <= 0.7
