"""The running ``heron up`` cluster: its children and what happens when one dies.

Start-up, in order, each step only once the one before is up: the nats-server nodes
(listening on their client ports), JetStream (the ``heron_pools`` bucket declared: on a
3-node cluster that takes all three nodes), the config service and the gateway (each
answering ``/healthz``), then the autoscaler and the first workers. A child that does not
come up stops everything started so far, and ``heron up`` exits 1 naming the child and the
last lines of its log. ``--nats URL`` skips the nats-servers: that NATS is used instead.

Afterwards every child that dies on its own is restarted: nats-server nodes, config
service and gateway by heron/cli/children.py (Supervised), workers by the autoscaler. Each
death and restart is printed and published on NATS (``SUPERVISOR_EVENTS``, JSON) for the
gateways' cluster page; after a restart the recent events are published again once the
gateway is ready, since a gateway that was down (or away from NATS) missed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Coroutine
from typing import Any

import httpx
import nats
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError

from heron.cli.autoscaler import Autoscaler, ScalePolicy
from heron.cli.children import (
    ChildProcess,
    ChildSpec,
    StartFailed,
    Supervised,
    http_url,
    indent,
    loopback_for,
    nats_server_binary,
    spawn,
    terminate,
)
from heron.cli.main import usable_cpus
from heron.cli.supervisor import EXITED, RESTARTED, SupervisorEvent, death_cause
from heron.cli.up import CLUSTER_NAME, NatsNode, UpOptions, free_port
from heron.runtime.nats_names import SUPERVISOR_EVENTS, ensure_pools_bucket

log = logging.getLogger("heron.up")

RECENT_EVENTS = 20  # published again after a restart (the cluster page keeps as many)
REPLAY_WAIT_S = 120.0  # for the gateway to be ready again before the recent events go out
REPLAY_DELAY_S = 2.0
NATS_CLOSE_TIMEOUT_S = 5.0
# nats-server's Go threads: one per this many usable CPUs (at least one), unless the
# operator sets GOMAXPROCS. Here nats-server shares the cores with the model; with Go's
# default (a thread per core) its idle threads spin looking for work at every wake-up.
# On 2 cores, null model, 32 clients: nats-server's CPU a request 84 -> 62 us and +4.6%
# requests/s through `heron up` (6 interleaved rounds, 5 of them faster).
CPUS_PER_NATS_THREAD = 4


class UpFailed(Exception):
    """Start-up failed for a reason that is no child's (NATS unreachable, JetStream)."""


class LocalCluster:
    def __init__(self, options: UpOptions, nodes: list[NatsNode]) -> None:
        self.o = options
        self.nodes = nodes
        self.logs = options.data_dir / "logs"
        self.nats_url = options.nats or ",".join(node.url for node in nodes)
        self.config_url = f"http://127.0.0.1:{options.config_port}"
        self.gateway_url = http_url(options.host, options.port)
        self.replicas = options.stream_replicas()
        self.env = dict(os.environ)
        if self.replicas is not None:  # every component declares streams with the same
            self.env["HERON_STREAM_REPLICAS"] = str(self.replicas)
        # Bulk jobs may read and write under the data dir, besides the operator's roots.
        roots = self.env.get("HERON_JOB_ROOTS", "").strip()
        data_dir = str(options.data_dir.resolve())
        self.env["HERON_JOB_ROOTS"] = f"{roots},{data_dir}" if roots else data_dir
        self.services: list[Supervised] = []  # in start order
        self.workers: dict[str, ChildProcess] = {}  # worker_id -> child
        self.recent: deque[SupervisorEvent] = deque(maxlen=RECENT_EVENTS)
        self._last_words: dict[str, str] = {}  # a dead worker's id -> its log's last lines
        self.autoscaler = Autoscaler(self, ScalePolicy(
            pool=options.pool, bundle=options.bundle, min_workers=options.min_workers,
            max_workers=options.max_workers, idle_cooldown_s=options.idle_cooldown_s),
            report=self.report)
        self._autoscaling = False
        self._nc: NatsClient | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per start-up probe

    # ---- start-up ----------------------------------------------------------------------
    async def _start_service(self, spec: ChildSpec) -> None:
        service = Supervised(spec, self.logs, start_timeout_s=self.o.start_timeout_s,
                             report=self.report)
        self.services.append(service)  # before it starts: a Ctrl-C meanwhile stops it too
        await service.start()
        service.supervise()

    def _nats_spec(self, node: NatsNode) -> ChildSpec:
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(node.port), "-js", "-sd",
                str(node.store)]
        if node.route_port is not None:
            peers = ",".join(f"nats://127.0.0.1:{n.route_port}" for n in self.nodes
                             if n is not node)
            argv += ["-n", f"heron-{node.name}", "--cluster_name", CLUSTER_NAME,
                     "--cluster", f"nats://127.0.0.1:{node.route_port}", "--routes", peers]
        return ChildSpec(node.name, argv, node.port, env=self.nats_env())

    def worker_env(self, pool: str) -> dict[str, str]:
        """A worker's environment: its share of the cores (UpOptions.worker_threads), the
        forward passes it runs at once (UpOptions.worker_inference_threads) and, in the
        static pool, what it fetches during them (UpOptions.worker_fetch_lookahead_busy)."""
        env = dict(self.env)
        if self.o.worker_threads:
            env["HERON_THREADS"] = str(self.o.worker_threads)
        if self.o.worker_inference_threads:
            env["HERON_INFERENCE_THREADS"] = str(self.o.worker_inference_threads)
        if pool == self.o.pool and self.o.worker_fetch_lookahead_busy is not None:
            env["HERON_FETCH_LOOKAHEAD_BUSY"] = str(self.o.worker_fetch_lookahead_busy)
        return env

    def nats_env(self) -> dict[str, str]:
        """The nats-servers' environment: GOMAXPROCS set (CPUS_PER_NATS_THREAD) unless the
        operator set it."""
        env = dict(self.env)
        env.setdefault("GOMAXPROCS", str(max(1, usable_cpus() // CPUS_PER_NATS_THREAD)))
        return env

    async def start_nats(self) -> None:
        for node in self.nodes:  # (nats-server makes its store directory)
            await self._start_service(self._nats_spec(node))
        if len(self.nodes) == 1:
            print(f"heron up: nats-server on {self.nats_url} "
                  f"(JetStream store {self.nodes[0].store})", flush=True)
        elif self.nodes:
            print(f"heron up: nats-server cluster {CLUSTER_NAME}, {len(self.nodes)} nodes on "
                  f"{self.nats_url} (JetStream stores {self.o.data_dir}/nats-N, "
                  f"{self.replicas} replicas)", flush=True)

    async def connect_nats(self) -> None:
        """Connect, and wait until JetStream takes a declaration (a cluster's meta leader
        elected and, for 3 replicas, every node there)."""
        deadline = time.monotonic() + self.o.start_timeout_s
        try:
            self._nc = await asyncio.wait_for(nats.connect(
                servers=self.nats_url.split(","), max_reconnect_attempts=-1,
                reconnect_time_wait=0.5, connect_timeout=2, error_cb=_quiet,
                disconnected_cb=_nothing, reconnected_cb=self._on_reconnected,
                name="heron-up"), self.o.start_timeout_s)
        except (TimeoutError, OSError, NatsError) as exc:
            raise UpFailed(f"cannot reach NATS at {self.nats_url}: "
                           f"{exc or 'no answer'}") from None
        if self.o.nats:
            print(f"heron up: using NATS at {self.nats_url}", flush=True)
        js = self._nc.jetstream()
        while True:
            try:
                await ensure_pools_bucket(js, self.replicas)
                return
            except Exception as exc:  # not ready yet ("insufficient resources", timeouts)
                if time.monotonic() > deadline:
                    raise UpFailed(f"JetStream at {self.nats_url} was not ready within "
                                   f"{self.o.start_timeout_s:g} s: {exc}") from None
                await asyncio.sleep(0.25)

    async def start_config(self) -> None:
        port = self.o.config_port
        await self._start_service(ChildSpec("config", [
            sys.executable, "-m", "heron.cli", "config", "--nats", self.nats_url, "--host",
            "127.0.0.1", "--port", str(port), "--store", str(self.o.data_dir / "config"),
            "--log-level", self.o.log_level], port, f"{self.config_url}/healthz", self.env))
        print(f"heron up: config service on {self.config_url} "
              f"(store {self.o.data_dir / 'config'})", flush=True)

    async def start_gateway(self) -> None:
        o = self.o
        await self._start_service(ChildSpec("gateway", [
            sys.executable, "-m", "heron.cli", "gateway", "--nats", self.nats_url, "--host",
            o.host, "--port", str(o.port), "--pool", f"{o.bundle}={o.pool}", "--config",
            self.config_url, "--log-level", o.log_level], o.port, self._gateway_probe("healthz"),
            self.env))
        print(f"heron up: gateway on {self.gateway_url}", flush=True)

    def _gateway_probe(self, path: str) -> str:
        return f"{http_url(loopback_for(self.o.host), self.o.port)}/{path}"

    async def _start(self) -> None:
        await self.start_nats()
        await self.connect_nats()
        assert self._nc is not None
        self._autoscaling = True
        # Demand, heartbeats, the pools bucket, and the first workers, before the config
        # service and the gateway: a worker's start (importing the model stack, loading its
        # models: 5-6 s of a core) overlaps theirs (1.5-2 s each) instead of following it;
        # a worker waits for the config service itself. If the config service or the
        # gateway fails to start, shutdown stops the workers too.
        await self.autoscaler.start(self._nc, self.o.workers, self.replicas)
        await self.start_config()
        await self.start_gateway()

    # ---- workers (heron.cli.autoscaler.Workers) -----------------------------------------
    def alive(self, pool: str) -> list[str]:
        return [w for w, c in self.workers.items()
                if c.pool == pool and c.proc.returncode is None]

    def pools(self) -> set[str]:
        return {c.pool for c in self.workers.values()}

    def reap(self) -> list[tuple[str, str, int]]:
        if self._stopping.is_set():  # (see _on_signal)
            return []
        dead = [(w, c.pool, c.proc.returncode) for w, c in self.workers.items()
                if c.proc.returncode is not None]
        for worker_id, _, status in dead:
            child = self.workers.pop(worker_id)
            self._last_words[worker_id] = death_cause(status, child.log_tail())
        return dead

    async def start_worker(self, pool: str | None = None, bundle: str | None = None) -> str:
        pool, bundle = pool or self.o.pool, bundle or self.o.bundle
        port = free_port()
        worker_id = f"{pool}-{port}"
        child = await spawn(f"worker-{port}", [
            sys.executable, "-m", "heron.cli", "worker", "--nats", self.nats_url, "--pool",
            pool, "--bundle", bundle, "--port", str(port), "--worker-id", worker_id,
            "--config", self.config_url, "--log-level", self.o.log_level], self.logs,
            self.worker_env(pool))
        child.pool = pool
        self.workers[worker_id] = child
        kind = "" if pool == self.o.pool else f" for leased pool {pool}"
        print(f"heron up: worker {worker_id} starting{kind} (http://127.0.0.1:{port})",
              flush=True)
        return worker_id

    def stop_worker(self, worker_id: str) -> Awaitable[None]:
        return self._stop_worker(worker_id, self.workers.pop(worker_id, None))

    async def _stop_worker(self, worker_id: str, child: ChildProcess | None) -> None:
        if child is not None:
            await terminate(child, timeout_s=60)
            print(f"heron up: worker {worker_id} stopped", flush=True)

    # ---- deaths and restarts -------------------------------------------------------------
    def report(self, event: SupervisorEvent) -> None:
        """Print an event, keep it, publish it; after a restart publish the recent ones
        again once the gateway is ready (it may have missed them)."""
        worker_id = event.child.removeprefix("worker ")
        if event.event == EXITED and not event.cause and worker_id in self._last_words:
            event = dataclasses.replace(event, cause=self._last_words[worker_id])
        self._last_words.pop(worker_id, None)
        print(event.console_line(), flush=True)
        if event.event == EXITED and event.cause:
            print(indent(event.cause), flush=True)
        self.recent.append(event)
        self._publish([event])
        if event.event == RESTARTED and event.child in {s.name for s in self.services}:
            self._in_background(self._publish_again_when_ready())

    def _publish(self, events: list[SupervisorEvent]) -> None:
        nc = self._nc
        if nc is None or nc.is_closed or not events:
            return

        async def send() -> None:
            for event in events:  # while NATS is away the client buffers them
                try:
                    await nc.publish(SUPERVISOR_EVENTS, event.to_json())
                except Exception as exc:  # closing; the console has the line anyway
                    log.debug("could not publish %s: %r", event, exc)

        self._in_background(send())

    async def _publish_again_when_ready(self) -> None:
        # Right after a nats-server restart the gateway may not have noticed yet that its
        # connection is gone, and still answers ready: give it a moment to notice.
        await asyncio.sleep(REPLAY_DELAY_S)
        deadline = time.monotonic() + REPLAY_WAIT_S
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self._gateway_probe("readyz"))).status_code == 200:
                        self._publish(list(self.recent))
                        return
                await asyncio.sleep(0.5)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_reconnected(self) -> None:
        if self._nc is not None and self._autoscaling:  # leases may have ended meanwhile
            self._in_background(self.autoscaler.watch_again(self._nc))

    # ---- lifecycle -----------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        starting = loop.create_task(self._start())
        stopping = loop.create_task(self._stopping.wait())
        code = 0
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                failure = starting.exception()
                if failure is not None:
                    code = 1
                    _print_failure(failure)
                else:
                    await stopping
        finally:
            if not starting.done():  # Ctrl-C during start-up
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await starting
            stopping.cancel()
            await self.shutdown()
        return code

    def _on_signal(self) -> None:
        """Ctrl-C reaches the children too (one process group): what exits now is no death
        to report or restart."""
        self._stopping.set()
        for service in self.services:
            service.stop_restarting()

    async def shutdown(self) -> None:
        """Workers first (they drain), then the gateway, the config service, NATS."""
        print("heron up: stopping", flush=True)
        for service in self.services:
            service.stop_restarting()
        await self.autoscaler.stop()  # before the workers go: it would restart them
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), NATS_CLOSE_TIMEOUT_S)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*(self.stop_worker(w) for w in list(self.workers)))
        for service in reversed(self.services):
            await service.stop(timeout_s=20)


def _print_failure(failure: BaseException) -> None:
    if isinstance(failure, StartFailed):
        print(failure.console(), file=sys.stderr, flush=True)
    elif isinstance(failure, UpFailed):
        print(f"heron up: {failure}", file=sys.stderr, flush=True)
    else:
        log.error("heron up: start-up failed", exc_info=failure)


async def _quiet(error: Exception) -> None:
    """NATS errors of heron up's own connection (a restarting nats-server): the restart
    lines say it all; the details go to the debug log."""
    log.debug("NATS: %s", error)


async def _nothing() -> None:
    pass
