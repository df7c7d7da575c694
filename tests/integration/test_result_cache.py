"""The worker's result cache against real processes: a repeated text is answered from the
cache (equal vectors, ``cached: true``) in every dims and dtype, ``cache: false`` computes,
64 identical concurrent requests compute the text once (metrics), and through a gateway
and a worker following the config service, ``cached`` comes back and a config change of
the model makes the next answer a fresh computation (worker/result_cache.py). With the
shared tier on (worker/shared_results.py), a second worker in another pool answers what
the first computed, as ``cached`` with the same vector, unless ``cache: false``; after the
config change, from the new key only; and with its bucket gone, items are computed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import pytest

from heron.runtime.nats_names import RESULTS_BUCKET
from heron_sdk import Client
from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess, WorkerProcess
from tests.support.gateway_harness import GatewayThread, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import ServerProcess, start_serve

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SHARED = "heron_worker_result_cache_shared_total"
ENCODE = "/v1/encode/minilm"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One process: the dedup test counts one process's computations.
    proc = start_serve("default", tmp_path_factory.mktemp("cache-serve"),
                       extra_args=["--workers", "1"])
    yield proc
    proc.stop()


def metric(url: str, name: str, **labels: str) -> float:
    """A sample of /metrics, summed over the labels not given."""
    total = 0.0
    for line in local_http.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def text() -> str:
    return f"the heron waits in the reeds {uuid.uuid4().hex}"


def test_a_repeated_text_is_served_from_the_cache_in_any_shape(serve: ServerProcess) -> None:
    t = text()
    with httpx.Client(base_url=serve.url, timeout=60) as http:
        first = http.post(ENCODE, json={"items": [t]}).json()["items"][0]
        again = http.post(ENCODE, json={"items": [t, {"text": t, "id": "b"}]}).json()["items"]
        assert "cached" not in first
        assert again[0]["cached"] is True and again[1]["cached"] is True
        assert again[1]["id"] == "b"
        np.testing.assert_array_equal(again[0]["dense"], first["dense"])
        # One entry serves every dims and dtype: the same as computing them afresh.
        for shape in ({"dims": 128}, {"output_dtype": "int8"}, {"output_dtype": "binary"},
                      {"encoding": "base64", "output_dtype": "float16"}):
            cached = http.post(ENCODE, json={"items": [t], **shape}).json()["items"][0]
            fresh = http.post(ENCODE, json={"items": [t], "cache": False, **shape}
                              ).json()["items"][0]
            assert cached.pop("cached") is True and "cached" not in fresh
            assert cached == fresh, shape
        # Score reads the same entries (the text as a document: no prompt for MiniLM).
        scored = http.post("/v1/score/minilm", json={"query": t, "items": [t]}).json()
        assert scored["results"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert metric(serve.url, "heron_worker_result_cache_entries") >= 1
    assert metric(serve.url, "heron_worker_result_cache_bytes") > 1536


def test_cache_false_computes_and_stores_nothing(serve: ServerProcess) -> None:
    t = text()
    with httpx.Client(base_url=serve.url, timeout=60) as http:
        for _ in range(2):
            r = http.post(ENCODE, json={"items": [t, t], "cache": False})
            assert r.status_code == 200, r.text
            assert all("cached" not in item for item in r.json()["items"])
        assert "cached" not in http.post(ENCODE, json={"items": [t]}).json()["items"][0]
        bad = http.post(ENCODE, json={"items": [t], "cache": "no"})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "cache"
    with Client(serve.url) as client:  # the SDK's option and its Embedding.cached
        assert client.encode("minilm", [t]).items[0].cached is True
        assert client.encode("minilm", [t], cache=False).items[0].cached is False


def test_64_identical_concurrent_requests_compute_the_text_once(serve: ServerProcess) -> None:
    t = text()
    computed = ("heron_worker_items_total", {"model": MINILM})
    misses = ("heron_worker_result_cache_items_total", {"result": "miss"})
    before = [metric(serve.url, name, **labels) for name, labels in (computed, misses)]
    with httpx.Client(base_url=serve.url, timeout=60,
                      limits=httpx.Limits(max_connections=64)) as http, \
            ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda _: http.post(ENCODE, json={"items": [t]}), range(64)))
    assert all(a.status_code == 200 for a in answers)
    items = [a.json()["items"][0] for a in answers]
    assert sum("cached" not in i for i in items) == 1  # the one request that computed it
    assert all(i["dense"] == items[0]["dense"] for i in items)
    after = [metric(serve.url, name, **labels) for name, labels in (computed, misses)]
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1]


def _encode(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = local_http.post(url + ENCODE, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["items"][0]


def _stored(worker: WorkerProcess, at_least: float) -> None:
    """Wait for the worker's background writes to the shared tier."""
    deadline = time.monotonic() + 10
    while metric(worker.url, SHARED, result="stored") < at_least:
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.05)


def _shared_hits(worker: WorkerProcess) -> float:
    return metric(worker.url, "heron_worker_result_cache_items_total", result="shared")


async def _delete_bucket(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_key_value(RESULTS_BUCKET)
    finally:
        await nc.close()


def test_through_a_gateway_after_a_config_change_and_across_workers(
        nats_server: NatsServer, config_service: ConfigProcess, tmp_path: Path) -> None:
    pool = unique("cache")
    args = ["--config", config_service.url, "--result-cache-shared-bytes", "64MiB"]
    worker = WorkerProcess(nats_server.url, pool, tmp_path, extra_args=args)
    # Another pool, the same bucket: what it answers is what the tier gave it.
    other = WorkerProcess(nats_server.url, unique("cache-b"), tmp_path, extra_args=args)
    gateway = GatewayThread(nats_server.url, {"default": pool})
    try:
        worker.wait_ready()
        other.wait_ready()
        gateway.start()
        gateway.wait_for_capacity(pool, 60, worker.log_tail)
        t, t2 = text(), text()
        first = _encode(gateway.url, {"items": [t]})
        again = _encode(gateway.url, {"items": [t]})
        assert "cached" not in first and again["cached"] is True
        assert again["dense"] == first["dense"]
        assert "cached" not in _encode(gateway.url, {"items": [t], "cache": False})
        assert "cached" not in _encode(gateway.url, {"items": [t2]})

        # The other worker never computed them: the shared tier answers.
        _stored(worker, 2)
        shared = _encode(other.url, {"items": [t]})
        assert shared["cached"] is True and shared["dense"] == first["dense"]
        assert "cached" not in _encode(other.url, {"items": [t2], "cache": False})
        assert _shared_hits(other) == 1 and _encode(other.url, {"items": [t2]})["cached"]

        # A config change of the model (the config service only adds: a new profile).
        config = local_http.get(f"{config_service.url}/v1/configs/models/{MINILM}",
                                timeout=10).json()["model"]
        config["profiles"]["short"] = {"max_sequence_length": 128}
        r = local_http.post(config_service.url + "/v1/configs/models", json=config, timeout=10)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 30
        while min(w.metric("heron_worker_config_epoch") for w in (worker, other)) < \
                r.json()["epoch"]:
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.2)
        after = _encode(gateway.url, {"items": [t]})
        assert "cached" not in after  # computed again under the new config, no tier hit
        np.testing.assert_allclose(after["dense"], first["dense"], atol=1e-6)
        assert _encode(gateway.url, {"items": [t]})["cached"] is True
        assert worker.metric("heron_worker_result_cache_evictions_total") >= 1
        _stored(worker, 3)  # under the new key, which the other worker reads
        assert _encode(other.url, {"items": [t]})["cached"] is True
        assert _shared_hits(other) == 3

        # The bucket gone (NATS lost it): items are computed, the tier's errors counted,
        # and the next failed write declares the bucket again.
        asyncio.run(_delete_bucket(nats_server.url))
        assert "cached" not in _encode(gateway.url, {"items": [text()]})
        assert metric(worker.url, SHARED, result="error") >= 1
        deadline = time.monotonic() + 10
        t3 = text()
        while metric(worker.url, SHARED, result="stored") < 4:  # back in use
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.1)
            _encode(gateway.url, {"items": [t3]})
        assert _encode(other.url, {"items": [t3]})["cached"] is True
    finally:
        gateway.stop()
        worker.stop()
        other.stop()
