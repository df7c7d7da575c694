"""End to end: gateway -> JetStream -> a real `heron worker` -> inbox -> gateway, answering
what the single-node server (`heron serve`) answers for the same inputs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from heron_sdk.client import Client

# The two servers batch differently (packing, batch composition): float noise only.
ATOL = 1e-4
TEXTS = [f"sentence number {i}: " + "the heron waits in the shallows " * (i % 5)
         for i in range(150)]  # 150 items: three work items through the cluster


@pytest.fixture()
def cluster_http(cluster_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster_url, timeout=120) as client:
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


def test_sparse_and_msgpack_equal_single_node(http: httpx.Client, cluster_url: str) -> None:
    base = str(http.base_url)
    with Client(base) as single_client, Client(cluster_url) as cluster_client:
        single = single_client.encode("splade-tiny", TEXTS[:20], output_types=["sparse"])
        cluster = cluster_client.encode("splade-tiny", TEXTS[:20], output_types=["sparse"])
    for a, b in zip(cluster, single, strict=True):
        np.testing.assert_array_equal(a.sparse.indices, b.sparse.indices)
        np.testing.assert_allclose(a.sparse.values, b.sparse.values, atol=ATOL)


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
