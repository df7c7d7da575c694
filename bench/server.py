"""Run ``heron serve`` as a child process on a free loopback port, and talk to it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def on_cpus(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that confines a child process to ``cpus`` (None: anywhere)."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of a running process onto ``cpus``. Affinity is per thread on Linux,
    so each one is set; threads started later inherit it from the thread starting them."""
    for thread in psutil.Process(pid).threads():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(thread.id, cpus)


def heron_command() -> list[str]:
    script = Path(sys.executable).with_name("heron")
    return [str(script)] if script.exists() else [sys.executable, "-m", "heron.cli"]


def http(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """(status, decoded JSON or text); HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in ctype else raw.decode(errors="replace")


class Server:
    """A started ``heron serve`` process; use ``start_server`` to get one."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.url = f"http://{HOST}:{port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"heron serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError):
                if http("GET", f"{self.url}/readyz", timeout=2.0)[0] == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"heron serve not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def metric_sums(self, name: str) -> tuple[float, float] | None:
        """(sum, count) of a Prometheus histogram over all its label sets, if exposed."""
        try:
            status, text = http("GET", f"{self.url}/metrics", timeout=5.0)
        except OSError:
            return None
        if status != 200 or not isinstance(text, str):
            return None
        totals = {"_sum": 0.0, "_count": 0.0}
        pattern = re.compile(rf"^{re.escape(name)}(_sum|_count)(?:\{{[^}}]*\}})? (\S+)$")
        for line in text.splitlines():
            match = pattern.match(line)
            if match:
                totals[match.group(1)] += float(match.group(2))
        return (totals["_sum"], totals["_count"]) if totals["_count"] else None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (graceful uvicorn shutdown), then SIGKILL; only this child process."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)


@contextlib.contextmanager
def start_server(log_path: Path, *, bundle: str = "default", threads: int = 0,
                 workers: str = "auto", ready_timeout_s: float = 300.0,
                 extra_args: tuple[str, ...] = ()) -> Iterator[Server]:
    """``heron serve`` on a free 127.0.0.1 port, ready (warm) on entry, stopped on exit.
    ``workers``: its ``--workers`` (auto, as shipped: one process per CPU up to 4);
    ``extra_args``: more flags of ``heron serve``."""
    port = free_port()
    cmd = [*heron_command(), "serve", "--host", HOST, "--port", str(port), "--bundle", bundle,
           "--log-level", "warning", "--workers", str(workers)]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += extra_args
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(proc, port, log_path)
    try:
        server.wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop()
