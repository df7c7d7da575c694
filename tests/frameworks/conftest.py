"""Shared by the framework tests: SDK clients on the session's `heron serve`, the models
they use and the texts they embed and rank."""

from __future__ import annotations

import os

# Haystack sends usage data to its vendor unless told not to (read when it is imported);
# no test reaches outside this machine.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from heron_sdk import AsyncClient, Client, wire

# tiny-dense-cls prompts queries ("query: ") and documents ("passage: ") differently, so a
# query encoded as a document, or the other way round, shows.
SIDED = "tiny-dense-cls"
RERANKER = "tiny-cross-encoder"
QUERY = "what does a heron eat?"
DOCS = ["Herons eat fish, frogs and insects.", "Paris is the capital of France.",
        "The grey heron waits in the shallows for fish.", "Rerankers order documents.",
        "A cross-encoder reads the query and the document together."]


@pytest.fixture(scope="session")
def client(base_url: str) -> Iterator[Client]:
    """The reference: what the SDK itself answers."""
    with Client(base_url) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def reference_ranking(client: Client) -> list[tuple[int, float]]:
    """(index into DOCS, score), best first, from the SDK's ``score``."""
    ranking = [(r.index, r.score) for r in client.score(RERANKER, QUERY, DOCS)]
    assert len(ranking) == len(DOCS)
    assert len({score for _, score in ranking}) == len(DOCS), "ties would hide an order bug"
    assert [i for i, _ in ranking] != list(range(len(DOCS))), "already in order: no test"
    return ranking


@dataclass
class Sent:
    """One request a recording client sent: its path, headers and decoded body."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@pytest.fixture()
def recording(base_url: str) -> Iterator[tuple[Client, AsyncClient, list[Sent]]]:
    """A Client and an AsyncClient on the session's server (at most 2 items a request) that
    note every request they send, as the server receives it. The test closes the
    AsyncClient (its connections belong to the test's event loop)."""
    sent: list[Sent] = []

    def note(request: httpx.Request) -> None:
        body = wire.decode(request.content, wire.MSGPACK) if request.content else {}
        sent.append(Sent(request.url.path, dict(request.headers), body))

    async def anote(request: httpx.Request) -> None:
        note(request)

    http = httpx.Client(base_url=base_url, timeout=60, event_hooks={"request": [note]})
    ahttp = httpx.AsyncClient(base_url=base_url, timeout=60, event_hooks={"request": [anote]})
    with Client(base_url, max_items_per_request=2, http=http) as sync:
        yield sync, AsyncClient(base_url, max_items_per_request=2, http=ahttp), sent


def assert_same_vectors(actual: object, expected: np.ndarray) -> None:
    """The SDK's vectors. A vector moves by up to about 1e-7 with the batch it was computed
    in (padding); a query embedded as a document moves by more than 1e-4."""
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float32), expected, rtol=0,
                               atol=1e-6)
