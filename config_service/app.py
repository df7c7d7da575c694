"""Build and run a config service: ``create_app`` for tests and embedding, ``serve``/``run``
for ``heron config`` (and ``python -m heron.config_service``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from heron.config_service.blobs import open_blobs
from heron.config_service.body import remote_code_allowed_by_env
from heron.config_service.metrics import ConfigMetrics
from heron.config_service.routes import ConfigRoutes
from heron.config_service.service import ConfigService
from heron.config_service.settings import ConfigServiceSettings
from heron.config_service.state import Registry
from heron.config_service.store import ConfigStore
from heron.runtime.http import HTTP_KEEP_ALIVE_S
from heron.runtime.logs import uvicorn_log_config
from heron.runtime.modelconfig import default_bundles_dir

log = logging.getLogger("heron.config")

DEFAULT_PORT = 8090


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def create_app(nats_url: str, store_url: str | Path, *, bundles_dir: Path | None = None,
               admin_token: str | None = None, instance_id: str | None = None,
               lease_ttl_s: float | None = None, allow_remote_code: bool = False,
               settings: ConfigServiceSettings | None = None) -> Starlette:
    """A config service app. The bundles dir (epoch 0's content) is read here, so a bad
    bundle stops it before it binds (ConfigError); the store is read, NATS connected and
    the writer lease sought in the app's lifespan, retried until they answer.

    ``store_url``: a directory, or ``s3://bucket/prefix`` (endpoint from AWS_ENDPOINT_URL
    or HERON_S3_ENDPOINT). ``admin_token`` defaults to HERON_ADMIN_TOKEN; without one,
    writes and /export are open. ``allow_remote_code`` (or HERON_ALLOW_REMOTE_CODE=1)
    accepts posted models with ``trust_remote_code: true``; without it they are 422.
    ``settings``: the service's limits and timeouts (``lease_ttl_s``, when given, wins)."""
    settings = settings or ConfigServiceSettings()
    if lease_ttl_s is not None:
        settings = dataclasses.replace(settings, lease_ttl_s=lease_ttl_s)
    base = Registry.from_bundles_dir(bundles_dir or default_bundles_dir())
    token = admin_token if admin_token is not None else os.environ.get("HERON_ADMIN_TOKEN")
    if not token:
        log.warning("HERON_ADMIN_TOKEN is not set: config writes and /export are open")
    store = ConfigStore(open_blobs(store_url))
    remote_code = allow_remote_code or remote_code_allowed_by_env()
    if remote_code:
        log.warning("posted models may set trust_remote_code: their checkpoints' own code "
                    "will run in the workers that serve them")
    service = ConfigService(nats_url, store, base,
                            instance_id=instance_id or default_instance_id(),
                            lease_ttl_s=settings.lease_ttl_s, metrics=ConfigMetrics(),
                            allow_remote_code=remote_code)
    return ConfigRoutes(service, token or None).build()


def uvicorn_config(app: Starlette, *, host: str, port: int, log_level: str = "info",
                   access_log: bool = False) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          access_log=access_log, log_config=uvicorn_log_config(),
                          timeout_keep_alive=HTTP_KEEP_ALIVE_S)


async def serve(nats_url: str, store_url: str | Path, *, host: str = "127.0.0.1",
                port: int = DEFAULT_PORT, log_level: str = "info", access_log: bool = False,
                bundles_dir: Path | None = None, admin_token: str | None = None,
                instance_id: str | None = None, lease_ttl_s: float | None = None,
                allow_remote_code: bool = False,
                settings: ConfigServiceSettings | None = None) -> None:
    """Serve until SIGINT/SIGTERM, on the running event loop."""
    app = create_app(nats_url, store_url, bundles_dir=bundles_dir, admin_token=admin_token,
                     instance_id=instance_id, lease_ttl_s=lease_ttl_s,
                     allow_remote_code=allow_remote_code, settings=settings)
    await uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                        access_log=access_log)).serve()


def run(nats_url: str, store_url: str | Path, *, host: str = "127.0.0.1",
        port: int = DEFAULT_PORT, log_level: str = "info", access_log: bool = False,
        bundles_dir: Path | None = None, admin_token: str | None = None,
        instance_id: str | None = None, lease_ttl_s: float | None = None,
        allow_remote_code: bool = False, settings: ConfigServiceSettings | None = None
        ) -> None:
    """Blocking: build the app (ConfigError before binding) and serve it."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(nats_url, store_url, bundles_dir=bundles_dir, admin_token=admin_token,
                     instance_id=instance_id, lease_ttl_s=lease_ttl_s,
                     allow_remote_code=allow_remote_code, settings=settings)
    uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                  access_log=access_log)).run()
