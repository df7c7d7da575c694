"""The gateway's admission by deadline (gateway/admission.py) on a real nats-server: a pool
that has just answered a big request in a few slow work items still takes a burst of
one-text requests that share work items (coalescing), and still refuses at once what it
cannot finish in time."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.support import local_http
from tests.support.gateway_harness import FakeWorker, GatewayThread, fake_vector, unique
from tests.support.nats_server import NatsServer


def test_a_burst_of_small_requests_after_a_big_one_is_admitted(
        nats_server: NatsServer) -> None:
    pool = unique("admit")
    # 15 ms an item: the big request's 64-item work items take about a second each, a
    # shared work item of 10 one-text requests 0.15 s.
    worker = FakeWorker(nats_server.url, pool, "default", seconds_per_item=0.015).start()
    gateway = GatewayThread(nats_server.url, {"default": pool}).start()
    try:
        gateway.wait_for_capacity(pool, 10)
        big = local_http.post(gateway.url + "/v1/encode/minilm", timeout=60,
                              json={"items": [f"big {n}" for n in range(256)], "cache": False})
        assert big.status_code == 200, big.text

        async def client(http: httpx.AsyncClient, n: int) -> list[tuple[int, str, Any]]:
            answers = []
            for k in range(4):  # a closed loop: each answer brings the next request
                text = f"client {n} request {k}"
                r = await http.post("/v1/encode/minilm", json={
                    "items": [text], "timeout_s": 10, "cache": False})
                answers.append((r.status_code, text, r.json()))
            return answers

        async def burst() -> list[tuple[int, str, Any]]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                         limits=httpx.Limits(max_connections=50)) as http:
                runs = await asyncio.gather(*(client(http, n) for n in range(50)))
            return [answer for run in runs for answer in run]

        answers = asyncio.run(burst())
        refused = [body for status, _, body in answers if status != 200]
        assert not refused, f"{len(refused)} of {len(answers)} refused: {refused[0]}"
        for _, text, body in answers:
            assert body["items"][0]["dense"] == fake_vector(text).tolist()

        # What the pool cannot do in time is still refused at once: 300 items queued (about
        # 4.5 s of work), then 300 more that must finish within 2 s.
        async def too_much() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
                queued = asyncio.create_task(http.post("/v1/encode/minilm", json={
                    "items": [f"queued {n}" for n in range(300)], "cache": False}))
                await asyncio.sleep(0.3)
                hurried = await http.post("/v1/encode/minilm", json={
                    "items": [f"hurried {n}" for n in range(300)], "timeout_s": 2,
                    "cache": False})
                return await queued, hurried

        queued, hurried = asyncio.run(too_much())
        assert queued.status_code == 200, queued.text
        assert hurried.status_code == 429, hurried.text
        assert hurried.json()["error"]["code"] == "QUEUE_FULL"
    finally:
        gateway.stop()
        worker.stop()
