"""Drive closed-loop HTTP load with wrk (a C load generator) and parse its results."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.server import on_cpus

LUA_SCRIPT = Path(__file__).with_name("wrk_encode.lua")
MARKER = "HERON_WRK_JSON "


def find_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed: apt-get update && apt-get install -y wrk "
                           "(or `make bench`, which does it)")
    return wrk


def write_bodies(texts: list[str], path: Path) -> None:
    """One single-item encode body per line, for wrk_encode.lua. ``cache: false``: wrk
    cycles through the texts, and the worker's result cache would answer every repeat
    without a forward pass (bench/cache_bench.py measures the cache)."""
    path.write_text("".join(json.dumps({"items": [t], "cache": False}) + "\n" for t in texts))


@dataclass(frozen=True, slots=True)
class WrkResult:
    connections: int
    threads: int
    requests: int
    duration_s: float
    errors: dict[str, int]
    latency_us: dict[str, float]
    wrk_cpu_s: float  # CPU time wrk itself used (stolen from the server)
    output: str

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    def summary(self) -> dict[str, Any]:
        lat = self.latency_us
        return {
            "connections": self.connections,
            "wrk_threads": self.threads,
            "duration_s": round(self.duration_s, 2),
            "requests": self.requests,
            "throughput_rps": round(self.rps, 1),
            "latency_ms": {k: round(lat[k] / 1000, 2) for k in
                           ("p50", "p90", "p99", "p999", "mean", "max")},
            "non_2xx": self.errors["status"],
            "socket_errors": {k: v for k, v in self.errors.items() if k != "status"},
            "wrk_cpu_s": round(self.wrk_cpu_s, 2),
        }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_wrk(url: str, bodies: Path, *, connections: int, duration_s: float,
            threads: int = 1, timeout_s: float = 30.0,
            cpus: set[int] | None = None, phases_path: Path | None = None) -> WrkResult:
    """``cpus``: run wrk on these CPUs only (see bench.cluster_bench --split-cores).
    ``phases_path``: write each answer's status and Server-Timing there, a line each
    (one wrk thread: the threads would share the file)."""
    threads = max(1, min(threads, connections))
    if phases_path is not None and threads != 1:
        raise ValueError("phases_path needs one wrk thread")
    cmd = [find_wrk(), f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s",
           f"--timeout={timeout_s:g}s", "--latency", "-s", str(LUA_SCRIPT), url, "--",
           str(bodies)]
    cpu_before = _children_cpu_s()
    env = None if phases_path is None else {**os.environ, "HERON_WRK_PHASES": str(phases_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=duration_s + timeout_s + 30, check=False,
                          preexec_fn=on_cpus(cpus), env=env)
    cpu = _children_cpu_s() - cpu_before
    output = proc.stdout + proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {proc.returncode}): {' '.join(cmd)}\n{output}")
    data = json.loads(line[len(MARKER):])
    return WrkResult(connections=connections, threads=threads, requests=int(data["requests"]),
                     duration_s=data["duration_us"] / 1e6,
                     errors={k: int(v) for k, v in data["errors"].items()},
                     latency_us=data["latency_us"], wrk_cpu_s=cpu, output=output)
