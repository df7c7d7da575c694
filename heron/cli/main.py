"""The ``heron`` command: ``serve`` (single node), ``up`` (local cluster), ``gateway``,
``worker`` and ``config`` (each part alone, the shape Kubernetes runs), and the client
commands ``encode``, ``score``, ``extract`` and ``models`` (heron/cli/client.py) and
``jobs`` (bulk jobs: heron/cli/jobs.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from heron import __version__
from heron.cli.catalog import add_catalog_flags
from heron.cli.client import add_client_commands
from heron.cli.jobs import add_jobs_command
from heron.cli.up import add_up_parser
from heron.runtime import heap, transformers_scan
from heron.runtime.modelconfig import Bundle, ConfigError, load_bundle, load_model_config

# Before anything imports transformers: its model-folder scan is read from disk (about 1 s
# of a worker's start; heron/runtime/transformers_scan.py). Every server process imports
# this module first, `serve --workers N`'s children too.
transformers_scan.install()

if TYPE_CHECKING:
    from heron.runtime.settings import Settings
    from heron.worker.app import QueueMode
    from heron.worker.cpus import CpuPlacement


def _select_models(bundle: Bundle, models: str | None) -> Bundle:
    """``--models a,b.yaml``: serve only the named bundle models, plus any config files."""
    if not models:
        return bundle
    chosen, names = [], {n: m for m in bundle.models for n in (m.id, *m.aliases)}
    for spec in (s.strip() for s in models.split(",") if s.strip()):
        if spec.endswith((".yaml", ".yml")):
            chosen.append(load_model_config(Path(spec)))
        elif spec in names:
            chosen.append(names[spec])
        else:
            raise ConfigError("--models", spec,
                              f"not in bundle {bundle.name}; known: {sorted(names)}")
    unique = {m.id: m for m in chosen}  # the same model named twice is served once
    return dataclasses.replace(bundle, models=tuple(unique.values()), preload=None)


def _uvicorn_options(args: argparse.Namespace) -> dict[str, object]:
    from heron.runtime.http import HTTP_KEEP_ALIVE_S
    from heron.runtime.logs import uvicorn_log_config
    from heron.runtime.received import RECEIVED_AT_HTTP

    return {"host": args.host, "port": args.port, "log_level": args.log_level,
            "access_log": args.access_log, "loop": "uvloop", "http": RECEIVED_AT_HTTP,
            "timeout_graceful_shutdown": 30, "timeout_keep_alive": HTTP_KEEP_ALIVE_S,
            "log_config": uvicorn_log_config()}


def _build_worker_app(args: argparse.Namespace, queue: QueueMode | None) -> object:
    # A fast tokenizer given several texts spreads them over a thread per CPU (rayon), which
    # spins against the inference thread: a worker tokenizes coalesced work items of 5-15
    # texts, and MiniLM through `heron up` served 284 -> 315 requests/s (32 clients, 2 cores)
    # with it off. Heron's own threads are the parallelism; an explicit setting still wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from heron.runtime.telemetry import setup_tracing
    from heron.worker.app import create_app

    setup_tracing("heron-worker")  # HERON_TRACING; in every `serve --workers N` process
    passes = inference_threads(args.inference_threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif passes > 1:  # the usable CPUs split between the passes, not a team each of all
        torch.set_num_threads(threads_per_process(passes))
    bundle = _select_models(load_bundle(args.bundle), args.models)
    placement = _cpu_placement(args.inference_cpus, torch.get_num_threads() * passes)
    return create_app(bundle, device=None if args.device == "auto" else args.device,
                      precision=None if args.precision == "profile" else args.precision,
                      queue=queue,
                      inference_cpus=placement.inference if placement else None,
                      inference_threads=passes)


def inference_threads(value: object) -> int:
    """``--inference-threads``: a number >= 1 (ConfigError otherwise)."""
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError("--inference-threads", str(value), "expected a number >= 1")
    return int(text)


def _cpu_placement(setting: str, threads: int) -> CpuPlacement | None:
    """--inference-cpus: move this process's threads off the model's CPUs now; the
    inference thread pins itself to them when it starts (see worker.cpus)."""
    from heron.worker.cpus import apply_to_process, placement_requested, plan_placement

    if not hasattr(os, "sched_setaffinity"):
        if placement_requested(setting):
            logging.getLogger("heron.worker").warning(
                "--inference-cpus needs Linux CPU affinity; ignored here")
        return None
    try:
        placement = plan_placement(setting, threads, os.sched_getaffinity(0))
        if placement is not None:
            apply_to_process(placement)
    except ValueError as exc:
        raise ConfigError("--inference-cpus", setting, str(exc)) from None
    return placement


def _run_worker(args: argparse.Namespace, queue: QueueMode | None) -> int:
    import uvicorn

    uvicorn.run(_build_worker_app(args, queue), **_uvicorn_options(args))
    return 0


def _exit_0_on_stop_signals() -> None:
    """uvicorn drains on SIGTERM/SIGINT, then raises the signal again under the handler it
    found at start-up (Python's: death by SIGTERM, exit status -15, or a KeyboardInterrupt
    traceback). Under this one the server exits 0 after its drain, and at once before
    uvicorn runs."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def cmd_serve(args: argparse.Namespace) -> int:
    _exit_0_on_stop_signals()
    from heron.worker.settings import WorkerSettings

    # A bad value stops here (exit 2); every process reads them from the environment.
    WorkerSettings.from_args(args).export_env()
    # And a bad bundle, --models or --inference-cpus: before torch and the model stack are
    # imported (5-6 s of CPU on 2 cores), a socket bound or a process started.
    _check_start_config(args)
    processes = serve_processes(args.workers, args.device)
    if processes == 1:
        return _run_worker(args, None)
    import tempfile

    import uvicorn

    args.threads = args.threads or threads_per_process(
        processes * inference_threads(args.inference_threads))
    log = logging.getLogger("heron.serve")
    from heron.worker.cpus import placement_requested

    if placement_requested(args.inference_cpus):
        # Every process would pin its model to the same CPUs.
        log.warning("--inference-cpus applies to one-process workers; ignored with %d "
                    "processes", processes)
        args.inference_cpus = "off"
    with tempfile.TemporaryDirectory(prefix="heron-metrics-") as metrics_dir:
        # Inherited by the processes uvicorn spawns: their arguments and shared metrics.
        os.environ[_SERVE_ARGS_ENV] = json.dumps(vars(args), default=str)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        log.info("serving with %d processes of %d torch threads each", processes,
                 args.threads)
        from heron.cli.processes import run_processes

        # A listening socket per process (heron.cli.processes): connections spread evenly.
        # A process that dies while starting stops them all: exit 1, not a restart loop.
        return run_processes(uvicorn.Config("heron.cli.main:serve_app_from_env",
                                            factory=True, workers=processes,
                                            **_uvicorn_options(args)))


_SERVE_ARGS_ENV = "HERON_SERVE_ARGS"


def _check_start_config(args: argparse.Namespace, *, bundle: bool = True) -> None:
    """What a ``serve`` or ``worker`` process would refuse at start-up, refused first and
    once (in the parent of ``serve --workers N``), before the model stack is imported
    (ConfigError: exit 2 with one line): the bundle and ``--models`` (``bundle``: not for a
    worker whose bundle comes from the config service), ``--inference-cpus``,
    ``--inference-threads``, ``HERON_TRACING``."""
    from heron.runtime.telemetry import tracing_mode
    from heron.worker.cpus import AUTO, format_cpu_list, parse_cpu_list, placement_requested

    if bundle:
        _select_models(load_bundle(args.bundle), args.models)
    tracing_mode()
    inference_threads(args.inference_threads)
    setting = args.inference_cpus.strip().lower()
    if not placement_requested(setting) or setting == AUTO:
        return  # auto picks from the usable CPUs: nothing to refuse
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        inference = parse_cpu_list(setting)
    except ValueError as exc:
        raise ConfigError("--inference-cpus", args.inference_cpus, str(exc)) from None
    if allowed and not inference <= allowed:
        raise ConfigError("--inference-cpus", args.inference_cpus,
                          f"CPUs {format_cpu_list(inference)} are not usable by "
                          "this process (outside its CPU affinity)")


def serve_app_from_env() -> object:
    """The app of one ``heron serve --workers N`` process (uvicorn imports this). A config
    error (checked in the parent already) exits with uvicorn's start-up failure status 3,
    one line, no traceback."""
    args = argparse.Namespace(**json.loads(os.environ[_SERVE_ARGS_ENV]))
    heap.freeze_at_exit()
    configure_logs(args)
    try:
        return _build_worker_app(args, None)
    except ConfigError as exc:
        print(f"heron: config error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None  # uvicorn.config.STARTUP_FAILURE


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def threads_per_process(processes: int) -> int:
    """Torch threads each of ``processes`` server processes gets: the usable CPUs split."""
    return max(1, usable_cpus() // processes)


def serve_processes(workers: str, device: str) -> int:
    """``--workers``: a number, or ``auto``. On CPU, auto runs one process per usable CPU,
    at most 4, splitting the cores between them: two single-thread processes served
    MiniLM at 407 items/s on the CI machine's 2 cores, one process with 2 threads 304/s
    (the event loop and the model's OpenMP team stop competing for the same cores). On
    CUDA, auto is 1: the GPU is the shared resource."""
    if workers != "auto":
        if not workers.isdigit() or int(workers) < 1:
            raise SystemExit(f"heron serve: --workers {workers!r}: a number >= 1, or auto")
        return int(workers)
    if device == "cuda":
        return 1
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return 1
    return min(usable_cpus(), 4)


def cmd_worker(args: argparse.Namespace) -> int:
    _exit_0_on_stop_signals()
    from heron.worker.settings import WorkerSettings

    # Checked before anything loads; the parts of the worker read them from the environment.
    settings = WorkerSettings.from_args(args)
    settings.export_env()
    _check_start_config(args, bundle=args.config is None)
    _log_settings("heron.worker", settings)
    from heron.worker.app import QueueMode

    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    queue = QueueMode(nats_url=args.nats, pool=args.pool or args.bundle, worker_id=worker_id,
                      address=f"http://{args.host}:{args.port}", config_url=args.config)
    return _run_worker(args, queue)


def cmd_gateway(args: argparse.Namespace) -> int:
    _exit_0_on_stop_signals()
    from heron.gateway.settings import GatewaySettings

    settings = GatewaySettings.from_args(args)  # a bad value: exit 2 before anything starts
    settings.export_env()  # HERON_STREAM_REPLICAS for the DLQ and the pools bucket
    _log_settings("heron.gateway", settings)
    from heron.gateway.app import parse_pool_pairs, run
    from heron.runtime.telemetry import setup_tracing

    setup_tracing("heron-gateway")  # HERON_TRACING
    run(args.nats, parse_pool_pairs(args.pool or []), host=args.host, port=args.port,
        log_level=args.log_level, access_log=args.access_log, gateway_id=args.gateway_id,
        config_url=args.config, settings=settings)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    _exit_0_on_stop_signals()
    from heron.config_service.settings import ConfigServiceSettings

    settings = ConfigServiceSettings.from_args(args)
    settings.export_env()  # HERON_STREAM_REPLICAS for HERON_CONFIG and the lease bucket
    _log_settings("heron.config", settings)
    from heron.config_service.app import run

    run(args.nats, args.store, host=args.host, port=args.port, log_level=args.log_level,
        instance_id=args.instance_id, settings=settings,
        bundles_dir=Path(args.bundles_dir) if args.bundles_dir else None,
        allow_remote_code=args.allow_remote_code)
    return 0


def _log_settings(logger: str, settings: Settings) -> None:
    """One start-up line with the settings that differ from their defaults."""
    changed = ", ".join(f"{name}={value}" for name, value in settings.changed())
    logging.getLogger(logger).info("settings: %s", changed or "defaults")


def cmd_up(args: argparse.Namespace) -> int:
    from heron.cli.up import run_up

    return run_up(args)  # ports checked free, then the cluster supervised until Ctrl-C


def _add_worker_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default=os.environ.get("HERON_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int,
                        default=int(os.environ.get("HERON_PORT", str(default_port))))
    parser.add_argument("--bundle", default=os.environ.get("HERON_BUNDLE", "default"),
                        help="bundle name under bundles/ or a path to a bundle YAML")
    parser.add_argument("--models", default=None,
                        help="comma-separated model ids/aliases of the bundle to serve, "
                             "and/or model config YAML paths to add")
    parser.add_argument("--device", default=os.environ.get("HERON_DEVICE", "auto"),
                        choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default=os.environ.get("HERON_PRECISION", "profile"),
                        choices=["profile", "auto", "fp32", "bf16", "fp16"],
                        help="override every model's profile precision (default: each "
                             "profile's own; auto = fp16 on CUDA, bf16 on CPUs with native "
                             "bf16, else fp32)")
    parser.add_argument("--threads", type=int,
                        default=int(os.environ.get("HERON_THREADS", "0")),
                        help="torch intra-op threads a forward pass (0: torch's default, one "
                             "per core; with several serve --workers or --inference-threads, "
                             "the usable CPUs split between the passes)")
    parser.add_argument("--inference-threads",
                        default=os.environ.get("HERON_INFERENCE_THREADS", "1"),
                        help="CPU forward passes that may run at once, each on its own thread "
                             "with --threads torch threads (default 1; heron up runs one "
                             "worker with one single-thread pass per usable CPU)")
    parser.add_argument("--inference-cpus",
                        default=os.environ.get("HERON_INFERENCE_CPUS", "off"),
                        help="CPUs for the inference thread, the rest of the worker on the "
                             "others: off (default), auto (the first --threads usable CPUs, "
                             "when there are more), or a list such as 0-3 (only where the "
                             "CPUs are the worker's own; see docs/operations.md)")
    parser.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    parser.add_argument("--access-log", action="store_true")


def _add_nats_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=os.environ.get("HERON_NATS_URL",
                                                         "nats://127.0.0.1:4222"),
                        help="NATS server URL, or several comma-separated (the nodes of a "
                             "cluster; heron.runtime.nats_link fails over between them)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heron", description=__doc__)
    parser.add_argument("--version", action="version", version=f"heron {__version__}",
                        help="print the version (GET /info on every server reports it too)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="single-node server: one worker with its HTTP API")
    _add_worker_args(serve, 8080)
    serve.add_argument("--workers", default=os.environ.get("HERON_WORKERS", "auto"),
                       help="server processes behind the port, each with its own copy of "
                            "the models (auto: one per CPU up to 4 on CPU, 1 on CUDA)")
    from heron.worker.settings import WorkerSettings

    WorkerSettings.add_flags(serve)  # the worker's limits (queue-mode ones do nothing here)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="cluster worker: pulls its pool's work from NATS "
                                           "JetStream (and serves its own HTTP API)")
    _add_worker_args(worker, 8081)
    _add_nats_argument(worker)
    worker.add_argument("--pool", default=os.environ.get("HERON_POOL"),
                        help="pool name (default: the bundle's name)")
    worker.add_argument("--worker-id", default=os.environ.get("HERON_WORKER_ID"))
    worker.add_argument("--config", default=os.environ.get("HERON_CONFIG_URL"),
                        help="config service URL: follow it and serve models added live")
    from heron.worker.settings import WorkerSettings

    WorkerSettings.add_flags(worker)
    worker.set_defaults(func=cmd_worker)

    gateway = sub.add_parser("gateway", help="stateless HTTP edge: routes work to pools "
                                             "over NATS JetStream")
    gateway.add_argument("--host", default=os.environ.get("HERON_HOST", "127.0.0.1"))
    gateway.add_argument("--port", type=int, default=int(os.environ.get("HERON_PORT", "8080")))
    _add_nats_argument(gateway)
    gateway.add_argument("--pool", action="append", metavar="BUNDLE=POOL",
                         help="a bundle and the pool that serves it (repeatable; default: "
                              "default=default)")
    gateway.add_argument("--gateway-id", default=os.environ.get("HERON_GATEWAY_ID"))
    gateway.add_argument("--config", default=os.environ.get("HERON_CONFIG_URL"),
                         help="config service URL: take models from it and follow it")
    gateway.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    gateway.add_argument("--access-log", action="store_true")
    from heron.gateway.settings import GatewaySettings

    GatewaySettings.add_flags(gateway)
    gateway.set_defaults(func=cmd_gateway)

    config = sub.add_parser("config", help="the single-writer config service (model configs, "
                                           "epochs, deltas over JetStream)")
    config.add_argument("--host", default=os.environ.get("HERON_HOST", "127.0.0.1"))
    config.add_argument("--port", type=int, default=int(os.environ.get("HERON_PORT", "8090")))
    _add_nats_argument(config)
    config.add_argument("--store", default=os.environ.get("HERON_CONFIG_STORE",
                                                          ".heron/config"),
                        help="a directory, or s3://bucket/prefix")
    config.add_argument("--instance-id", default=os.environ.get("HERON_CONFIG_INSTANCE_ID"))
    config.add_argument("--bundles-dir", default=None,
                        help="epoch 0's bundles (default: HERON_BUNDLES_DIR or bundles/)")
    config.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    config.add_argument("--allow-remote-code", action="store_true",
                        help="accept models with trust_remote_code: true, whose checkpoint's "
                             "code runs in every worker (also HERON_ALLOW_REMOTE_CODE=1)")
    from heron.config_service.settings import ConfigServiceSettings

    ConfigServiceSettings.add_flags(config)  # --lease-ttl-s (--lease-ttl), ...
    config.set_defaults(func=cmd_config)

    add_up_parser(sub, cmd_up)  # heron/cli/up.py
    add_client_commands(sub)
    add_jobs_command(sub)  # heron/cli/jobs.py
    add_catalog_flags(sub.choices["models"])  # heron models --catalog
    return parser


# What `pip install '.[worker]'` adds (pyproject.toml), by import name.
_MODEL_STACK = ("torch", "transformers", "tokenizers", "sentencepiece", "safetensors",
                "huggingface_hub")
# The services' logs are read by machines (JSON); what people run in a terminal, as text.
_JSON_LOG_COMMANDS = ("gateway", "worker", "config")


def configure_logs(args: argparse.Namespace) -> None:
    """Level from --log-level (HERON_LOG_LEVEL), format from HERON_LOG_FORMAT (json for
    gateway, worker and config; text for serve, up and the client commands)."""
    from heron.runtime.logs import configure_logging, log_format

    command = getattr(args, "command", "")
    fields: dict[str, str] = {}
    if command == "worker":  # decided here so that every line of the process names it
        args.worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        fields = {"worker_id": args.worker_id, "pool": args.pool or args.bundle}
    configure_logging(getattr(args, "log_level", "warning"),
                      log_format("json" if command in _JSON_LOG_COMMANDS else "text"),
                      **fields)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    heap.freeze_at_exit()
    try:
        configure_logs(args)
        return args.func(args)
    except ConfigError as exc:
        print(f"heron: config error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # `heron serve` and `heron worker` where only the server's base is installed (the
        # control image): say which extra brings the model stack, not a traceback.
        if (exc.name or "").split(".")[0] not in _MODEL_STACK:
            raise
        command = getattr(args, "command", "")
        print(f"heron {command}: {exc.name} is not installed; models need the worker extra: "
              "pip install torch==2.13.0 && pip install ./sdk '.[worker]' (docs/layout.md)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
