"""`heron serve --workers N`: N processes behind one port, one set of metrics."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from heron.cli.main import serve_processes, usable_cpus
from tests.support import local_http
from tests.support.servers import REPO, free_port, start_serve


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"{re.escape(name)}[{{ ]", line) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_process_count() -> None:
    assert serve_processes("3", "cpu") == 3
    assert serve_processes("auto", "cpu") == min(usable_cpus(), 4)
    assert serve_processes("auto", "cuda") == 1
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit, match="--workers"):
            serve_processes(bad, "cpu")


def test_two_processes_serve_one_port_and_report_all_requests(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.yaml").write_text(yaml.safe_dump({
        "id": "t/tiny", "adapter": "dense",
        "source": {"path": str(tiny_models["tiny-dense-cls"])}}))
    (tmp_path / "b.yaml").write_text("name: b\nmodels: [tiny.yaml]\n")
    server = start_serve(tmp_path / "b.yaml", tmp_path, extra_args=["--workers", "2"])
    parent = psutil.Process(server.proc.pid)
    try:
        servers = [p for p in parent.children(recursive=True)
                   if "spawn_main" in " ".join(p.cmdline())]
        assert len(servers) == 2
        # start_serve saw one process ready. A process joins the port's SO_REUSEPORT group
        # only once it listens, so first wait for both to listen, then until fresh
        # connections (hashed over both) find no process still loading.
        port = int(server.url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                    for c in p.net_connections(kind="tcp")) for p in servers):
            time.sleep(0.05)
        ready_in_a_row = 0
        while ready_in_a_row < 10 and time.monotonic() < deadline:
            ok = local_http.get(server.url + "/readyz", headers={"Connection": "close"})
            ready_in_a_row = ready_in_a_row + 1 if ok.status_code == 200 else 0
            time.sleep(0.05)
        vectors, served = [], 40
        for _ in range(served):  # a new connection each time: either process may answer
            # cache false: every request computed by the process that took it (a repeat
            # would be the result cache's answer, not a computed item).
            r = local_http.post(server.url + "/v1/encode/t/tiny",
                                json={"items": ["same text"], "cache": False},
                                headers={"Connection": "close"}, timeout=30)
            assert r.status_code == 200, r.text
            vectors.append(r.json()["items"][0]["dense"])
        np.testing.assert_allclose(np.array(vectors), np.array(vectors[:1] * served),
                                   atol=1e-6)
        # Both answered some: a process's counter file appears with its first request.
        metrics_dir = Path(servers[0].environ()["PROMETHEUS_MULTIPROC_DIR"])
        assert {f"counter_{p.pid}.db" for p in servers} <= {
            f.name for f in metrics_dir.iterdir()}
        # Whichever process answers the scrape, it reports both processes' requests.
        for _ in range(6):
            text = local_http.get(server.url + "/metrics", headers={"Connection": "close"}).text
            assert metric(text, "heron_worker_requests_total", route="encode",
                          status="200") == served
            assert metric(text, "heron_worker_items_total") == served
            assert metric(text, "heron_worker_models_loaded") == 1
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert not [p for p in servers if p.is_running() and p.status() != "zombie"]


def established(process: psutil.Process, port: int) -> int:
    return sum(1 for c in process.net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_bursts_of_connections_spread_over_the_processes_and_a_dead_one_is_replaced(
        tmp_path: Path) -> None:
    """Each process listens on a socket of its own (SO_REUSEPORT): a burst of new
    connections after an idle moment is spread by the kernel. (With one shared socket, one
    process took all 64 connections of a burst in 2 bursts of 10.)"""
    server = start_serve("null", tmp_path, extra_args=["--workers", "2"])
    port = int(server.url.rsplit(":", 1)[1])
    parent = psutil.Process(server.proc.pid)

    def processes() -> list[psutil.Process]:
        return [p for p in parent.children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline())]

    try:
        assert len(processes()) == 2
        for _ in range(3):
            time.sleep(1.0)  # idle: both processes wait in their event loops
            burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
            time.sleep(0.3)
            counts = sorted(established(p, port) for p in processes())
            for s in burst:
                s.close()
            assert sum(counts) == 32 and counts[0] >= 4, counts

        # A second server on the same port is refused, as with a plain bind.
        second = subprocess.run(
            [sys.executable, "-m", "heron.cli", "serve", "--bundle", "null", "--workers", "2",
             "--port", str(port)], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert second.returncode != 0
        assert f"127.0.0.1:{port} is already in use" in second.stderr

        # A process that dies is replaced, and its socket goes with it: every new
        # connection is answered.
        victim = processes()[0]
        victim.kill()
        victim.wait(10)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            alive = [p for p in processes() if p.pid != victim.pid and p.is_running()]
            if len(alive) == 2 and all(local_http.get(server.url + "/readyz", timeout=5,
                                                      headers={"Connection": "close"}
                                                      ).status_code == 200 for _ in range(10)):
                break
            time.sleep(0.5)
        for i in range(40):
            r = local_http.post(server.url + "/v1/encode/null-model", json={"items": [f"t {i}"]},
                                headers={"Connection": "close"}, timeout=10)
            assert r.status_code == 200, r.text
    finally:
        server.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--models", "{bad}"], "bad.yaml: adapter: must be one of"),
    (["--bundle", "{missing}"], "missing.yaml"),
    (["--inference-cpus", "0-x"], "--inference-cpus: 0-x: expected off, auto, or a CPU list"),
    (["--inference-cpus", "100000"], "--inference-cpus: 100000: CPUs 100000 are not usable"),
])
def test_a_config_error_stops_several_processes_before_they_start(
        tmp_path: Path, args: list[str], message: str) -> None:
    """Refused once, in the parent, with one line and exit 2: no socket, no process (the
    processes would each fail and be started again forever)."""
    (tmp_path / "bad.yaml").write_text("id: x/bad\nadapter: nope\n")
    port = free_port()
    args = [a.format(bad=tmp_path / "bad.yaml", missing=tmp_path / "missing.yaml")
            for a in args]
    bundle = [] if "--bundle" in args else ["--bundle", "null"]
    proc = subprocess.run(
        [sys.executable, "-m", "heron.cli", "serve", *bundle, "--workers", "2", "--port",
         str(port), *args], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.startswith("heron: config error: ")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "spawn" not in proc.stderr and "listening" not in proc.stderr


def test_a_process_that_dies_while_starting_stops_the_server(tmp_path: Path) -> None:
    """Killed before it served (as the OOM killer might, loading): not started again and
    again; the server stops and exits 1."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "heron.cli", "serve", "--bundle", "null", "--workers", "2",
             "--port", str(port), "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    parent = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 60
        starting: list[psutil.Process] = []
        while not starting and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                starting = [p for p in parent.children()
                            if "spawn_main" in " ".join(p.cmdline())]
            time.sleep(0.01)
        starting[0].kill()  # it is still importing: it has not served yet
        assert proc.wait(60) == 1, log.read_text()
        assert "exited with status -9 while starting; stopping" in log.read_text()
        assert not [p for p in starting if p.is_running() and p.status() != "zombie"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
