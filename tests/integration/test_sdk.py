"""The SDK against real servers: every call, sync and async, in both wire formats, returns
what the HTTP API returns, against `heron serve` and against a cluster gateway (the session
fixtures ``base_url`` and ``cluster_url`` serve the same test bundle)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import openai
import pytest

from heron_sdk import (
    AsyncClient,
    Client,
    ConnectionError,
    EncodeResult,
    ExtractResult,
    Item,
    ModelNotFound,
    ProvisioningTimeout,
    RequestError,
    ScoreResult,
)
from tests.support import local_http
from tests.support.gateway_harness import GatewayThread, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import free_port

TEXTS = ["Heron serves embeddings.", "Reranking and extraction too.",
         "The heron waits in the shallows " * 12, "short"]
ATOL = 1e-5


@pytest.fixture(params=["serve", "cluster"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("base_url" if request.param == "serve" else "cluster_url")


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest, url: str) -> Iterator[Callable[..., Any]]:
    """``call("encode", model, items, **options)`` through Client or AsyncClient; each
    test runs in both wire formats by alternating them (msgpack sync, json async)."""
    if request.param == "sync":
        with Client(url) as client:
            yield lambda method, *args, **kw: getattr(client, method)(*args, **kw)
        return
    loop = asyncio.new_event_loop()
    client = AsyncClient(url, wire="json")
    yield lambda method, *args, **kw: loop.run_until_complete(
        getattr(client, method)(*args, **kw))
    loop.run_until_complete(client.close())
    loop.close()


def http_post(url: str, path: str, body: dict) -> dict:
    r = local_http.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_encode_dense_matches_http(call: Callable[..., Any], url: str) -> None:
    items = [Item(t, id=f"doc-{n}") for n, t in enumerate(TEXTS)]
    got: EncodeResult = call("encode", "minilm", items, dims=128, is_query=True)
    want = http_post(url, "/v1/encode/minilm", {
        "items": [{"text": t, "id": f"doc-{n}"} for n, t in enumerate(TEXTS)],
        "dims": 128, "is_query": True})
    assert got.model == want["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert got.dense.shape == (4, 128) and got.dense.dtype == np.float32
    np.testing.assert_allclose(got.dense, [r["dense"] for r in want["items"]], atol=ATOL)
    assert [(e.id, e.tokens, e.truncated) for e in got] == \
        [(r["id"], r["tokens"], r["truncated"]) for r in want["items"]]
    assert got.tokens == want["usage"]["tokens"] and not got.errors


def test_encode_sparse_multi_vector_and_dtypes(call: Callable[..., Any], url: str) -> None:
    sparse = call("encode", "splade-tiny", ["sparse retrieval"], output_types=["sparse"])
    want = http_post(url, "/v1/encode/splade-tiny",
                     {"items": ["sparse retrieval"], "output_types": ["sparse"]})["items"][0]
    np.testing.assert_array_equal(sparse[0].sparse.indices, want["sparse"]["indices"])
    np.testing.assert_allclose(sparse[0].sparse.values, want["sparse"]["values"], atol=ATOL)
    assert sparse[0].sparse.indices.dtype == np.int32 and sparse[0].dense is None

    multi = call("encode", "tiny-multi-vector", ["late interaction"],
                 output_types=["multi_vector", "dense"], output_dtype="float16")
    want = http_post(url, "/v1/encode/tiny-multi-vector", {
        "items": ["late interaction"], "output_types": ["multi_vector", "dense"],
        "output_dtype": "float16"})["items"][0]
    assert multi[0].multi_vector.dtype == np.float16 and multi[0].multi_vector.ndim == 2
    np.testing.assert_allclose(multi[0].multi_vector, want["multi_vector"], atol=1e-3)

    binary = call("encode", "minilm", ["bits"], output_dtype="binary")
    assert binary[0].dense.dtype == np.uint8 and binary[0].dense.shape == (48,)


@pytest.mark.parametrize("model", ["tiny-cross-encoder", "minilm"])
def test_score_matches_http(call: Callable[..., Any], url: str, model: str) -> None:
    docs = [Item("Paris is the capital of France.", id="paris"),
            "Berlin is the capital of Germany.", "The Seine flows through Paris."]
    got: ScoreResult = call("score", model, "What is the capital of France?", docs, top_k=2)
    want = http_post(url, f"/v1/score/{model}", {
        "query": "What is the capital of France?", "top_k": 2,
        "items": [{"text": "Paris is the capital of France.", "id": "paris"}, *docs[1:]]})
    assert [(r.index, r.rank, r.id) for r in got] == \
        [(r["index"], r["rank"], r.get("id")) for r in want["results"]]
    np.testing.assert_allclose([r.score for r in got], [r["score"] for r in want["results"]],
                               atol=ATOL)
    assert got.tokens == want["usage"]["tokens"]


def test_extract_matches_http(call: Callable[..., Any], url: str) -> None:
    text = "Ada Lovelace was born in London and worked with Charles Babbage."
    got: ExtractResult = call("extract", "tiny-ner", [text, "nothing here"], threshold=0.0)
    want = http_post(url, "/v1/extract/tiny-ner", {"items": [text, "nothing here"]})
    for item, row in zip(got, want["items"], strict=True):
        assert [(e.label, e.text, e.start, e.end) for e in item.entities] == \
            [(e["label"], e["text"], e["start"], e["end"]) for e in row["entities"]]
        for e in item.entities:
            assert text[e.start:e.end] == e.text or e.text in "nothing here"


def test_models_and_capacity(call: Callable[..., Any], url: str) -> None:
    want = local_http.get(url + "/v1/models", timeout=10).json()["data"]
    got = call("list_models")
    assert [m["id"] for m in got] == [m["id"] for m in want]
    one = call("get_model", "minilm")
    assert one["id"] == "sentence-transformers/all-MiniLM-L6-v2" and one["state"] == "ready"
    ready = call("wait_for_capacity", "minilm", provision_timeout_s=30)
    assert ready["model"] == one["id"] and ready["state"] == "ready"


def test_calls_over_the_item_limit_are_split_and_stitched_in_order(url: str) -> None:
    texts = [f"item {n} " + "word " * (n % 9) for n in range(23)]
    want = http_post(url, "/v1/encode/minilm", {"items": texts})
    with Client(url, max_items_per_request=5) as client:
        got = client.encode("minilm", texts)
        ranked = client.score("minilm", "item 7", texts, top_k=4)
    np.testing.assert_allclose(got.dense, [r["dense"] for r in want["items"]], atol=ATOL)
    assert got.tokens == want["usage"]["tokens"]
    whole = http_post(url, "/v1/score/minilm", {"query": "item 7", "items": texts, "top_k": 4})
    assert [(r.index, r.rank) for r in ranked] == \
        [(r["index"], r["rank"]) for r in whole["results"]]

    async def split_async() -> EncodeResult:
        async with AsyncClient(url, max_items_per_request=4) as client:
            return await client.encode("minilm", texts)

    np.testing.assert_allclose(asyncio.run(split_async()).dense, got.dense, atol=ATOL)


def test_openai_client_gets_the_sdk_embeddings_through_the_gateway(cluster_url: str) -> None:
    oai = openai.OpenAI(base_url=cluster_url + "/v1", api_key="unused", max_retries=0)
    out = oai.embeddings.create(model="minilm", input=TEXTS)
    with Client(cluster_url) as client:
        ours = client.encode("minilm", TEXTS).dense
    np.testing.assert_allclose([d.embedding for d in out.data], ours, atol=ATOL)


# ---- errors ----------------------------------------------------------------------------
def test_error_types(url: str) -> None:
    with Client(url, timeout=5) as client:
        with pytest.raises(ModelNotFound) as missing:
            client.encode("no-such-model", ["x"])
        assert missing.value.status == 404 and missing.value.code == "MODEL_NOT_FOUND"
        with pytest.raises(RequestError) as bad:
            client.encode("minilm", ["x"], dims=100_000)
        assert (bad.value.status, bad.value.code, bad.value.field) == \
            (422, "INVALID_FIELD", "dims")
        with pytest.raises(RequestError) as task:
            client.extract("minilm", ["x"])
        assert task.value.code == "UNSUPPORTED_TASK"
    with pytest.raises(TypeError, match="dimz"):
        Client(url).encode("minilm", ["x"], dimz=3)  # type: ignore[call-arg]


def test_connection_error_after_retrying_within_the_deadline() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with Client(f"http://127.0.0.1:{port}", timeout=1.5) as client, \
            pytest.raises(ConnectionError) as info:
        client.encode("minilm", ["x"])
    assert 0.5 < time.monotonic() - started < 5
    assert info.value.code == "CONNECTION_FAILED" and "127.0.0.1" not in info.value.code


def test_provisioning_timeout_without_an_autoscaler(nats_server: NatsServer) -> None:
    """A pool with no worker and nothing to start one: the SDK waits through 202s for
    provision_timeout_s, then raises ProvisioningTimeout (sync and async alike)."""
    gateway = GatewayThread(nats_server.url, {"default": unique("cold")}).start()
    try:
        started = time.monotonic()
        with Client(gateway.url) as client, pytest.raises(ProvisioningTimeout) as info:
            client.encode("minilm", ["anyone there?"], provision_timeout_s=2.5)
        waited = time.monotonic() - started
        assert 2.0 <= waited < 6, waited
        assert info.value.status == 202 and "provisioning" in info.value.message

        async def no_wait() -> None:
            async with AsyncClient(gateway.url, wait_for_capacity=False) as client:
                await client.encode("minilm", ["now or never"])

        started = time.monotonic()
        with pytest.raises(ProvisioningTimeout, match="wait_for_capacity=False"):
            asyncio.run(no_wait())
        assert time.monotonic() - started < 2.5
    finally:
        gateway.stop()
