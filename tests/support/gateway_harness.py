"""What the gateway tests run against: a real gateway (uvicorn on a loopback port, in a
thread) and a fake worker (a thread with its own event loop that pulls work items from the
pool's consumer by the heron.runtime.nats_names names, answers them and beats). The fake computes
answers from the text alone, so tests know what to expect without a model.

The tests here check the gateway's start-up without NATS; the rest are in
test_gateway_api.py and test_gateway_nats.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import uvicorn
import yaml
from nats.js.errors import NotFoundError

from heron.gateway.app import create_app
from heron.gateway.routes import GatewayApp
from heron.gateway.settings import GatewaySettings
from heron.runtime.hot_posts import HOT_POST_HTTP
from heron.runtime.http import HTTP_KEEP_ALIVE_S
from heron.runtime.nats_names import (
    Lane,
    WorkStreamSpec,
    ensure_work_stream,
    lane_consumer,
    status_subject,
    work_stream,
)
from heron.runtime.protocol import WorkerHeartbeat, WorkItemHeaders, WorkResult
from heron_sdk import wire
from tests.support import local_http
from tests.support.servers import REPO, ServerProcess, free_port, wait_until

# ---- bundles: configs only (the fake worker needs no weights) -----------------------------
ADAPTER_OF = {"dense": "dense", "rerank": "cross_encoder", "ner": "token_classifier",
              "sparse": "sparse"}


def write_bundles(root: Path, bundles: dict[str, list[str]]) -> Path:
    """``{"warm": ["dense", "rerank"]}`` -> bundle ``warm`` serving ``warm/dense`` (alias
    ``warm-dense``) and ``warm/rerank``."""
    (root / "models").mkdir(parents=True, exist_ok=True)
    for bundle, kinds in bundles.items():
        files = []
        for kind in kinds:
            name = f"{bundle}-{kind}"
            (root / "models" / f"{name}.yaml").write_text(yaml.safe_dump(
                {"id": f"{bundle}/{kind}", "aliases": [name], "adapter": ADAPTER_OF[kind],
                 "source": {"path": "/nonexistent"}}))
            files.append(f"{name}.yaml")
        (root / f"{bundle}.yaml").write_text(yaml.safe_dump({"name": bundle, "models": files}))
    return root


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ---- a gateway in a thread ----------------------------------------------------------------
class GatewayThread:
    """``heron_http``: uvicorn with Heron's own httptools protocol and no proxy-headers
    middleware, as ``heron gateway`` runs it (heron.runtime.hot_posts); else uvicorn's
    default protocol, as a server Heron does not control would (what falls back to ASGI
    alone is tested that way)."""

    def __init__(self, nats_url: str, pools: dict[str, str], bundles_dir: Path | None = None,
                 settings: GatewaySettings | None = None, heron_http: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(nats_url, pools, bundles_dir=bundles_dir, settings=settings)
        self.gateway: GatewayApp = app.state.gateway
        self.server = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", loop="asyncio",
            http=HOT_POST_HTTP if heron_http else "auto", proxy_headers=not heron_http,
            timeout_keep_alive=HTTP_KEEP_ALIVE_S))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait_ready: bool = True, timeout_s: float = 20) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        path = "/readyz" if wait_ready else "/healthz"
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if local_http.get(self.url + path, timeout=2).status_code == 200:
                    return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"gateway {self.url}{path} not 200 after {timeout_s}s")

    def wait_for_capacity(self, pool: str, timeout_s: float,
                          explain: Callable[[], str] = lambda: "") -> None:
        """Until a worker of ``pool`` has beaten as ready (its first heartbeat); fails the
        test after ``timeout_s``, with ``explain()`` (a worker's log) in the message."""
        deadline = time.monotonic() + timeout_s
        while not self.gateway.health.has_capacity(pool):
            assert time.monotonic() < deadline, \
                f"no worker of pool {pool} beat as ready within {timeout_s:g} s\n{explain()}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


# ---- a real `heron worker` process ----------------------------------------------------------
def start_worker(nats_url: str, pool: str, bundle: Path | str, log_dir: Path,
                 timeout_s: float = 180) -> ServerProcess:
    """``heron worker`` serving ``bundle`` in ``pool``, returned once its /readyz is 200."""
    port = free_port()
    log_path = log_dir / f"worker-{port}.log"
    cmd = [sys.executable, "-m", "heron.cli", "worker", "--nats", nats_url, "--pool", pool,
           "--bundle", str(bundle), "--host", "127.0.0.1", "--port", str(port),
           "--worker-id", f"w-{port}", "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    worker = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    wait_until(worker, "/readyz", timeout_s)
    return worker


# ---- a fake worker in a thread ------------------------------------------------------------
def fake_vector(text: str) -> np.ndarray:
    return np.array([len(text), ord(text[0]) if text else 0], dtype=np.float32)


def fake_score(text: str) -> float:
    return round(1.0 / (1.0 + len(text)), 6)


def fake_answer(task: str, body: dict[str, Any]) -> dict[str, Any]:
    """The worker's response body for one slice, computed from the texts alone. An item
    whose text is "boom" fails the slice like a too-long text with truncate: false; "crash"
    fails it server-side (500, as a worker bug or an item out of deliveries would)."""
    texts = [i if isinstance(i, str) else i["text"] for i in body["items"]]
    ids = [None if isinstance(i, str) else i.get("id") for i in body["items"]]
    if "crash" in texts:
        raise FakeFailure({"code": "INTERNAL", "message": "inference failed: simulated"})
    if "boom" in texts:
        at = texts.index("boom")
        raise FakeFailure({"code": "INPUT_TOO_LONG", "field": f"items[{at}]",
                           "message": f"items[{at}]: longer than the model's 8 tokens"})
    tokens = sum(len(t.split()) + 2 for t in texts)
    if task == "score":
        scores = [fake_score(t) for t in texts]
        order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
        results = [{"index": i, "score": scores[i], "rank": r, **({"id": ids[i]} if ids[i]
                                                                   else {})}
                   for r, i in enumerate(order, start=1)]
        return {"model": "fake", "results": results, "usage": {"tokens": tokens}}
    rows = []
    for text, item_id in zip(texts, ids, strict=True):
        row: dict[str, Any] = ({"dense": fake_vector(text)} if task == "encode" else
                               {"entities": [{"label": "WORD", "text": text.split()[0],
                                              "start": 0, "end": len(text.split()[0]),
                                              "score": 1.0}]})
        row.update(tokens=len(text.split()) + 2, truncated=False)
        if item_id is not None:
            row["id"] = item_id
        rows.append(row)
    return {"model": "fake", "items": rows, "usage": {"tokens": tokens}}


class FakeFailure(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


class FakeWorker:
    """Beats as ready every 0.3 s, reporting ``models`` (model id -> state); with
    ``answer`` it also pulls and answers work, each result published twice when
    ``duplicate`` (as after a redelivery). ``lanes``: the lanes it pulls and names in its
    beats (a worker from before the low lane: first and bulk, and it names none).
    ``seconds_per_item``: how long a work item takes, per item (a model's compute)."""

    def __init__(self, nats_url: str, pool: str, bundle: str, *, answer: bool = True,
                 duplicate: bool = False, models: dict[str, str] | None = None,
                 lanes: tuple[Lane, ...] = tuple(Lane), seconds_per_item: float = 0.0) -> None:
        self.nats_url, self.pool, self.bundle = nats_url, pool, bundle
        self.seconds_per_item = seconds_per_item
        self.answer, self.duplicate = answer, duplicate
        self.models = dict(models or {})
        self.lanes = lanes
        self.worker_id = unique("fake")
        self.seen: list[dict[str, str]] = []  # headers of every work item taken
        self.subjects: list[str] = []  # and its subject
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._stop = asyncio.Event()
        self._task: asyncio.Future[None] | None = None

    def start(self) -> FakeWorker:
        self.thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        if self._task is not None:
            with contextlib.suppress(Exception):
                self._task.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _main(self) -> None:
        nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.2)
        js = nc.jetstream()
        await ensure_work_stream(js, WorkStreamSpec(pool=self.pool))
        beats = asyncio.create_task(self._beat(nc))
        try:
            if self.answer:
                # Its lanes, in order (heron.runtime.nats_names.Lane).
                subs = [await js.pull_subscribe_bind(durable=lane_consumer(self.pool, lane),
                                                     stream=work_stream(self.pool))
                        for lane in self.lanes]
                while not self._stop.is_set():
                    for sub in subs:
                        try:
                            msgs = await sub.fetch(32, timeout=0.1)
                        except (TimeoutError, NotFoundError, nats.errors.Error):
                            continue
                        for msg in msgs:
                            await self._handle(nc, msg)
            else:
                await self._stop.wait()
        finally:
            beats.cancel()
            await nc.close()

    async def _handle(self, nc: Any, msg: Any) -> None:
        headers = dict(msg.headers or {})
        self.seen.append(headers)
        self.subjects.append(msg.subject)
        item = WorkItemHeaders.from_wire(headers)
        if self.seconds_per_item:
            await asyncio.sleep(self.seconds_per_item * item.count)
        try:
            body = fake_answer(item.task, wire.decode(msg.data, wire.MSGPACK))
            result = WorkResult(item.request_id, item.start, item.count, body=body,
                                timings={"queue": 0.001, "inference": 0.002})
        except FakeFailure as failure:
            result = WorkResult(item.request_id, item.start, item.count, error=failure.error)
        payload = wire.encode(result.to_wire(), wire.MSGPACK)
        for _ in range(2 if self.duplicate else 1):
            await nc.publish(item.reply, payload)
        await msg.ack()

    async def _beat(self, nc: Any) -> None:
        while True:
            beat = WorkerHeartbeat(self.worker_id, self.pool, bundle=self.bundle,
                                   models=self.models, ready=True,
                                   lanes=() if Lane.LOW not in self.lanes
                                   else tuple(lane.label for lane in self.lanes))
            with contextlib.suppress(Exception):
                await nc.publish(status_subject(self.pool, self.worker_id),
                                 wire.encode(beat.to_wire(), wire.MSGPACK))
            await asyncio.sleep(0.3)
