"""The ``heron`` command: ``serve`` (single node), ``worker`` (cluster worker); ``up``,
``gateway`` and ``config`` arrive with the cluster issues."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path

from sdk.modelconfig import Bundle, ConfigError, load_bundle, load_model_config


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


def _run_worker(args: argparse.Namespace, queue: object | None) -> int:
    import torch
    import uvicorn

    from worker.app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = _select_models(load_bundle(args.bundle), args.models)
    app = create_app(bundle, device=None if args.device == "auto" else args.device,
                     queue=queue)  # type: ignore[arg-type]
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.access_log, loop="uvloop", http="httptools",
                timeout_graceful_shutdown=30)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return _run_worker(args, None)


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.app import QueueMode

    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    queue = QueueMode(nats_url=args.nats, pool=args.pool or args.bundle, worker_id=worker_id,
                      address=f"http://{args.host}:{args.port}")
    return _run_worker(args, queue)


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
    parser.add_argument("--threads", type=int,
                        default=int(os.environ.get("HERON_THREADS", "0")),
                        help="torch intra-op threads (0: torch's default, one per core)")
    parser.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    parser.add_argument("--access-log", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heron", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="single-node server: one worker with its HTTP API")
    _add_worker_args(serve, 8080)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="cluster worker: pulls its pool's work from NATS "
                                           "JetStream (and serves its own HTTP API)")
    _add_worker_args(worker, 8081)
    worker.add_argument("--nats", default=os.environ.get("HERON_NATS_URL",
                                                         "nats://127.0.0.1:4222"))
    worker.add_argument("--pool", default=os.environ.get("HERON_POOL"),
                        help="pool name (default: the bundle's name)")
    worker.add_argument("--worker-id", default=os.environ.get("HERON_WORKER_ID"))
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper() if hasattr(args, "log_level") else "INFO",
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"heron: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
