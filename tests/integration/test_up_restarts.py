"""`heron up` keeps its children running: a gateway, a nats-server or a worker that dies is
started again, and each death and restart is printed and published on NATS, where the
gateway's cluster page picks them up."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import psutil
import pytest

from heron.cli.supervisor import EXITED, RESTARTED, SupervisorEvent
from heron.gateway.app import create_app
from heron.gateway.status_page import ClusterStatusPage, subscribe_supervisor_events
from heron.runtime.nats_names import SUPERVISOR_EVENTS
from tests.integration.test_up import UpProcess
from tests.support import local_http
from tests.support.nats_server import NatsServer


async def until(up: UpProcess, check: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert up.proc.poll() is None, up.log.read_text()
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)
    raise TimeoutError(f"{what} not within {timeout_s} s:\n{up.log.read_text()}")


def child(up: UpProcess, mark: str) -> psutil.Process:
    [found] = up.children_with(mark)
    return found


def ready_workers(up: UpProcess) -> int:
    response = local_http.get(up.url + "/readyz", timeout=2)
    return response.status_code == 200 and up.healthy_workers()


def encode(up: UpProcess) -> int:
    return local_http.post(up.url + "/v1/encode/minilm", json={"items": ["still here"]},
                           timeout=30).status_code


@pytest.mark.slow
async def test_dead_children_are_restarted_and_reported(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, "--workers", "1")
    nc = None
    try:
        await until(up, lambda: ready_workers(up) == 1, 150, "a ready worker")
        events: list[dict[str, Any]] = []

        async def heard(msg: Any) -> None:
            events.append(json.loads(msg.data))

        nc = await nats.connect(f"nats://127.0.0.1:{up.nats_port}", reconnect_time_wait=0.2)
        await nc.subscribe(SUPERVISOR_EVENTS, cb=heard)
        await nc.flush()

        # The gateway: restarted at once, answering again, both steps published.
        child(up, " gateway ").send_signal(signal.SIGKILL)
        await until(up, lambda: "heron up: gateway restarted (restart 1)" in up.log.read_text(),
                    60, "the gateway restarted")
        assert "heron up: gateway exited with status -9; restarting in 0.5 s (restart 1)" \
            in up.log.read_text()
        assert local_http.get(up.url + "/healthz", timeout=5).status_code == 200
        await until(up, lambda: [e["event"] for e in events if e["child"] == "gateway"][:2]
                    == ["exited", "restarted"], 10, "the gateway's events")
        died = next(e for e in events if e["event"] == "exited")
        assert died["status"] == -9 and died["restarts"] == 1 and died["restart_in_s"] == 0.5
        assert died["cause"] == "killed by SIGKILL" and died["at"] <= time.time()

        # nats-server: restarted on its port and store; the cluster serves again.
        child(up, "nats-server").send_signal(signal.SIGKILL)
        await until(up, lambda: "heron up: nats restarted (restart 1)" in up.log.read_text(),
                    60, "nats-server restarted")
        await until(up, lambda: nc.is_connected and nc.stats["reconnects"] == 1, 30,
                    "this test back on NATS")
        await until(up, lambda: encode(up) == 200, 60, "the cluster serving again")

        # A worker: the autoscaler replaces it, and says so.
        old = child(up, " worker ")
        old_id = re.search(r"--worker-id (\S+)", " ".join(old.cmdline()))[1]  # type: ignore[index]
        old.send_signal(signal.SIGKILL)
        await until(up, lambda: f"heron up: worker {old_id} exited with status -9; restarting "
                    "in 0.5 s (restart 1)" in up.log.read_text(), 30, "the worker's death")
        await until(up, lambda: any(e["child"] == f"worker {old_id}" and e["event"] == "exited"
                                    for e in events), 10, "the worker's death published")
        await until(up, lambda: [e for e in events if e["event"] == "restarted"
                                 and e["child"].startswith("worker ")], 30,
                    "the new worker published")
        new = re.findall(r"worker (\S+) starting \((http://[^)]+)\)", up.log.read_text())[-1]
        assert new[0] != old_id and f"heron up: worker {new[0]} restarted (restart 1)" \
            in up.log.read_text()
        await until(up, lambda: local_http.get(new[1] + "/readyz", timeout=2).status_code == 200,
                    150, "the new worker ready")
        await until(up, lambda: encode(up) == 200, 10, "the gateway routing to it")
    finally:
        if nc is not None:
            await nc.close()
        code = await asyncio.to_thread(up.stop)
    assert code == 0
    # Everything stopped in order, workers first, none restarted on the way out.
    text = up.log.read_text()
    assert text.count("restarted") == 3 and os.path.exists(up.data_dir / "logs" / "nats.log")


async def test_the_cluster_page_shows_what_heron_up_published(tmp_path: Path) -> None:
    """The gateway side (status_page.subscribe_supervisor_events) over a real NATS: what
    `heron up` publishes, each event once, newest first, in the page's snapshot."""
    app = create_app("nats://127.0.0.1:9", {"null": "nullpool"})  # its own link unused
    g = app.state.gateway
    page = ClusterStatusPage(g.gateway_id, g.health, g.registry, g.pools,
                             outstanding=lambda pool: 0, pending_demand=lambda pool: 0,
                             nats_connected=lambda: True, ready=lambda: True)
    server = NatsServer(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    try:
        await subscribe_supervisor_events(nc, page)
        died = SupervisorEvent("gateway", EXITED, -9, 1, time.time(), "killed by SIGKILL", 0.5)
        back = SupervisorEvent("gateway", RESTARTED, None, 1, time.time() + 1)
        for event in (died, back, died):  # published again after the restart: shown once
            await nc.publish(SUPERVISOR_EVENTS, event.to_json())
        await nc.publish(SUPERVISOR_EVENTS, b"{not an event")
        await nc.flush()
        deadline = time.monotonic() + 5
        while len(page.snapshot()["supervisor_events"]) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        shown = page.snapshot()["supervisor_events"]
        assert [(e["event"], e["status"], e["restarts"]) for e in shown] == [
            ("restarted", None, 1), ("exited", -9, 1)]
        assert shown[1]["cause"] == "killed by SIGKILL" and shown[1]["restart_in_s"] == 0.5
    finally:
        await nc.close()
        server.stop()
