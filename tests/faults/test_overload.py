"""Ten times more work than a worker can finish within the requests' deadline: a gateway
and one worker, requests with ``timeout_s: 5``. Admission by deadline: each request is
either answered 200 within its deadline or refused at once (429/503 with Retry-After),
none times out (no 504, no client timeout), and service is whole right after."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.faults.harness import Rig, show
from tests.faults.traffic import (
    burst,
    closed_loop,
    latency,
    long_texts_for,
    lost,
    ok_rate,
    reference,
    summary,
    wrong,
)
from tests.support import local_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

DEADLINE_S = 5.0  # timeout_s in every request's body
SLACK_S = 1.0  # a 200 may arrive this much after its deadline (the client's own loop, 2 cores)
REFUSAL_P99_S = 1.0  # a refusal is fast: p99 of its latency at the client
CONCURRENCY = 400
OVERLOAD = 10
# Texts of about 200 tokens: the worker finished 20-50 of them per second at 64-400
# clients here (against a few hundred short ones), so 10x its 5 s of work is a few
# thousand requests. MAX_SENT bounds the test's time: on a faster machine the overload is
# less than 10x, and the figures say how much.
MIN_SENT, MAX_SENT = 300, 4000


def test_ten_times_overload_is_refused_fast(healthy_rig: Rig) -> None:
    rig = healthy_rig
    texts = long_texts_for("overload")
    ref = reference(rig.gateway.url, texts)
    # What the worker finishes per second with enough clients to fill its batches, with a
    # deadline long enough that admission takes them all (128 x 200 tokens: a few seconds).
    measured = asyncio.run(closed_loop(rig.gateway.url, texts, clients=128, duration_s=5.0,
                                       timeout_s=30, body_timeout_s=30))
    capacity = ok_rate(measured, 1.0, 5.0)
    assert capacity > 0, summary(measured)
    count = min(MAX_SENT, max(MIN_SENT, math.ceil(OVERLOAD * capacity * DEADLINE_S)))
    answers = asyncio.run(burst(rig.gateway.url, texts, count, CONCURRENCY,
                                timeout_s=2 * DEADLINE_S, body_timeout_s=DEADLINE_S))
    ok = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status in (429, 503)]
    late = [a for a in ok if a.took > DEADLINE_S + SLACK_S]
    after = local_http.post(f"{rig.gateway.url}/v1/encode/minilm",
                            json={"items": ["right after"], "timeout_s": DEADLINE_S}, timeout=30)
    figures = {**summary(answers, ref), "capacity_per_s": capacity, "sent": count,
               "overload": round(count / (capacity * DEADLINE_S), 1),
               "concurrency": CONCURRENCY, "ok_latency": latency(ok),
               "refusal_latency": latency(refused), "late_200s": len(late),
               "refusals_without_retry_after": sum(not a.retry_after for a in refused),
               "after": after.status_code}
    show("overload_10x", figures)
    assert not lost(answers), figures  # no client timeout, no dropped connection
    assert set(figures["statuses"]) <= {200, 429, 503}, figures  # no 504, no 500
    assert not late, figures
    assert not wrong(answers, ref), figures
    assert all(a.retry_after for a in refused), figures
    assert not refused or figures["refusal_latency"]["p99_s"] < REFUSAL_P99_S, figures
    # The worker stayed busy: at least one second of its capacity was served.
    assert len(ok) >= capacity, figures
    assert after.status_code == 200, after.text
