"""`heron up`: the local cluster as a user runs it, scale from zero included."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from heron.cli.main import usable_cpus
from heron.cli.up import NVIDIA_DEVICE
from heron_sdk import Client
from tests.support import local_http
from tests.support.servers import REPO, free_port


class UpProcess:
    def __init__(self, tmp: Path, *args: str, nats_port: int | None = None,
                 env: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> None:
        self.port, self.nats_port = free_port(), nats_port or free_port()
        self.log = tmp / "up.log"
        self.data_dir = tmp / "data"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "heron.cli", "up", "--port", str(self.port),
                 "--nats-port", str(self.nats_port), "--config-port", "0", "--data-dir",
                 str(self.data_dir), *args],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                env={**{k: v for k, v in os.environ.items() if k not in unset},
                     "HF_HUB_OFFLINE": "1", **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def running_children(self) -> list[tuple[psutil.Process, str]]:
        """The running children with their command lines. One that exited but is not reaped
        yet (a zombie) or is gone has none: it is left out, not an error (CI saw
        psutil.ZombieProcess and NoSuchProcess here while a killed or scaled-down child was
        being reaped)."""
        running = []
        for child in self.children():
            try:
                running.append((child, " ".join(child.cmdline())))
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue
        return running

    def child_commands(self) -> list[str]:
        return [command for _, command in self.running_children()]

    def children_with(self, mark: str) -> list[psutil.Process]:
        """The running children whose command line holds ``mark``."""
        return [child for child, command in self.running_children() if mark in command]

    def wait_for(self, check, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log.read_text())

    def stop(self) -> int:
        children = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        _, alive = psutil.wait_procs(children, timeout=10)
        for p in alive:  # should be none; never leave them behind
            p.kill()
        assert not alive, f"orphans: {alive}"
        return self.proc.returncode

    def healthy_workers(self) -> int:
        ready = local_http.get(self.url + "/readyz", timeout=2).json()
        return ready["pools"]["default"]["healthy_workers"]


@pytest.mark.slow
def test_scale_from_zero_then_idle_scale_down(tmp_path: Path, http: httpx.Client) -> None:
    # The bundle as a file elsewhere, as `heron serve --bundle FILE` takes it, named
    # otherwise than its bundle and beside a YAML file that is no bundle: the cluster names
    # the pool after the bundle (default) and serves it alone.
    bundles = tmp_path / "etc-heron"
    (bundles / "models").mkdir(parents=True)
    shutil.copy(REPO / "bundles" / "default.yaml", bundles / "prod.yaml")
    shutil.copy(REPO / "bundles" / "models" / "all-minilm-l6-v2.yaml", bundles / "models")
    (bundles / "compose.yaml").write_text("services: {}\n")
    up = UpProcess(tmp_path, "--workers", "0", "--min-workers", "0", "--idle-cooldown", "3",
                   "--bundle", str(bundles / "prod.yaml"))
    try:
        up.wait_for(lambda: local_http.get(up.url + "/readyz", timeout=1).status_code == 200)
        body = {"items": ["wake the pool"]}
        first = local_http.post(up.url + "/v1/encode/minilm", json=body, timeout=10)
        assert first.status_code == 202, first.text
        assert int(first.headers["retry-after"]) >= 1
        info = first.json()
        assert info["status"] == "provisioning" and info["pool"] == "default"
        assert info["bundle"] == "default" and info["estimated_wait_s"] > 0

        # The autoscaler heard the demand and starts a worker. The SDK waits through the
        # 202s (honouring Retry-After) and returns the vectors.
        started = time.monotonic()
        with Client(up.url, provision_timeout_s=150) as client:
            result = client.encode("minilm", body["items"])
        print(f"SDK waited {time.monotonic() - started:.1f} s for a worker from zero")
        want = http.post("/v1/encode/minilm", json=body).json()
        np.testing.assert_allclose(result[0].dense, want["items"][0]["dense"], atol=2e-5)
        # Idle past the cooldown: the worker is stopped again (scale to zero).
        # The worker leaves the pool on SIGTERM, a moment before `heron up` sees it exit
        # and logs "stopped"; wait for both.
        up.wait_for(lambda: up.healthy_workers() == 0
                    and re.search(r"worker \S+ stopped", up.log.read_text()), timeout_s=60)
    finally:
        assert up.stop() == 0


def test_up_serves_and_stops_without_orphans(tmp_path: Path) -> None:
    # As a user starts it: no --workers, no HERON_WORKERS (the suite sets it to 1), so
    # --workers auto: one worker, running as many single-thread forward passes at once as
    # heron serve runs processes (on CPU).
    up = UpProcess(tmp_path, unset=("HERON_WORKERS",))
    on_gpu = Path(NVIDIA_DEVICE).exists()
    try:
        up.wait_for(lambda: local_http.get(up.url + "/readyz", timeout=1).status_code == 200
                    and up.healthy_workers() == 1)
        # The console says when the worker serves, once.
        up.wait_for(lambda: up.log.read_text().count(" ready, pool default (") == 1)
        names = " ".join(up.child_commands())
        assert "nats-server" in names and " gateway " in names and " worker " in names
        # The cores split between the passes, as heron serve splits them between its
        # processes (torch's default would give each pass a thread per core).
        (worker,) = up.children_with(" worker ")
        passes = os.environ.get("HERON_INFERENCE_THREADS") or (
            None if on_gpu else str(min(usable_cpus(), 4)))
        assert worker.environ().get("HERON_INFERENCE_THREADS") == passes
        threads = os.environ.get("HERON_THREADS") or str(
            max(1, usable_cpus() // int(passes or 1)))
        assert worker.environ().get("HERON_THREADS") == threads
        # nats-server shares the cores with the model: a Go thread per 4 usable CPUs.
        (nats_server,) = up.children_with("nats-server")
        assert nats_server.environ()["GOMAXPROCS"] == os.environ.get(
            "GOMAXPROCS", str(max(1, usable_cpus() // 4)))
        r = local_http.post(up.url + "/v1/encode/minilm", json={"items": ["a", "b"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["items"]) == 2
        text = up.log.read_text()
        assert f"gateway on http://127.0.0.1:{up.port}" in text and "nats-server on" in text
        assert "Traceback" not in text  # the autoscaler's rounds among them
    finally:
        assert up.stop() == 0
