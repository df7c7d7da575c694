"""The gateway over real HTTP and a real nats-server, with fake workers: round trips,
reassembly, bad input answered without publishing, 202 provisioning, deadlines, backlog."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import nats
import numpy as np
import pytest

from heron.gateway.settings import GatewaySettings
from heron.runtime.nats_names import demand_subject, work_stream
from heron_sdk import wire
from heron_sdk.client import Client
from heron_sdk.types import MAX_BODY_BYTES, MAX_ITEMS_PER_REQUEST
from tests.support import local_http
from tests.support.gateway_harness import (
    FakeWorker,
    GatewayThread,
    fake_score,
    fake_vector,
    unique,
    write_bundles,
)
from tests.support.nats_server import NatsServer

BACKLOG_BOUND = 200


@dataclass
class Cluster:
    url: str
    nats_url: str
    pools: dict[str, str]  # bundle -> pool
    gateway: GatewayThread
    warm_worker: FakeWorker


@pytest.fixture(scope="module")
def cluster(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    """Bundle ``warm`` has a fake worker answering (every result twice), ``stuck`` one that
    beats but never answers, ``cold`` no worker at all."""
    root = write_bundles(tmp_path_factory.mktemp("gw-bundles"), {
        "warm": ["dense", "rerank", "ner", "sparse"], "stuck": ["dense"], "cold": ["dense"]})
    pools = {b: unique(b) for b in ("warm", "stuck", "cold")}
    warm = FakeWorker(nats_server.url, pools["warm"], "warm", duplicate=True).start()
    stuck = FakeWorker(nats_server.url, pools["stuck"], "stuck", answer=False).start()
    settings = GatewaySettings(max_outstanding_items_per_pool=BACKLOG_BOUND,
                               startup_grace_s=1.0)
    gateway = GatewayThread(nats_server.url, pools, root, settings).start()
    try:
        # On a loaded host a first beat can come after the startup grace: wait for them.
        gateway.wait_for_capacity(pools["warm"], 10)
        gateway.wait_for_capacity(pools["stuck"], 10)
        yield Cluster(gateway.url, nats_server.url, pools, gateway, warm)
    finally:
        gateway.stop()
        warm.stop()
        stuck.stop()


@pytest.fixture()
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        yield client


def last_seq(nats_url: str, pool: str) -> int:
    """Messages ever published to the pool's stream (work-queue retention deletes consumed
    ones, the sequence never goes back)."""
    async def go() -> int:
        nc = await nats.connect(nats_url)
        try:
            return (await nc.jetstream().stream_info(work_stream(pool))).state.last_seq
        finally:
            await nc.close()
    return asyncio.run(go())


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- round trips ---------------------------------------------------------------------------
def test_encode_is_split_published_and_reassembled_in_order(cluster: Cluster,
                                                            http: httpx.Client) -> None:
    texts = [f"item {i} " + "x" * (i % 7) for i in range(150)]
    items = [{"text": t, "id": f"id{i}"} if i % 2 else t for i, t in enumerate(texts)]
    seen_before = len(cluster.warm_worker.seen)
    r = http.post("/v1/encode/warm-dense", json={"items": items})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "warm/dense" and len(body["items"]) == 150
    for i, (row, text) in enumerate(zip(body["items"], texts, strict=True)):
        assert row["dense"] == fake_vector(text).tolist()
        assert row.get("id") == (f"id{i}" if i % 2 else None)
    assert body["usage"]["tokens"] == sum(len(t.split()) + 2 for t in texts)
    counts = [int(h["Heron-Item-Count"]) for h in cluster.warm_worker.seen[seen_before:]]
    assert counts == [50, 50, 50]  # bounded, even, never one message per item
    assert "inference;dur=" in r.headers["server-timing"] and r.headers["x-request-id"]
    # every result came twice; the second copy was dropped
    assert metric(http.get("/metrics").text, "heron_gateway_results_ignored_total",
                  reason="duplicate") >= 3


def test_msgpack_client_gets_numpy_arrays(cluster: Cluster) -> None:
    with Client(cluster.url) as client:
        out = client.encode("warm/dense", ["alpha", "beta"], priority=2, timeout=10)
    assert isinstance(out[0].dense, np.ndarray)
    np.testing.assert_array_equal(out[1].dense, fake_vector("beta"))
    headers = cluster.warm_worker.seen[-1]
    assert headers["Heron-Priority"] == "2" and headers["Heron-Task"] == "encode"
    assert 0 < float(headers["Heron-Deadline"]) - time.time() <= 10


def test_score_ranks_across_slices_then_applies_top_k(http: httpx.Client) -> None:
    texts = [f"doc {'y' * (i * 37 % 23)}" for i in range(130)]
    items = [{"text": t, "id": f"d{i}"} for i, t in enumerate(texts)]
    r = http.post("/v1/score/warm-rerank", json={"query": "q", "items": items, "top_k": 10})
    assert r.status_code == 200, r.text
    scores = [fake_score(t) for t in texts]
    want = sorted(range(130), key=lambda i: (-scores[i], i))[:10]
    results = r.json()["results"]
    assert [row["index"] for row in results] == want
    assert [row["rank"] for row in results] == list(range(1, 11))
    assert [row["id"] for row in results] == [f"d{i}" for i in want]
    full = http.post("/v1/score/warm-dense", json={"query": "q", "items": texts}).json()
    assert len(full["results"]) == 130  # dense models score too


def test_extract_and_openai_embeddings(http: httpx.Client) -> None:
    r = http.post("/v1/extract/warm-ner", json={"items": ["Ada Lovelace", "Paris now"]})
    assert [i["entities"][0]["text"] for i in r.json()["items"]] == ["Ada", "Paris"]
    texts = ["one", "two words", "three"]
    floats = http.post("/v1/embeddings", json={"model": "warm-dense", "input": texts}).json()
    assert [d["index"] for d in floats["data"]] == [0, 1, 2]
    assert floats["data"][1]["embedding"] == fake_vector("two words").tolist()
    assert floats["model"] == "warm/dense" and floats["usage"]["prompt_tokens"] > 0
    b64 = http.post("/v1/embeddings", json={"model": "warm-dense", "input": "one",
                                            "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vector, fake_vector("one"))


def test_a_slice_error_fails_the_request_with_the_request_index(http: httpx.Client) -> None:
    texts = [f"t{i}" for i in range(120)]
    texts[100] = "boom"  # in the second slice (60..119), its index 40 there
    r = http.post("/v1/encode/warm-dense", json={"items": texts})
    assert r.status_code == 422 and r.json()["error"]["code"] == "INPUT_TOO_LONG"
    assert r.json()["error"]["field"] == "items[100]"


def test_a_server_side_slice_failure_is_per_item_errors(http: httpx.Client) -> None:
    texts = [f"text {i}" for i in range(150)]
    texts[70] = "crash"  # fails its slice server-side; the other slices are fine
    r = http.post("/v1/encode/warm-dense", json={"items": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    failed = [i for i, item in enumerate(body["items"]) if "error" in item]
    assert len(body["items"]) == 150 and body["errors"] == len(failed)
    assert 70 in failed and failed == list(range(failed[0], failed[-1] + 1)) and len(failed) < 150
    assert all(body["items"][i]["error"]["code"] == "INTERNAL" for i in failed)
    assert all("dense" in item for i, item in enumerate(body["items"]) if i not in failed)
    # Score has no place for per-item errors: the whole request fails.
    r = http.post("/v1/score/warm-rerank", json={"query": "q", "items": texts})
    assert r.status_code == 500 and r.json()["error"]["code"] == "INTERNAL"
    # Every slice failed: so did the request.
    r = http.post("/v1/encode/warm-dense", json={"items": ["crash"]})
    assert r.status_code == 500


def test_models_readyz_and_metrics(cluster: Cluster, http: httpx.Client) -> None:
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert set(models) == {"warm/dense", "warm/rerank", "warm/ner", "warm/sparse",
                           "stuck/dense", "cold/dense"}
    assert models["warm/rerank"]["pool"] == cluster.pools["warm"]
    assert models["cold/dense"]["state"] == "no_workers"
    one = http.get("/v1/models/warm-ner").json()
    assert one["id"] == "warm/ner" and one["task"] == "extract"
    assert one["bundle"] == "warm" and one["tasks"] == ["extract"]
    ready = http.get("/readyz").json()
    # heron serve's shape (status, models) plus what only a gateway knows.
    assert ready["status"] == "ready" and ready["nats_connected"] is True
    assert ready["models"] == {m: models[m]["state"] for m in models}  # as /v1/models
    assert ready["models"]["cold/dense"] == "no_workers"
    assert ready["pools"][cluster.pools["warm"]]["healthy_workers"] == 1
    text = http.get("/metrics").text
    assert metric(text, "heron_gateway_healthy_workers", pool=cluster.pools["warm"]) == 1
    assert metric(text, "heron_gateway_requests_total", route="encode", model="warm/dense",
                  status="200") >= 1
    assert "heron_gateway_nats_connected 1.0" in text


# ---- bad input: the worker's table, answered here, nothing published ------------------------
LONG_ITEMS = ["a"] * (MAX_ITEMS_PER_REQUEST + 1)
BAD = [
    # (method, path, body or raw bytes, content type, status, code, field)
    ("POST", "/v1/encode/warm-dense", b"{not json", "application/json", 400,
     "MALFORMED_BODY", None),
    ("POST", "/v1/encode/warm-dense", b"\xc1\xc1", "application/msgpack", 400,
     "MALFORMED_BODY", None),
    ("POST", "/v1/encode/warm-dense", b"", "application/json", 400, "MALFORMED_BODY", None),
    ("POST", "/v1/encode/warm-dense", b"[1, 2]", "application/json", 400, "MALFORMED_BODY",
     None),
    ("POST", "/v1/encode/warm-dense", b"a,b", "text/csv", 415, "UNSUPPORTED_MEDIA_TYPE",
     None),
    ("POST", "/v1/encode/warm-dense", {}, None, 422, "INVALID_FIELD", "items"),
    ("POST", "/v1/encode/warm-dense", {"items": []}, None, 422, "INVALID_FIELD", "items"),
    ("POST", "/v1/encode/warm-dense", {"items": "x"}, None, 422, "INVALID_FIELD", "items"),
    ("POST", "/v1/encode/warm-dense", {"items": ["ok", 5]}, None, 422, "INVALID_FIELD",
     "items[1]"),
    ("POST", "/v1/encode/warm-dense", {"items": [{"id": "a"}]}, None, 422, "INVALID_FIELD",
     "items[0].text"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "dims": 0}, None, 422,
     "INVALID_FIELD", "dims"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "priority": -1}, None, 422,
     "INVALID_FIELD", "priority"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "timeout_s": 0}, None, 422,
     "INVALID_FIELD", "timeout_s"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "truncate": "no"}, None, 422,
     "INVALID_FIELD", "truncate"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "encoding": "hex"}, None, 422,
     "INVALID_FIELD", "encoding"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "output_types": ["sparse"]}, None,
     422, "UNSUPPORTED_OUTPUT", "output_types"),
    ("POST", "/v1/encode/warm-dense", {"items": ["a"], "output_dtype": "float64"}, None,
     422, "UNSUPPORTED_OUTPUT", "output_dtype"),
    ("POST", "/v1/encode/warm-sparse", {"items": ["a"], "output_types": ["sparse"],
                                        "output_dtype": "binary"}, None, 422,
     "UNSUPPORTED_OUTPUT", "output_dtype"),
    ("POST", "/v1/encode/warm-dense", {"items": LONG_ITEMS}, None, 413, "TOO_MANY_ITEMS",
     "items"),
    ("POST", "/v1/score/warm-rerank", {"items": ["a"]}, None, 422, "INVALID_FIELD", "query"),
    ("POST", "/v1/score/warm-rerank", {"query": "q", "items": ["a"], "top_k": 0}, None, 422,
     "INVALID_FIELD", "top_k"),
    ("POST", "/v1/extract/warm-ner", {"items": ["a"], "threshold": 2}, None, 422,
     "INVALID_FIELD", "threshold"),
    ("POST", "/v1/extract/warm-dense", {"items": ["a"]}, None, 422, "UNSUPPORTED_TASK", None),
    ("POST", "/v1/encode/warm-rerank", {"items": ["a"]}, None, 422, "UNSUPPORTED_TASK", None),
    ("POST", "/v1/encode/no/such-model", {"items": ["a"]}, None, 404, "MODEL_NOT_FOUND",
     None),
    ("GET", "/v1/models/nope", None, None, 404, "MODEL_NOT_FOUND", None),
    ("GET", "/v1/nothing-here", None, None, 404, "NOT_FOUND", None),
    ("GET", "/v1/encode/warm-dense", None, None, 405, "METHOD_NOT_ALLOWED", None),
    # OpenAI's route: OpenAI's error shape (code lowercased, the field as param) and statuses
    ("POST", "/v1/embeddings", {"model": "warm-dense"}, None, 400, "invalid_field", "input"),
    ("POST", "/v1/embeddings", {"model": "warm-dense", "input": [1, "a"]}, None, 400,
     "invalid_field", "input"),
    ("POST", "/v1/embeddings", {"model": "nope", "input": "a"}, None, 404, "model_not_found",
     None),
    ("POST", "/v1/embeddings", {"model": "warm-sparse", "input": "a"}, None, 400,
     "unsupported_output", "output_types"),
]


def test_bad_input_is_answered_without_publishing(cluster: Cluster,
                                                  http: httpx.Client) -> None:
    before = last_seq(cluster.nats_url, cluster.pools["warm"])
    for method, path, body, ctype, status, code, field in BAD:
        if isinstance(body, bytes):
            r = http.request(method, path, content=body, headers={"content-type": ctype})
        else:
            r = http.request(method, path, json=body)
        assert r.status_code == status, (path, body, r.text)
        fmt = wire.media_type(r.headers["content-type"]) or wire.JSON
        error = wire.decode(r.content, fmt)["error"]
        assert error["code"] == code and error["message"], (path, body, error)
        assert error.get("param" if code.islower() else "field") == field, (path, body, error)
    big = b'{"items": ["' + b"a" * (MAX_BODY_BYTES + 10) + b'"]}'
    r = http.post("/v1/encode/warm-dense", content=big,
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert last_seq(cluster.nats_url, cluster.pools["warm"]) == before


# ---- no worker, slow workers, full pools -----------------------------------------------------
def test_no_healthy_worker_is_202_with_demand(cluster: Cluster) -> None:
    pool = cluster.pools["cold"]

    async def go() -> tuple[httpx.Response, dict, float]:
        nc = await nats.connect(cluster.nats_url)
        sub = await nc.subscribe(demand_subject(pool))
        await nc.flush()  # the server has the subscription before the gateway publishes
        try:
            async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:
                started = time.monotonic()
                r = await client.post("/v1/encode/cold-dense", json={"items": ["a"]})
                took = time.monotonic() - started
            msg = await sub.next_msg(timeout=3)
            return r, wire.decode(msg.data, wire.MSGPACK), took
        finally:
            await nc.close()

    r, demand, took = asyncio.run(go())
    assert r.status_code == 202, r.text
    assert int(r.headers["retry-after"]) >= 1 and took < 3
    body = r.json()
    assert body["status"] == "provisioning" and body["pool"] == pool
    assert body["bundle"] == "cold" and body["estimated_wait_s"] > 0
    assert demand["pool"] == pool and demand["bundle"] == "cold" and demand["ts"] > 0
    text = local_http.get(cluster.url + "/metrics").text
    assert metric(text, "heron_gateway_pending_demand", pool=pool) >= 1
    assert metric(text, "heron_gateway_requests_total", route="encode", model="cold/dense",
                  status="202") >= 1
    assert last_seq(cluster.nats_url, pool) == 0  # a 202 queues nothing


def test_deadline_is_504_and_the_request_is_forgotten(cluster: Cluster,
                                                      http: httpx.Client) -> None:
    started = time.monotonic()
    r = http.post("/v1/encode/stuck-dense", json={"items": ["a", "b"], "timeout_s": 0.4})
    took = time.monotonic() - started
    assert r.status_code == 504 and r.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    assert 0.35 < took < 2.0
    gateway = cluster.gateway.gateway
    assert gateway.dispatcher.outstanding(cluster.pools["stuck"]) == 0
    assert gateway.dispatcher.pending_requests() == 0


def test_backlog_past_the_bound_is_429(cluster: Cluster) -> None:
    dispatcher = cluster.gateway.gateway.dispatcher
    pool = cluster.pools["stuck"]

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:
            first = asyncio.create_task(client.post(
                "/v1/encode/stuck-dense", json={"items": ["x"] * 150, "timeout_s": 1.5}))
            while dispatcher.outstanding(pool) < 150:  # the first one is queued
                await asyncio.sleep(0.01)
            second = await client.post("/v1/encode/stuck-dense",
                                       json={"items": ["y"] * 60, "timeout_s": 1.5})
            return await first, second

    first, second = asyncio.run(go())
    assert second.status_code == 429 and second.json()["error"]["code"] == "QUEUE_FULL"
    assert int(second.headers["retry-after"]) >= 1
    assert first.status_code == 504  # nobody answers the stuck pool
    # once the backlog is gone, the pool takes work again (and times out again)
    r = local_http.post(cluster.url + "/v1/encode/stuck-dense",
                        json={"items": ["z"] * 60, "timeout_s": 0.2})
    assert r.status_code == 504


def test_a_chunked_request_counts_its_estimated_chunks_in_the_backlog(cluster: Cluster
                                                                      ) -> None:
    """Three 10,000-character texts in chunks of 100 tokens are about 75 chunks of work
    (characters / 4 a token at the gateway), not 3 items: with them outstanding, 150 more
    items are over the bound of 200."""
    dispatcher = cluster.gateway.gateway.dispatcher
    pool = cluster.pools["stuck"]
    long_body = {"items": ["heron " * 1667] * 3, "chunking": {"max_tokens": 100},
                 "timeout_s": 1.5}

    async def go() -> tuple[httpx.Response, int, httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:
            first = asyncio.create_task(client.post("/v1/encode/stuck-dense",
                                                    json=long_body))
            while dispatcher.outstanding(pool) == 0:
                assert not first.done(), first.result().text
                await asyncio.sleep(0.01)
            counted = dispatcher.outstanding(pool)
            second = await client.post("/v1/encode/stuck-dense",
                                       json={"items": ["y"] * 150, "timeout_s": 1.5})
            return await first, counted, second

    first, counted, second = asyncio.run(go())
    assert counted == 3 * 26  # ceil(10,002 / 4 / 100) chunks each
    assert second.status_code == 429 and second.json()["error"]["code"] == "QUEUE_FULL"
    assert first.status_code == 504
    assert dispatcher.outstanding(pool) == 0


def test_many_concurrent_requests_each_get_their_own_answer(cluster: Cluster) -> None:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as client:
            return await asyncio.gather(*(
                client.post("/v1/encode/warm-dense", json={"items": [f"req {i}", "x" * i]})
                for i in range(60)))

    for i, r in enumerate(asyncio.run(go())):
        assert r.status_code == 200, r.text
        assert r.json()["items"][0]["dense"] == fake_vector(f"req {i}").tolist()
        assert r.json()["items"][1]["dense"][0] == i
