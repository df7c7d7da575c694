"""Start real Heron servers as child processes on free loopback ports, and stop them."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support import local_http

REPO = Path(__file__).resolve().parents[2]


# The ports tests hand out come from a block of their own per pytest process, below the
# kernel's ephemeral range (32768-60999 on Linux). A port the kernel picks for bind(0) is
# free when picked, but the other xdist process can be handed the same one before the first
# server binds it: in CI a `heron serve` child's readiness poll was answered by the other
# process's in-process gateway on its port, and the image-URL tests talked to that gateway.
# Inside a block, ports go round in turn, so one handed out is not handed out again soon.
PORT_BLOCK_FIRST = 12000
PORT_BLOCK_SIZE = 1000
PORT_BLOCKS = 20  # 12000-31999


def _port_block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw0", "gw1", ...
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    first = PORT_BLOCK_FIRST + (index % PORT_BLOCKS) * PORT_BLOCK_SIZE
    return range(first, first + PORT_BLOCK_SIZE)


_block = _port_block()
# A random start keeps two pytest sessions run side by side mostly apart as well.
_next = random.randrange(len(_block))


def free_ports(count: int = 1) -> int:
    """The first of ``count`` ports in a row, all free now and not handed out lately by
    this process."""
    global _next
    for _ in range(len(_block)):
        start = _block[0] + _next
        _next = (_next + count) % (len(_block) - count + 1)
        if all(_can_bind(port) for port in range(start, start + count)):
            return start
    raise RuntimeError(f"no {count} free ports in a row in {_block}")


def free_port() -> int:
    return free_ports(1)


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_serve(bundle: Path | str, log_dir: Path, *, extra_args: list[str] | None = None,
                env: dict[str, str] | None = None, wait_ready: bool = True,
                timeout_s: float = 180) -> ServerProcess:
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "heron.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--bundle", str(bundle), "--log-level", "warning", *(extra_args or [])]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                cwd=REPO)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if wait_ready:
        wait_until(server, "/readyz", timeout_s)
    return server


def wait_until(server: ServerProcess, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            response = local_http.get(server.url + path, timeout=2)
            if response.status_code == 200:
                return
            if path == "/readyz" and response.json().get("status") == "failed":
                server.stop()
                raise RuntimeError(f"a model failed to load:\n{server.log()}")
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise TimeoutError(f"{server.url}{path} not 200 after {timeout_s}s:\n{server.log()}")


def loaded_after_import(imports: list[str], watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has in sys.modules after importing
    ``imports``. It runs outside the repository root, whose folders would import under the
    old top-level names."""
    code = (f"import json, sys; import {', '.join(imports)}; "
            f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO / "docs")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)

