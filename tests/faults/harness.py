"""A gateway and its workers for one pool as real processes on a NATS server or cluster,
with the texts the load sends and their reference vectors taken while everything is
healthy: what the fault tests (and bench/faults_bench.py) break and watch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.faults.traffic import Answer, reference, texts_for
from tests.support import local_http
from tests.support.cluster_procs import ChildProcess, GatewayProcess, WorkerProcess


def show(name: str, figures: dict[str, Any]) -> None:
    """A test's figures, one line in its captured output (``pytest -rP`` or ``-s``)."""
    print(f"FIGURES {name} {json.dumps(figures, default=str)}")


def run_with_fault(load: Coroutine[Any, Any, list[Answer]],
                   fault: Coroutine[Any, Any, float]) -> tuple[list[Answer], float]:
    """Run a load (tests.faults.traffic) and a fault (``traffic.at``) together: the answers
    and when the fault struck, in seconds since the load began."""
    async def both() -> tuple[list[Answer], float]:
        t0 = time.monotonic()
        answers, struck = await asyncio.gather(load, fault)
        return answers, struck - t0
    return asyncio.run(both())


def unique_pool() -> str:
    return f"f{uuid.uuid4().hex[:8]}"


def healthy_workers(gateway: GatewayProcess, pool: str) -> int | None:
    """What the gateway's /readyz says of the pool now (None: no answer)."""
    try:
        ready = local_http.get(gateway.url + "/readyz", timeout=2).json()
        return int(ready["pools"][pool]["healthy_workers"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def wait_healthy(gateway: GatewayProcess, pool: str, workers: int,
                 timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy_workers(gateway, pool) == workers:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the gateway never saw {workers} healthy workers in {pool} "
                       f"(last: {healthy_workers(gateway, pool)})")


@dataclass
class Rig:
    """One pool: ``gateway`` routing the default bundle to ``pool``, ``workers`` serving it.
    ``texts``/``ref``: the load's texts and their vectors before any fault."""

    nats_url: str
    pool: str
    gateway: GatewayProcess
    workers: list[WorkerProcess]
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    ref: np.ndarray = field(default_factory=lambda: np.zeros((0, 384), np.float32))

    def live_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.proc.poll() is None]

    def add_worker(self) -> WorkerProcess:
        """One more worker in the pool, ready and seen healthy by the gateway."""
        worker = WorkerProcess(self.nats_url, self.pool, self.log_dir, extra_env=self.env)
        self.workers.append(worker)
        worker.wait_ready()
        wait_healthy(self.gateway, self.pool, len(self.live_workers()))
        return worker

    def workers_metric(self, name: str) -> float:
        """A counter summed over the live workers."""
        return sum(w.metric(name) for w in self.live_workers())

    def items_computed(self) -> float:
        """Items the live workers have computed so far."""
        return self.workers_metric("heron_worker_items_total")

    def logs(self, chars: int = 3000) -> str:
        procs: list[ChildProcess] = [self.gateway, *self.workers]
        return "\n".join(p.log_tail(chars) for p in procs)

    def stop(self) -> None:
        for proc in [self.gateway, *self.workers]:
            with contextlib.suppress(Exception):
                proc.stop()


def start_rig(nats_url: str, log_dir: Path, *, workers: int = 1,
              env: dict[str, str] | None = None, gateway_id: str | None = None,
              tag: str = "fault", texts: int = 256) -> Rig:
    """Start the gateway and ``workers`` workers at once (a worker loads MiniLM in about
    8 s on the 2-core CI machine), wait until all are ready and seen healthy, and take the
    reference vectors. Stops what it started if any of that fails."""
    pool = unique_pool()
    env = dict(env or {})
    gateway = GatewayProcess(nats_url, {"default": pool}, log_dir, extra_env=env,
                             gateway_id=gateway_id)
    rig = Rig(nats_url, pool, gateway,
              [WorkerProcess(nats_url, pool, log_dir, extra_env=env) for _ in range(workers)],
              log_dir, env)
    try:
        with ThreadPoolExecutor(workers + 1) as pool_of_waits:
            for done in [pool_of_waits.submit(p.wait_ready) for p in [gateway, *rig.workers]]:
                done.result()
        wait_healthy(gateway, pool, workers)
        rig.texts = texts_for(tag, texts)
        rig.ref = reference(gateway.url, rig.texts)
    except BaseException:
        rig.stop()
        raise
    return rig
