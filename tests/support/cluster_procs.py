"""Real cluster processes for tests: `heron worker`, `heron gateway` and `heron config`
children on free loopback ports, stopped (or killed) by PID, and what a fault test reads
from them: log tails, Prometheus counters, resident memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.support import local_http
from tests.support.servers import REPO, free_port


class ChildProcess:
    """A `heron ...` child on a free port: wait for /readyz, stop by PID."""

    ready_timeout_s = 30.0

    def __init__(self, kind: str, args: list[str], log_dir: Path,
                 extra_env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.kind = kind
        self.port = port or free_port()
        self.log_path = log_dir / f"{kind}-{self.port}.log"
        self.args = args
        self.extra_env = extra_env or {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "heron.cli", self.kind, "--port", str(self.port),
               "--log-level", "warning", *self.args]
        with open(self.log_path, "ab") as log:  # a restart appends to the same log
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, **self.extra_env})

    def restart(self) -> None:
        """The same command again on the same port (after a kill or a stop)."""
        assert self.proc.poll() is not None, "stop or kill it first"
        self.proc = self._spawn()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if local_http.get(self.url + "/readyz", timeout=1).status_code == 200:
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

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the log, and whether the process still runs."""
        return (f"--- {self.log_path.name} (exit code {self.proc.poll()}):\n"
                f"{self.log_path.read_text(errors='replace')[-chars:]}")

    def metric(self, name: str) -> float:
        """A Prometheus counter or gauge from /metrics, summed over its labels."""
        text = local_http.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((name + "{", name + " ")))

    def rss_bytes(self) -> int:
        """Resident memory of the process now (0 once it has exited)."""
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0


class GatewayProcess(ChildProcess):
    """`heron gateway`; ``nats_url`` may name several servers (comma-separated). With
    ``gateway_id`` its NATS connection is named ``heron-gateway-<gateway_id>``."""

    def __init__(self, nats_url: str, pools: dict[str, str], log_dir: Path,
                 extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, *, port: int | None = None,
                 gateway_id: str | None = None) -> None:
        args = ["--nats", nats_url, *(extra_args or [])]
        if gateway_id is not None:
            args += ["--gateway-id", gateway_id]
        for bundle, pool in pools.items():
            args += ["--pool", f"{bundle}={pool}"]
        self.gateway_id = gateway_id
        super().__init__("gateway", args, log_dir, extra_env, port=port)

    @property
    def nats_connection_name(self) -> str:
        assert self.gateway_id is not None, "start it with a gateway_id"
        return f"heron-gateway-{self.gateway_id}"


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
                 extra_args: list[str] | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.worker_id = f"w-{port}"
        super().__init__("worker", ["--nats", nats_url, "--pool", pool, "--bundle", "default",
                                    "--worker-id", self.worker_id, *(extra_args or [])],
                         log_dir, {"HF_HUB_OFFLINE": "1", **(extra_env or {})}, port=port)
