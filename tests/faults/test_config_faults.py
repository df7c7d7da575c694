"""The config service killed -9 while admin clients POST model configs, and started again
on its port with the same store (a supervisor's restart): every POST ends acknowledged
(2xx) after the client's retries, every HTTP answer on the way is a 2xx or a clear refusal
(an error code and Retry-After), and every acknowledged config is there after the restart,
each written once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.faults.harness import show
from tests.support import local_http
from tests.support.config_procs import (
    LeaderConfigProcess,
    model_body,
    own_nats,
    wait_status,
    write_bundles,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ADMINS = 4  # concurrent admin clients
POST_DEADLINE_S = 30.0  # how long one admin keeps retrying one POST


@pytest.fixture()
def nats_url(tmp_path: Path) -> Iterator[str]:
    yield from own_nats(tmp_path)


@dataclass
class PostLog:
    """What the admin clients saw."""

    acked: dict[str, float] = field(default_factory=dict)  # model id -> when (monotonic)
    given_up: list[str] = field(default_factory=list)
    answers: Counter = field(default_factory=Counter)  # "201", "503 NOT_LEADER", ...
    unclear: list[str] = field(default_factory=list)  # HTTP answers that are no clear refusal
    no_answer: Counter = field(default_factory=Counter)  # transport errors by name
    longest_s: float = 0.0


async def admin(url: str, headers: dict[str, str], name: str, until: float,
                log: PostLog) -> None:
    """POST new configs one after another until ``until``; each POST is retried (same
    body: the service answers 200 for content already stored) until acknowledged."""
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as client:
        n = 0
        while time.monotonic() < until:
            model_id = f"org/{name}-{n}"
            started = time.monotonic()
            while True:
                try:
                    r = await client.post("/v1/configs/models", json=model_body(model_id))
                except httpx.HTTPError as exc:  # down, or killed while answering
                    log.no_answer[type(exc).__name__] += 1
                    pause = 0.2
                else:
                    code = (r.json().get("error") or {}).get("code", "") \
                        if r.headers.get("content-type", "").startswith("application/json") \
                        else ""
                    log.answers[f"{r.status_code} {code}".strip()] += 1
                    if r.status_code < 300:
                        log.acked[model_id] = time.monotonic()
                        break
                    if not (code and r.headers.get("retry-after")):
                        log.unclear.append(f"{r.status_code} {r.text[:200]}")
                        break
                    pause = min(float(r.headers["retry-after"]), 1.0)
                if time.monotonic() - started > POST_DEADLINE_S:
                    log.given_up.append(model_id)
                    break
                await asyncio.sleep(pause)
            log.longest_s = max(log.longest_s, time.monotonic() - started)
            n += 1


def test_config_service_kill_9_during_admin_posts(nats_url: str, tmp_path: Path) -> None:
    bundles_dir = write_bundles(tmp_path / "bundles")
    service = LeaderConfigProcess(nats_url, tmp_path / "store", bundles_dir, tmp_path,
                                  lease_ttl_s=2.0)
    log = PostLog()
    try:
        wait_status(service.url, 60, leader=True, proc=service.proc)

        def kill_and_restart() -> float:
            service.proc.send_signal(signal.SIGKILL)
            service.proc.wait(10)
            killed = time.monotonic()
            service.restart()  # same port, store and instance id
            return killed

        async def run() -> float:
            until = time.monotonic() + 6.0
            posts = [admin(service.url, service.headers, f"a{i}", until, log)
                     for i in range(ADMINS)]
            await asyncio.sleep(1.5)
            killed = await asyncio.to_thread(kill_and_restart)
            await asyncio.gather(*posts)
            return killed

        killed = asyncio.run(run())
        wait_status(service.url, 30, leader=True, proc=service.proc)
        after_kill = [t for t in log.acked.values() if t > killed]
        figures = {"posts_acked": len(log.acked), "given_up": log.given_up,
                   "answers": dict(log.answers), "no_answer": dict(log.no_answer),
                   "unclear": log.unclear[:5], "longest_post_s": round(log.longest_s, 2),
                   "recovered_after_s": round(min(after_kill) - killed, 2)
                   if after_kill else None}
        export = local_http.get(f"{service.url}/v1/configs/export", headers=service.headers,
                                timeout=10).json()
        missing = [m for m in log.acked if m not in export["models"]]
        figures.update(epoch=export["epoch"], missing=missing)
        show("config_kill_9", figures)
        assert log.acked and after_kill, figures  # POSTs were acknowledged on both sides
        assert not log.unclear, figures
        assert not log.given_up, figures
        assert not missing, figures
        for model_id in log.acked:
            stored = export["models"][model_id]
            assert stored["source"] == {"hub": model_id}, stored
        # Each acknowledged config written once: one epoch per model, no more, no less.
        assert export["epoch"] == len(log.acked), figures
    finally:
        service.stop()
