"""Start real Heron servers as child processes on free loopback ports, and stop them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            response = httpx.get(server.url + path, timeout=2)
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

