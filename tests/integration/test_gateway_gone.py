"""A gateway killed -9 with work queued for it: a real `heron worker` computes only what it
held when the gateway went, terminates the rest unread (never redelivered), and serves the
gateway started again with the same --gateway-id at once (its inbox is new)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import httpx
import nats
import pytest

from heron.runtime.nats_names import Header, work_consumer, work_stream, work_subjects
from tests.support import local_http
from tests.support.cluster_procs import GatewayProcess, WorkerProcess
from tests.support.nats_server import NatsServer

REQUESTS, ITEMS = 32, 64  # 2,048 items: ~5 s of MiniLM on the CI machine's 2 cores
# What a worker may hold when its gateway dies: a forward pass (max_batch_items 64), its
# fetch lookahead (16) and the work item that crossed it (up to 64 items); doubled for the
# slack of reading the counter just before the kill.
IN_FLIGHT_BOUND = 2 * (64 + 16 + 64)


def metric(worker: WorkerProcess, name: str, **labels: str) -> float:
    total = 0.0
    for line in local_http.get(worker.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_work_of_a_gateway_killed_9_is_terminated_not_computed(
        nats_server: NatsServer, tmp_path: Path) -> None:
    pool = f"gone{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(nats_server.url, pool, tmp_path)
    gateway = GatewayProcess(nats_server.url, {"default": pool}, tmp_path,
                             gateway_id="gw-fixed")
    try:
        worker.wait_ready()
        gateway.wait_ready()
        body = {"items": ["warm up"], "timeout_s": 60}
        deadline = time.monotonic() + 30
        while local_http.post(gateway.url + "/v1/encode/minilm", json=body,
                              timeout=60).status_code != 200:
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        figures = asyncio.run(_kill_with_work_queued(nats_server.url, pool, worker, gateway))
        print("FIGURES", figures)
        published, computed = figures["items_published"], figures["items_computed"]
        assert published >= REQUESTS * ITEMS // 2, figures  # most were queued
        # Every item computed once or dropped unread: none twice, none redelivered.
        assert computed + figures["terminated_unread"] == published, figures
        assert figures["redeliveries"] == 0, figures
        assert figures["computed_after_kill"] <= IN_FLIGHT_BOUND, figures
        assert figures["terminated_unread"] >= published - figures["computed_at_kill"] \
            - IN_FLIGHT_BOUND, figures

        # The same gateway id again, a new process: its work is computed, not terminated.
        gateway.restart()
        gateway.wait_ready()
        started = time.monotonic()
        r = local_http.post(gateway.url + "/v1/encode/minilm", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 3.0  # not held back as a suspect
    finally:
        gateway.stop()
        worker.stop()


async def _kill_with_work_queued(nats_url: str, pool: str, worker: WorkerProcess,
                                 gateway: GatewayProcess) -> dict[str, float]:
    nc = await nats.connect(nats_url)
    published = 0

    async def count(msg: nats.aio.msg.Msg) -> None:  # a core subscriber sees every publish
        nonlocal published
        published += int((msg.headers or {}).get(Header.COUNT, "1"))

    spy = await nc.subscribe(work_subjects(pool), cb=count)
    await nc.flush()  # the server has the subscription before the gateway publishes
    computed_before = metric(worker, "heron_worker_items_total")
    redelivered_before = metric(worker, "heron_worker_redeliveries_total")
    client = httpx.AsyncClient(base_url=gateway.url, timeout=120)
    calls = [asyncio.create_task(client.post("/v1/encode/minilm", json={
        "items": [f"request {r} text {i} about herons" for i in range(ITEMS)],
        "timeout_s": 120})) for r in range(REQUESTS)]
    try:
        for _ in range(200):  # until the gateway has published them all (or 10 s)
            await asyncio.sleep(0.05)
            if published >= REQUESTS * ITEMS:
                break
        computed_at_kill = metric(worker, "heron_worker_items_total") - computed_before
        gateway.proc.send_signal(signal.SIGKILL)
        gateway.proc.wait(10)
        js = nc.jetstream()
        for _ in range(300):  # until nothing is queued or held (or 30 s)
            await asyncio.sleep(0.1)
            info = await js.consumer_info(work_stream(pool), work_consumer(pool))
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
        await asyncio.sleep(1.0)  # past the last term, counters settle
        computed = metric(worker, "heron_worker_items_total") - computed_before
        return {
            "items_published": published, "computed_at_kill": computed_at_kill,
            "items_computed": computed, "computed_after_kill": computed - computed_at_kill,
            "terminated_unread": metric(worker, "heron_worker_terminated_items_total",
                                        computed="false"),
            "terminated_computed": metric(worker, "heron_worker_terminated_items_total",
                                          computed="true"),
            "redeliveries": metric(worker, "heron_worker_redeliveries_total")
            - redelivered_before,
            "left_in_stream": (await js.stream_info(work_stream(pool))).state.messages}
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await client.aclose()
        await spy.unsubscribe()
        await nc.close()
