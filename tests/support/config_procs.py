"""Helpers for the config service tests (no tests here): a bundles dir, the service run
in-process (uvicorn in a thread) or as a ``python -m heron.config_service`` child, a moto S3
server on loopback, and reading deltas back from JetStream."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import uvicorn
import yaml
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from heron.config_service.app import create_app
from heron.runtime.http import HTTP_KEEP_ALIVE_S
from heron.runtime.nats_names import CONFIG_STREAM
from heron_sdk import wire
from tests.support import local_http
from tests.support.cluster_procs import ChildProcess
from tests.support.nats_server import NatsServer
from tests.support.servers import free_port

ADMIN = "s3cret-admin"


def write_bundles(root: Path) -> Path:
    """alpha (dense, sparse) with base/dense; beta (dense) with base/beta; sparsebox
    (sparse) with base/sparse. Sources are hub ids: the config service loads no weights."""
    (root / "models").mkdir(parents=True)
    models = {"dense": ("base/dense", "dense"), "beta": ("base/beta", "dense"),
              "sparse": ("base/sparse", "sparse")}
    for name, (model_id, adapter) in models.items():
        (root / "models" / f"{name}.yaml").write_text(yaml.safe_dump(
            {"id": model_id, "adapter": adapter, "source": {"hub": model_id}}))
    bundles = {"alpha": (["dense", "sparse"], ["dense.yaml"]),
               "beta": (["dense"], ["beta.yaml"]),
               "sparsebox": (["sparse"], ["sparse.yaml"])}
    for name, (adapters, files) in bundles.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump(
            {"name": name, "adapters": adapters, "models": files}))
    return root


def model_body(model_id: str = "org/new-dense", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": model_id, "adapter": "dense",
                            "source": {"hub": model_id},
                            "profiles": {"default": {"max_batch_tokens": 4096}}}
    body.update(extra)
    return body


# A stop waits for store calls in flight: at most two S3 tries of 5 s to connect and 10 s to
# read (config_service/blobs.py), and the NATS link's bounded close.
STOP_TIMEOUT_S = 45


class InProcessConfig:
    """create_app served by uvicorn in a thread on a free loopback port.

    It shares the test's GIL: a test that generates cases (hypothesis) can stall its
    renewals for over a second on a loaded 2-core machine, and a 2 s lease lapsed that way
    in CI (a POST got 503 NOT_LEADER). Tests that only use the service, on a NATS of their
    own, pass ``LONG_LEASE_S``."""

    def __init__(self, nats_url: str, store: str | Path, bundles_dir: Path, *,
                 admin_token: str | None = ADMIN, lease_ttl_s: float = 2.0,
                 instance_id: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(nats_url, store, bundles_dir=bundles_dir,
                              admin_token=admin_token, instance_id=instance_id,
                              lease_ttl_s=lease_ttl_s)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on",
                                                    timeout_keep_alive=HTTP_KEEP_ALIVE_S))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    def start(self, *, leader: bool = True, timeout_s: float = 20) -> InProcessConfig:
        self.thread.start()
        wait_status(self.url, timeout_s, leader=leader)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)
        if self.thread.is_alive():  # say where it hangs
            frame = sys._current_frames().get(self.thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            raise AssertionError(f"the config service did not stop in {STOP_TIMEOUT_S} s; "
                                 f"its thread is at:\n{stack}")

    def post(self, body: Any, *, content_type: str = "application/json",
             headers: dict[str, str] | None = None) -> httpx.Response:
        data = body if isinstance(body, bytes) else wire.encode(body, wire.JSON)
        return local_http.post(f"{self.url}/v1/configs/models", content=data, timeout=30,
                               headers={"Content-Type": content_type, **self.headers,
                                        **(headers or {})})

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", self.headers)
        return local_http.get(f"{self.url}{path}", timeout=30, **kwargs)


LONG_LEASE_S = 30.0


def wait_status(url: str, timeout_s: float, *, leader: bool | None = None,
                proc: subprocess.Popen | None = None) -> dict[str, Any]:
    """Until /readyz is 200 (and, if asked, the instance is or is not the writer)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None:
            assert proc.poll() is None, "the config service exited"
        try:
            r = local_http.get(f"{url}/readyz", timeout=2)
            last = r.text
            if r.status_code == 200 and (leader is None or r.json()["leader"] is leader):
                return r.json()
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready (leader={leader}): {last}")


class LeaderConfigProcess(ChildProcess):
    """The config service as a child process (so a test can kill -9 it), with the admin
    token set."""

    def __init__(self, nats_url: str, store: str | Path, bundles_dir: Path, log_dir: Path,
                 *, lease_ttl_s: float = 2.0, env: dict[str, str] | None = None) -> None:
        port = free_port()
        super().__init__("config", ["--nats", nats_url, "--store", str(store),
                                    "--bundles-dir", str(bundles_dir), "--lease-ttl",
                                    str(lease_ttl_s), "--log-level", "info",
                                    "--instance-id", f"config-{port}"],
                         log_dir, {"HERON_ADMIN_TOKEN": ADMIN, **(env or {})}, port=port)
        self.headers = {"Authorization": f"Bearer {ADMIN}"}

    def status(self) -> dict[str, Any]:
        return local_http.get(f"{self.url}/readyz", timeout=2).json()

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return local_http.post(f"{self.url}/v1/configs/models", json=body, headers=self.headers,
                               timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def own_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server of the test's own (for a fixture): the lease, the stream and the
    Nats-Msg-Id de-duplication window are per server, so config tests must not share one."""
    server = NatsServer(tmp_path / "nats").start()
    yield server.url
    server.stop()


def read_deltas(url: str, subject: str, *, expect: int | None = None,
                timeout_s: float = 10) -> list[tuple[dict[str, str], dict[str, Any]]]:
    """Every message HERON_CONFIG holds on ``subject``: (headers, decoded delta)."""

    async def fetch() -> list[tuple[dict[str, str], dict[str, Any]]]:
        nc = await nats.connect(url)
        out: list[tuple[dict[str, str], dict[str, Any]]] = []
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + timeout_s
            while True:
                out.clear()
                try:
                    sub = await js.pull_subscribe(
                        subject, stream=CONFIG_STREAM,
                        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
                    msgs = await _drain(sub)
                    await sub.unsubscribe()
                except NotFoundError:
                    msgs = []
                out.extend((dict(m.headers or {}), wire.decode(m.data, wire.MSGPACK))
                           for m in msgs)
                if expect is None or len(out) >= expect or time.monotonic() > deadline:
                    return out
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    return asyncio.run(fetch())


async def _drain(sub: Any) -> list[Any]:
    msgs: list[Any] = []
    while True:
        try:
            batch = await sub.fetch(100, timeout=0.3)
        except TimeoutError:
            return msgs
        msgs.extend(batch)
        for m in batch:
            await m.ack()


class MotoS3:
    """moto's S3 server on a free loopback port (real HTTP; boto3 talks to it)."""

    def __init__(self, log_dir: Path) -> None:
        binary = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"moto-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                local_http.get(self.url, timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError(self.log_path.read_text())

    def weights_env(self, bucket: str, prefix: str = "w") -> dict[str, str]:
        """The environment of a process whose weight cache's S3 tier is ``bucket`` here
        (created, empty if new): moto's credentials, one attempt a call."""
        import boto3  # only the S3 tests pay for its import

        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1"
                     ).create_bucket(Bucket=bucket)
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_MAX_ATTEMPTS": "1", "HERON_WEIGHTS_S3": f"s3://{bucket}/{prefix}",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
