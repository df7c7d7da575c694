"""``python -m heron.config_service``: the same as ``heron config`` (tests start it this way)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from heron.config_service.app import DEFAULT_PORT, run
from heron.config_service.settings import ConfigServiceSettings
from heron.runtime.modelconfig import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m heron.config_service",
                                description="Heron config service (single writer)")
    p.add_argument("--nats", default=os.environ.get("HERON_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--store", default=os.environ.get("HERON_CONFIG_STORE", "heron-config"),
                   help="a directory, or s3://bucket/prefix")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--bundles-dir", type=Path, default=None)
    p.add_argument("--instance-id", default=os.environ.get("HERON_CONFIG_INSTANCE_ID"))
    p.add_argument("--log-level", default=os.environ.get("HERON_LOG_LEVEL", "info"))
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--allow-remote-code", action="store_true",
                   help="accept models with trust_remote_code: true (also "
                        "HERON_ALLOW_REMOTE_CODE=1)")
    ConfigServiceSettings.add_flags(p)  # --lease-ttl-s (--lease-ttl), ... as `heron config`
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = ConfigServiceSettings.from_args(args)
        settings.export_env()  # HERON_STREAM_REPLICAS for HERON_CONFIG and the lease bucket
        run(args.nats, args.store, host=args.host, port=args.port, log_level=args.log_level,
            access_log=args.access_log, bundles_dir=args.bundles_dir,
            instance_id=args.instance_id, settings=settings,
            allow_remote_code=args.allow_remote_code)
    except ConfigError as exc:
        print(f"heron config: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
