"""The ``heron`` command. ``heron serve`` runs the single-node server; ``up``, ``gateway``,
``worker`` and ``config`` arrive with the cluster issues."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
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


def cmd_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from worker.app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = _select_models(load_bundle(args.bundle), args.models)
    app = create_app(bundle, device=None if args.device == "auto" else args.device)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.access_log, loop="uvloop", http="httptools")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heron", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="single-node server: one worker with its HTTP API")
    serve.add_argument("--host", default=os.environ.get("HERON_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("HERON_PORT", "8080")))
    serve.add_argument("--bundle", default=os.environ.get("HERON_BUNDLE", "default"),
                       help="bundle name under bundles/ or a path to a bundle YAML")
    serve.add_argument("--models", default=None,
                       help="comma-separated model ids/aliases of the bundle to serve, "
                            "and/or model config YAML paths to add")
    serve.add_argument("--device", default=os.environ.get("HERON_DEVICE", "auto"),
                       choices=["auto", "cpu", "cuda"])
    serve.add_argument("--threads", type=int, default=int(os.environ.get("HERON_THREADS", "0")),
                       help="torch intra-op threads (0: torch's default, one per core)")
    serve.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    serve.add_argument("--access-log", action="store_true")
    serve.set_defaults(func=cmd_serve)
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
