"""Concurrent single-item requests are batched together; each gets its own answer."""

from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np

WORDS = ("heron wades through shallow water catching fish while the river runs past old "
         "stone bridges and quiet fields under a grey morning sky").split()


def texts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 60))) for _ in range(n)]


async def _encode_all(base_url: str, batch: list[str], path: str, field: str,
                      limit: int) -> list[np.ndarray]:
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def one(text: str) -> np.ndarray:
            # A long deadline: admission refuses work its measured rate could not finish in
            # time, and a rate measured while the machine was busy elsewhere must not fail a
            # test of batching (tests/faults/test_overload.py tests admission).
            r = await client.post(path, json={"items": [text], "timeout_s": 300})
            assert r.status_code == 200, r.text
            return np.array(r.json()["items"][0][field], dtype=np.float32)
        return list(await asyncio.gather(*(one(t) for t in batch)))


def test_200_concurrent_requests_equal_their_solo_answers(base_url: str,
                                                          http: httpx.Client) -> None:
    batch = texts(200)
    together = asyncio.run(_encode_all(base_url, batch, "/v1/encode/minilm", "dense", 200))
    # Solo: one request at a time, so every item runs in a batch of one.
    for text, got in zip(batch, together, strict=True):
        r = http.post("/v1/encode/minilm", json={"items": [text]})
        solo = np.array(r.json()["items"][0]["dense"], dtype=np.float32)
        np.testing.assert_allclose(got, solo, atol=2e-5)
    metrics = http.get("/metrics").text
    # The batcher really batched: some batch held more than one item.
    sums = [line for line in metrics.splitlines()
            if line.startswith("heron_worker_batch_items_bucket") and "minilm" in line.lower()
            and 'le="1.0"' in line]
    count = [line for line in metrics.splitlines()
             if line.startswith("heron_worker_batch_items_count") and "MiniLM" in line]
    assert sums and count and float(sums[0].split()[-1]) < float(count[0].split()[-1])


def test_mixed_models_concurrently(base_url: str) -> None:
    batch = texts(40, seed=3)

    async def run() -> tuple[list[np.ndarray], list[np.ndarray]]:
        return await asyncio.gather(
            _encode_all(base_url, batch, "/v1/encode/minilm", "dense", 20),
            _encode_all(base_url, batch, "/v1/encode/tiny-dense-cls", "dense", 20))

    dense, tiny = asyncio.run(run())
    assert all(v.shape == (384,) for v in dense) and all(v.shape == (32,) for v in tiny)
