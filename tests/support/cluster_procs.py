"""Real cluster processes for tests: `heron worker`, `heron gateway` and `heron config`
children on free loopback ports, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.servers import REPO, free_port


class ChildProcess:
    """A `heron ...` child on a free port: wait for /readyz, stop by PID."""

    ready_timeout_s = 30.0

    def __init__(self, kind: str, args: list[str], log_dir: Path,
                 extra_env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_dir / f"{kind}-{self.port}.log"
        cmd = [sys.executable, "-m", "heron.cli", kind, "--port", str(self.port),
               "--log-level", "warning", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, **(extra_env or {})})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.log_path.read_text())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


class GatewayProcess(ChildProcess):
    def __init__(self, nats_url: str, pools: dict[str, str], log_dir: Path,
                 extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        args = ["--nats", nats_url, *(extra_args or [])]
        for bundle, pool in pools.items():
            args += ["--pool", f"{bundle}={pool}"]
        super().__init__("gateway", args, log_dir, extra_env)


class ConfigProcess(ChildProcess):
    """`heron config` (the config service) with its own store."""

    def __init__(self, nats_url: str, store: str, log_dir: Path,
                 extra_env: dict[str, str] | None = None) -> None:
        super().__init__("config", ["--nats", nats_url, "--store", store], log_dir,
                         extra_env)


class WorkerProcess(ChildProcess):
    """`heron worker` for the default bundle in ``pool`` (loading MiniLM takes a while)."""

    ready_timeout_s = 120.0

    def __init__(self, nats_url: str, pool: str, log_dir: Path,
                 extra_args: list[str] | None = None) -> None:
        port = free_port()
        self.worker_id = f"w-{port}"
        super().__init__("worker", ["--nats", nats_url, "--pool", pool, "--bundle", "default",
                                    "--worker-id", self.worker_id, *(extra_args or [])],
                         log_dir, {"HF_HUB_OFFLINE": "1"}, port=port)
