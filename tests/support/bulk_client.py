"""A client process that only runs the SDK: a bulk ``encode_stream`` of a generator.

    python -m tests.support.bulk_client URL MODEL COUNT {sync,async} [CHUNK_SIZE]

Encodes ``Item(f"text number {i}", id=str(i))`` for i in range(COUNT), read lazily from a
generator, and checks as it goes that every chunk starts where the previous one ended and
every item's id is its input position (the null model returns the same vector for every
text, so the ids are what show order). Prints one JSON line: items, seconds, items/s, the
peak RSS of this process (``ru_maxrss``) and its RSS before the first request. Nothing
else runs here, so the peak is the SDK's (plus Python, numpy and httpx).
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections.abc import Iterator

import numpy as np

from heron_sdk import AsyncClient, Client, EncodedChunk, Item


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def texts(count: int) -> Iterator[Item]:
    for i in range(count):
        yield Item(f"text number {i}", id=str(i))


class Checker:
    def __init__(self) -> None:
        self.items = 0
        self.chunks = 0
        self.mismatches = 0
        self.dim: int | None = None

    def check(self, chunk: EncodedChunk) -> None:
        if chunk.offset != self.items:
            self.mismatches += 1
        ids = [e.id for e in chunk]
        if ids != [str(i) for i in chunk.positions]:
            self.mismatches += 1
        dense = chunk.dense
        self.dim = dense.shape[1]
        if dense.shape[0] != len(chunk) or not np.all(np.isfinite(dense)):
            self.mismatches += 1
        self.items += len(chunk)
        self.chunks += 1


def run_sync(url: str, model: str, count: int, chunk_size: int | None) -> Checker:
    checker = Checker()
    with Client(url) as client:
        for chunk in client.encode_stream(model, texts(count), chunk_size=chunk_size):
            checker.check(chunk)
    return checker


async def run_async(url: str, model: str, count: int, chunk_size: int | None) -> Checker:
    checker = Checker()
    async with AsyncClient(url) as client:
        async for chunk in client.encode_stream(model, texts(count), chunk_size=chunk_size):
            checker.check(chunk)
    return checker


def main(argv: list[str]) -> None:
    url, model, count, mode = argv[0], argv[1], int(argv[2]), argv[3]
    chunk_size = int(argv[4]) if len(argv) > 4 else None
    before = rss_mb()
    started = time.perf_counter()
    if mode == "sync":
        checker = run_sync(url, model, count, chunk_size)
    else:
        checker = asyncio.run(run_async(url, model, count, chunk_size))
    seconds = time.perf_counter() - started
    print(json.dumps({"mode": mode, "items": checker.items, "chunks": checker.chunks,
                      "mismatches": checker.mismatches, "dim": checker.dim,
                      "seconds": round(seconds, 3),
                      "items_per_s": round(checker.items / seconds, 1),
                      "rss_before_mb": round(before, 1), "peak_rss_mb": round(rss_mb(), 1)}))


if __name__ == "__main__":
    main(sys.argv[1:])
