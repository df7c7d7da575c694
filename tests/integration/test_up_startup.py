"""`heron up` refuses to start over a busy port, stops what it started when a child does
not come up (and says which and why), and uses a NATS it did not start only when told."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.test_up import UpProcess
from tests.support import local_http
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, free_port


def run_up(tmp: Path, *args: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess,
                                                                     float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "heron.cli", "up", "--data-dir", str(tmp / "data"), *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, time.monotonic() - started


def leftovers(*marks: str) -> list[str]:
    """Command lines of processes still running that name any of ``marks``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if any(m in line for m in marks) and "pytest" not in line:
            found.append(line)
    return found


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A port some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


@pytest.mark.parametrize(("flag", "what"), [
    ("--nats-port", "NATS port"), ("--port", "gateway port"),
    ("--config-port", "config service port")])
def test_a_port_in_use_stops_heron_up_before_it_starts_anything(
        tmp_path: Path, listening: socket.socket, flag: str, what: str) -> None:
    taken = listening.getsockname()[1]
    ports = {"--nats-port": free_port(), "--port": free_port(), "--config-port": free_port(),
             flag: taken}
    proc, took = run_up(tmp_path, *(str(x) for kv in ports.items() for x in kv))
    assert proc.returncode != 0 and took < 10, (took, proc.stderr)
    assert f"heron up: the {what} {taken} is already in use" in proc.stderr, proc.stderr
    assert not (tmp_path / "data" / "logs").exists()  # no child was started


def test_a_child_that_exits_at_start_stops_heron_up_with_its_last_words(
        tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "nats").write_text("not a directory")  # nats-server's store
    nats_port = free_port()
    proc, took = run_up(tmp_path, "--nats-port", str(nats_port), "--port", str(free_port()),
                        "--config-port", "0")
    assert proc.returncode == 1 and took < 30, proc.stdout + proc.stderr
    assert "heron up: nats did not start: it exited with status 1" in proc.stderr
    assert "storage directory is not a directory" in proc.stderr  # from its log
    assert "nats-server on" not in proc.stdout and "gateway on" not in proc.stdout
    assert not leftovers(str(tmp_path))


def test_a_child_not_up_within_the_start_timeout_stops_heron_up(tmp_path: Path) -> None:
    nats_port = free_port()
    # Python and the config service's imports alone take longer than 0.3 s.
    proc, took = run_up(tmp_path, "--nats-port", str(nats_port), "--port", str(free_port()),
                        "--config-port", "0", "--start-timeout", "0.3")
    assert proc.returncode == 1 and took < 30, proc.stdout + proc.stderr
    # The config service, or on a loaded machine nats-server already.
    assert re.search(r"heron up: config did not start: http://127\.0\.0\.1:\d+/healthz did "
                     r"not answer 200 within 0\.3 s|heron up: nats did not start: port "
                     rf"{nats_port} did not open within 0\.3 s", proc.stderr), proc.stderr
    assert "config service on" not in proc.stdout and "gateway on" not in proc.stdout
    assert not leftovers(str(tmp_path), f"127.0.0.1:{nats_port}")


def test_nats_given_with_nats_is_used_not_started(tmp_path: Path) -> None:
    nats = NatsServer(tmp_path / "external").start()
    up = UpProcess(tmp_path, "--nats", nats.url, "--workers", "0", "--min-workers", "0")
    try:
        up.wait_for(lambda: local_http.get(up.url + "/readyz", timeout=1).status_code == 200)
        commands = up.child_commands()
        assert not any("nats-server" in c for c in commands), commands
        assert all(f"--nats {nats.url}" in c for c in commands), commands
        assert f"heron up: using NATS at {nats.url}" in up.log.read_text()
    finally:
        assert up.stop() == 0
        try:
            assert nats.proc is not None and nats.proc.poll() is None  # not heron up's
        finally:
            nats.stop()
    # Nothing answers there: heron up gives up within its start timeout and says so.
    proc, took = run_up(tmp_path, "--nats", f"nats://127.0.0.1:{free_port()}", "--port",
                        str(free_port()), "--config-port", "0", "--start-timeout", "3")
    assert proc.returncode == 1 and took < 30, proc.stderr
    assert "heron up: cannot reach NATS at nats://127.0.0.1:" in proc.stderr
