"""End to end: gateway -> JetStream -> a real `heron worker` -> inbox -> gateway, answering
what the single-node server (`heron serve`, issue #2) answers for the same inputs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sdk.client import Client
from tests.gateway_harness import GatewayThread, start_worker, unique
from tests.nats_server import NatsServer

# The two servers batch differently (packing, batch composition): float noise only.
ATOL = 1e-4
TEXTS = [f"sentence number {i}: " + "the heron waits in the shallows " * (i % 5)
         for i in range(150)]  # 150 items: three work items through the cluster


@pytest.fixture(scope="module")
def gateway_url(nats_server: NatsServer, test_bundle: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway routing the test bundle (MiniLM, splade-tiny, the tiny models: the same
    bundle the session's `heron serve` runs) to a pool with one real worker."""
    pool = unique("e2e")
    worker = start_worker(nats_server.url, pool, test_bundle,
                          tmp_path_factory.mktemp("e2e-logs"))
    gateway = GatewayThread(nats_server.url, {str(test_bundle): pool}).start()
    try:
        deadline = time.monotonic() + 30
        while not gateway.gateway.health.has_capacity(pool):
            assert time.monotonic() < deadline, f"worker never beat as ready:\n{worker.log()}"
            time.sleep(0.1)
        beat = gateway.gateway.health.healthy(pool)[0]
        # gateway and worker read the same configs: their bundle hashes agree
        assert beat.bundle_hash == gateway.gateway.registry.bundle_hash(pool)
        yield gateway.url
    finally:
        gateway.stop()
        worker.stop()


@pytest.fixture()
def cluster_http(gateway_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_url, timeout=120) as client:
        yield client


def both(http: httpx.Client, cluster_http: httpx.Client, path: str, body: dict
         ) -> tuple[dict, dict]:
    single, cluster = http.post(path, json=body), cluster_http.post(path, json=body)
    assert single.status_code == 200, single.text
    assert cluster.status_code == 200, cluster.text
    return single.json(), cluster.json()


def test_encode_equals_single_node(http: httpx.Client, cluster_http: httpx.Client) -> None:
    items = [{"text": t, "id": f"i{n}"} for n, t in enumerate(TEXTS)]
    single, cluster = both(http, cluster_http, "/v1/encode/minilm", {"items": items})
    assert cluster["model"] == single["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    np.testing.assert_allclose([r["dense"] for r in cluster["items"]],
                               [r["dense"] for r in single["items"]], atol=ATOL)
    for a, b in zip(cluster["items"], single["items"], strict=True):
        assert (a["id"], a["tokens"], a["truncated"]) == (b["id"], b["tokens"], b["truncated"])
    assert cluster["usage"] == single["usage"]


def test_sparse_and_msgpack_equal_single_node(http: httpx.Client, gateway_url: str) -> None:
    base = str(http.base_url)
    with Client(base) as single_client, Client(gateway_url) as cluster_client:
        single = single_client.encode("splade-tiny", TEXTS[:20], output_types=["sparse"])
        cluster = cluster_client.encode("splade-tiny", TEXTS[:20], output_types=["sparse"])
    for a, b in zip(cluster["items"], single["items"], strict=True):
        np.testing.assert_array_equal(a["sparse"]["indices"], b["sparse"]["indices"])
        np.testing.assert_allclose(a["sparse"]["values"], b["sparse"]["values"], atol=ATOL)


@pytest.mark.parametrize("model", ["minilm", "tiny-cross-encoder"])
def test_score_equals_single_node(http: httpx.Client, cluster_http: httpx.Client,
                                  model: str) -> None:
    body = {"query": "where does the heron wait?", "items": TEXTS, "top_k": 20}
    single, cluster = both(http, cluster_http, f"/v1/score/{model}", body)
    assert [r["rank"] for r in cluster["results"]] == list(range(1, 21))
    np.testing.assert_allclose([r["score"] for r in cluster["results"]],
                               [r["score"] for r in single["results"]], atol=ATOL)
    # same order, except where two scores are closer than the float noise
    for a, b in zip(cluster["results"], single["results"], strict=True):
        assert a["index"] == b["index"] or abs(a["score"] - b["score"]) < ATOL


def test_extract_equals_single_node(http: httpx.Client, cluster_http: httpx.Client) -> None:
    body = {"items": ["Ada Lovelace met Charles Babbage in London."] * 3 + TEXTS[:10]}
    single, cluster = both(http, cluster_http, "/v1/extract/tiny-ner", body)
    for a, b in zip(cluster["items"], single["items"], strict=True):
        assert [(e["label"], e["start"], e["end"]) for e in a["entities"]] == \
            [(e["label"], e["start"], e["end"]) for e in b["entities"]]
    assert cluster["usage"] == single["usage"]


def test_openai_embeddings_equal_single_node(http: httpx.Client,
                                             cluster_http: httpx.Client) -> None:
    body = {"model": "minilm", "input": TEXTS[:5], "dimensions": 128}
    single, cluster = both(http, cluster_http, "/v1/embeddings", body)
    np.testing.assert_allclose([d["embedding"] for d in cluster["data"]],
                               [d["embedding"] for d in single["data"]], atol=ATOL)
    assert len(cluster["data"][0]["embedding"]) == 128
    assert cluster["usage"] == single["usage"]


def test_worker_side_errors_come_back_with_the_request_index(
        cluster_http: httpx.Client) -> None:
    texts = ["short"] * 70 + [" ".join(["token"] * 600)]
    r = cluster_http.post("/v1/encode/minilm", json={"items": texts, "truncate": False})
    assert r.status_code == 422 and r.json()["error"]["code"] == "INPUT_TOO_LONG"
    assert r.json()["error"]["field"] == "items[70]"
    r = cluster_http.post("/v1/encode/minilm", json={"items": ["a"], "dims": 1000})
    assert r.status_code == 422 and r.json()["error"]["field"] == "dims"
