"""Load for the fault tests and bench/faults_bench.py: single-text encode requests against a
gateway over real HTTP, one record per request (status, latency, Retry-After, the vector),
and the figures a fault is judged by: lost (no answer), wrong (a 200 whose vector differs
from the reference taken before the fault), non-200s, the longest request, rates."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from heron_sdk import AsyncClient, HeronError
from tests.faults.rawhttp import HttpConnection
from tests.support import local_http

MODEL = "minilm"
ATOL = 1e-5  # fp32 in every test process (tests/conftest.py): stable across batch compositions


def texts_for(tag: str, count: int = 256) -> list[str]:
    """``count`` distinct short texts: a request that got another one's answer shows."""
    return [f"{tag} {i}: the heron stands still in shallow water, waiting for fish"
            for i in range(count)]


_WORDS = ("heron", "river", "reed", "fish", "wader", "marsh", "still", "patient", "grey",
          "wings", "morning", "shallow", "water", "strikes", "silver", "mud", "nest",
          "colony", "flight", "slow", "neck", "bill", "tide", "bank", "willow", "frog")


def long_texts_for(tag: str, count: int = 64, words: int = 180) -> list[str]:
    """``count`` distinct texts of 185-199 MiniLM tokens (its limit is 256): the worker
    finished 45-50 of them per second against 180 or more short ones, so a few thousand
    requests overload it."""
    return [f"{tag} {i}: " + " ".join(_WORDS[(i * 7 + k * (i % 5 + 1)) % len(_WORDS)]
                                      for k in range(words)) for i in range(count)]


@dataclass(slots=True)
class Answer:
    """What one request got."""

    text: int  # index into the texts
    started: float  # seconds since the load began
    took: float
    status: int  # HTTP status; 0: no answer (client timeout, connection refused or reset)
    error: str = ""  # a non-200 body's error code; ClientTimeout; or the transport error's name
    retry_after: str | None = None
    vector: np.ndarray | None = None

    @property
    def ended(self) -> float:
        return self.started + self.took


def reference(url: str, texts: list[str], timeout_s: float = 120) -> np.ndarray:
    """Every text's vector, asked of the healthy cluster before any fault (one request)."""
    r = local_http.post(f"{url}/v1/encode/{MODEL}", json={"items": texts}, timeout=timeout_s)
    assert r.status_code == 200, r.text
    return np.array([item["dense"] for item in r.json()["items"]], dtype=np.float32)


async def _post(conn: HttpConnection, texts: list[str], index: int, t0: float,
                body_timeout_s: float | None, timeout_s: float) -> Answer:
    body: dict[str, Any] = {"items": [texts[index]]}
    if body_timeout_s is not None:
        body["timeout_s"] = body_timeout_s
    started = time.monotonic()
    answer = Answer(index, started - t0, 0.0, 0)
    try:
        # The client's timeout bounds the whole request (connect, send, answer).
        status, headers, raw = await asyncio.wait_for(
            conn.post_json(f"/v1/encode/{MODEL}", json.dumps(body).encode()), timeout_s)
    except TimeoutError:
        answer.error = "ClientTimeout"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:  # refused, reset
        answer.error = type(exc).__name__
    else:
        answer.status = status
        answer.retry_after = headers.get("retry-after")
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {}
        if status == 200 and len(payload["items"]) == 1:  # two: a slice answered twice
            answer.vector = np.asarray(payload["items"][0]["dense"], dtype=np.float32)
        elif status == 200:
            answer.error = f"{len(payload['items'])} items for one text"
        else:
            answer.error = str((payload.get("error") or {}).get("code", ""))
    answer.took = time.monotonic() - started
    return answer


def _connection(url: str) -> HttpConnection:
    parts = urlsplit(url)
    return HttpConnection(parts.hostname or "127.0.0.1", parts.port or 80)


async def closed_loop(url: str, texts: list[str], clients: int, duration_s: float, *,
                      timeout_s: float = 30.0, body_timeout_s: float | None = None,
                      t0: float | None = None, pause_after_error_s: float = 0.2
                      ) -> list[Answer]:
    """``clients`` clients, each on its own connection sending one single-text request
    after another until ``duration_s`` has passed since ``t0`` (default: now); in-flight
    requests finish. A client pauses a moment after an error or a refusal instead of
    spinning on it (no retry: the next request is a new one)."""
    t0 = time.monotonic() if t0 is None else t0
    answers: list[Answer] = []

    async def one_client(c: int) -> None:
        conn, n = _connection(url), c
        try:
            while time.monotonic() - t0 < duration_s:
                answer = await _post(conn, texts, n % len(texts), t0, body_timeout_s,
                                     timeout_s)
                answers.append(answer)
                if answer.status != 200:
                    await asyncio.sleep(pause_after_error_s)
                n += clients
        finally:
            conn.close()

    await asyncio.gather(*(one_client(c) for c in range(clients)))
    return answers


async def burst(url: str, texts: list[str], count: int, concurrency: int, *,
                timeout_s: float, body_timeout_s: float | None = None) -> list[Answer]:
    """``count`` single-text requests from ``concurrency`` clients (one connection each),
    all starting at once."""
    t0 = time.monotonic()
    answers: list[Answer] = []
    todo = iter(range(count))

    async def one_client() -> None:
        conn = _connection(url)
        try:
            for n in todo:
                answers.append(await _post(conn, texts, n % len(texts), t0, body_timeout_s,
                                           timeout_s))
        finally:
            conn.close()

    await asyncio.gather(*(one_client() for _ in range(min(count, concurrency))))
    return answers


async def sdk_closed_loop(url: str, texts: list[str], clients: int, duration_s: float, *,
                          timeout_s: float = 30.0) -> list[Answer]:
    """Like ``closed_loop`` through heron_sdk.AsyncClient, which retries what another
    attempt may fix (connection errors, 429, 503) within ``timeout_s``. status: 200, or 0
    with the exception's name when the SDK gave up."""
    t0 = time.monotonic()
    answers: list[Answer] = []
    # The SDK's own wire (msgpack), retry policy and httpx; its pool sized to the clients
    # (httpx's default of 100 would queue them).
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    http = httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)
    async with AsyncClient(url, timeout=timeout_s, http=http) as sdk:
        async def one_client(c: int) -> None:
            n = c
            while time.monotonic() - t0 < duration_s:
                index = n % len(texts)
                started = time.monotonic()
                answer = Answer(index, started - t0, 0.0, 0)
                try:
                    result = await sdk.encode(MODEL, [texts[index]])
                    answer.status = 200
                    if len(result.items) == 1:  # two: a slice answered twice (wrong())
                        answer.vector = result.dense[0]
                except (HeronError, httpx.HTTPError) as exc:
                    answer.error = type(exc).__name__
                answer.took = time.monotonic() - started
                answers.append(answer)
                n += clients
        await asyncio.gather(*(one_client(c) for c in range(clients)))
    return answers


async def at(delay_s: float, action: Callable[[], Any]) -> float:
    """Run ``action`` ``delay_s`` from now, in a thread (a restart blocks); when it began
    (monotonic)."""
    await asyncio.sleep(delay_s)
    started = time.monotonic()
    await asyncio.to_thread(action)
    return started


# ---- figures ---------------------------------------------------------------------------------
def statuses(answers: list[Answer]) -> dict[int, int]:
    return dict(Counter(a.status for a in answers))


def lost(answers: list[Answer]) -> list[Answer]:
    return [a for a in answers if a.status == 0]


def wrong(answers: list[Answer], ref: np.ndarray) -> list[Answer]:
    """200s whose vector is not the reference's, or that did not hold exactly one item (a
    result applied twice, after a redelivery, would show as two)."""
    return [a for a in answers if a.status == 200 and
            (a.vector is None or not np.allclose(a.vector, ref[a.text], atol=ATOL))]


def non_200(answers: list[Answer]) -> list[Answer]:
    return [a for a in answers if a.status != 200]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def latency(answers: list[Answer]) -> dict[str, float]:
    took = [a.took for a in answers]
    return {"count": len(took), "p50_s": round(percentile(took, 50), 3),
            "p99_s": round(percentile(took, 99), 3),
            "max_s": round(max(took), 3) if took else math.nan}


def ok_rate(answers: list[Answer], start_s: float, end_s: float) -> float:
    """200s finished per second in [start_s, end_s) (seconds since the load began)."""
    if end_s <= start_s:
        return math.nan
    done = sum(1 for a in answers if a.status == 200 and start_s <= a.ended < end_s)
    return round(done / (end_s - start_s), 1)


def rates_around(answers: list[Answer], struck_s: float, end_s: float,
                 window_s: float = 5.0) -> dict[str, float]:
    """200s per second before a fault (from 1 s in: the clients' first connections are
    slow), in the ``window_s`` after it (a JetStream election on loopback takes about 5 s),
    and after that until ``end_s`` (when the load stopped sending)."""
    return {"ok_per_s_before": ok_rate(answers, min(1.0, struck_s / 2), struck_s),
            "ok_per_s_during": ok_rate(answers, struck_s, struck_s + window_s),
            "ok_per_s_after": ok_rate(answers, struck_s + window_s, end_s)}


def summary(answers: list[Answer], ref: np.ndarray | None = None) -> dict[str, Any]:
    """The figures of one run, for assertion messages and the benchmark's JSON."""
    out: dict[str, Any] = {
        "requests": len(answers), "statuses": statuses(answers),
        "lost": len(lost(answers)),
        "errors": dict(Counter(a.error for a in answers if a.status != 200)),
        "longest_s": round(max((a.took for a in answers), default=0.0), 3)}
    if ref is not None:
        out["wrong"] = len(wrong(answers, ref))
    return out
