"""Coalescing through a real cluster: concurrent small requests share work items, and each
still gets exactly the answer it would get alone (the single node's), its own id and timings,
and its own errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import nats
import numpy as np
from nats.js.errors import NotFoundError

from heron.runtime.nats_names import WORK_STREAM_PREFIX, Lane, lane_consumer
from tests.support import local_http
from tests.support.nats_server import NatsServer

MODEL = "minilm"
ATOL = 1e-4  # batch composition differs between the two servers: float noise only


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


async def _burst(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=len(bodies))) as client:
        return await asyncio.gather(*(
            client.post(f"/v1/encode/{MODEL}", json=body, headers={"x-request-id": f"co-{n}"})
            for n, body in enumerate(bodies)))


def test_concurrent_small_requests_share_work_items_and_get_their_own_answers(
        http: httpx.Client, cluster_url: str) -> None:
    # timeout_s: admission judges the burst by the rate the session's cluster measured on
    # earlier tests' requests, which can be a few small ones (gateway/admission.py).
    bodies = [{"items": [{"text": f"text {n}: the heron waits " * (1 + n % 4), "id": f"i{n}"}
                         for _ in range(1 + n % 3)], "timeout_s": 300} for n in range(48)]
    before = local_http.get(cluster_url + "/metrics").text
    answers = asyncio.run(_burst(cluster_url, bodies))
    for answer in answers:
        assert answer.status_code == 200, answer.text
    # A work item is counted when JetStream acks its publish, and on a busy host its result
    # can beat that ack back: the last group may be counted just after its answers.
    deadline = time.monotonic() + 5
    while True:
        after = local_http.get(cluster_url + "/metrics").text
        groups = (_metric(after, "heron_gateway_coalesced_requests_count")
                  - _metric(before, "heron_gateway_coalesced_requests_count"))
        shared = (_metric(after, "heron_gateway_coalesced_requests_sum")
                  - _metric(before, "heron_gateway_coalesced_requests_sum"))
        if shared >= len(bodies) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert shared == len(bodies)  # every request went in a shared work item ...
    assert groups < len(bodies)  # ... and some shared one with others
    for n, (body, answer) in enumerate(zip(bodies, answers, strict=True)):
        assert answer.headers["x-request-id"] == f"co-{n}"
        phases = [p.split(";")[0].strip() for p in answer.headers["server-timing"].split(",")]
        assert phases[:3] == ["coalesce", "publish", "queue_wait"] and phases[-1] == "total"
        alone = http.post(f"/v1/encode/{MODEL}", json=body).json()
        got = answer.json()
        assert [r["id"] for r in got["items"]] == [r["id"] for r in alone["items"]]
        assert [r["tokens"] for r in got["items"]] == [r["tokens"] for r in alone["items"]]
        assert got["usage"] == alone["usage"]
        np.testing.assert_allclose([r["dense"] for r in got["items"]],
                                   [r["dense"] for r in alone["items"]], atol=ATOL)


def test_a_bad_request_fails_alone_and_its_neighbours_are_answered(
        http: httpx.Client, cluster_url: str) -> None:
    """truncate false and a text over the model's length: only the worker can tell (the
    gateway has no tokenizer). The request that shared the work item with it is sent
    again without it; the bad one gets its own 422, naming its own item."""
    too_long = "heron " * 2000
    resent = 0.0
    for attempt in range(5):  # until the bad request shared a work item (nearly always)
        good = [{"items": [f"good {attempt}.{n}"], "truncate": False}
                for n in range(24)]
        bad = {"items": ["fine", too_long], "truncate": False}
        bodies = [*good[:12], bad, *good[12:]]
        before = local_http.get(cluster_url + "/metrics").text
        answers = asyncio.run(_burst(cluster_url, bodies))
        after = local_http.get(cluster_url + "/metrics").text
        failed = answers[12]
        assert failed.status_code == 422, failed.text
        error = failed.json()["error"]
        assert error["code"] == "INPUT_TOO_LONG" and error["field"] == "items[1]"
        for body, answer in zip(good, answers[:12] + answers[13:], strict=True):
            assert answer.status_code == 200, answer.text
            alone = http.post(f"/v1/encode/{MODEL}", json=body).json()
            np.testing.assert_allclose(answer.json()["items"][0]["dense"],
                                       alone["items"][0]["dense"], atol=ATOL)
        resent = (_metric(after, "heron_gateway_coalesced_resent_total")
                  - _metric(before, "heron_gateway_coalesced_resent_total"))
        if resent:
            break
    assert resent >= 1, "the bad request never shared a work item in five bursts"


async def _lane_deliveries(nats_url: str) -> dict[Lane, int]:
    """Work items delivered so far by each lane's consumers, over every pool's stream."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        out = dict.fromkeys(Lane, 0)
        for stream in await js.streams_info():
            if not stream.config.name.startswith(WORK_STREAM_PREFIX):
                continue
            pool = stream.config.name.removeprefix(WORK_STREAM_PREFIX)
            for lane in Lane:
                try:
                    info = await js.consumer_info(stream.config.name, lane_consumer(pool, lane))
                except NotFoundError:  # a stream other tests declared by hand
                    continue
                out[lane] += info.delivered.consumer_seq
        return out
    finally:
        await nc.close()


def test_requests_of_every_priority_are_answered_through_their_lanes(
        http: httpx.Client, cluster_url: str, nats_server: NatsServer) -> None:
    """Priority 0 goes on the pool's first lane, every other priority on its low lane
    (coalesced only with its own priority): each request still gets the single node's
    answer."""
    bodies = [{"items": [f"priority {p}, text {n}: the heron waits"], "priority": p}
              for n in range(8) for p in (0, 1, 5)]
    before = asyncio.run(_lane_deliveries(nats_server.url))
    answers = asyncio.run(_burst(cluster_url, bodies))
    after = asyncio.run(_lane_deliveries(nats_server.url))
    for body, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, answer.text
        alone = http.post(f"/v1/encode/{MODEL}", json=body).json()
        np.testing.assert_allclose(answer.json()["items"][0]["dense"],
                                   alone["items"][0]["dense"], atol=ATOL)
    assert after[Lane.FIRST] > before[Lane.FIRST]
    # Priorities 1 and 5 never share a work item: at least two on the low lane.
    assert after[Lane.LOW] - before[Lane.LOW] >= 2
    assert after[Lane.BULK] == before[Lane.BULK]
