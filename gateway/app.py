"""Build and run a gateway: ``create_app`` for tests and embedding, ``serve``/``run`` for
``heron gateway`` (and ``heron up``, which runs one as a child process)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from heron.gateway.registry import BundleDirSource, RouteTable
from heron.gateway.routes import GatewayApp
from heron.gateway.settings import GatewaySettings
from heron.runtime.hot_posts import HOT_POST_HTTP
from heron.runtime.http import HTTP_KEEP_ALIVE_S
from heron.runtime.logs import uvicorn_log_config
from heron.runtime.modelconfig import ConfigError

DEFAULT_POOLS = {"default": "default"}  # bundle -> pool


def parse_pool_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """``["default=default", "sparse=gpu-a"]`` -> {bundle: pool}; none given -> the default
    bundle in the default pool. A bare ``NAME`` means bundle NAME in pool NAME."""
    pools: dict[str, str] = {}
    for pair in pairs:
        bundle, sep, pool = pair.partition("=")
        bundle, pool = bundle.strip(), (pool.strip() if sep else bundle.strip())
        if not bundle or not pool:
            raise ConfigError("--pool", pair, "must be BUNDLE=POOL")
        if bundle in pools and pools[bundle] != pool:
            raise ConfigError("--pool", pair, f"bundle {bundle} is already in pool "
                              f"{pools[bundle]}; a bundle is served by one pool")
        pools[bundle] = pool
    return pools or dict(DEFAULT_POOLS)


def create_app(nats_url: str, pools: Mapping[str, str] | None = None, *,
               bundles_dir: Path | None = None, settings: GatewaySettings | None = None,
               gateway_id: str | None = None, config_url: str | None = None) -> Starlette:
    """A gateway app. ``pools`` maps bundle name (or bundle YAML path) -> pool name. The
    bundles are read here, so a config error (ConfigError) stops it before it binds; NATS
    is connected in the app's lifespan, and retried until it answers. With ``config_url``
    the models come from the config service (and follow it) instead of bundle files."""
    registry = RouteTable(BundleDirSource(pools or DEFAULT_POOLS, bundles_dir))
    if config_url is None:
        registry.load()
    return GatewayApp(nats_url, registry, settings=settings, gateway_id=gateway_id,
                      config_url=config_url).build()


def uvicorn_config(app: Starlette, *, host: str, port: int, log_level: str = "info",
                   access_log: bool = False,
                   settings: GatewaySettings | None = None) -> uvicorn.Config:
    """uvicorn's config; after SIGTERM, requests in flight get ``shutdown_timeout_s``."""
    shutdown_s = (settings or GatewaySettings()).shutdown_timeout_s
    # proxy_headers off: uvicorn's X-Forwarded-* middleware wraps every request (a coroutine
    # and a walk of its headers, about 1% of a gateway's CPU a one-text request), and the
    # gateway reads neither the client's address nor the scheme it rewrites.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          access_log=access_log, loop="uvloop", http=HOT_POST_HTTP,
                          log_config=uvicorn_log_config(), proxy_headers=False,
                          timeout_keep_alive=HTTP_KEEP_ALIVE_S,
                          timeout_graceful_shutdown=math.ceil(shutdown_s))


async def serve(nats_url: str, pools: Mapping[str, str] | None = None, *,
                host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
                access_log: bool = False, bundles_dir: Path | None = None,
                settings: GatewaySettings | None = None, gateway_id: str | None = None,
                config_url: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM, on the running event loop."""
    app = create_app(nats_url, pools, bundles_dir=bundles_dir, settings=settings,
                     gateway_id=gateway_id, config_url=config_url)
    config = uvicorn_config(app, host=host, port=port, log_level=log_level,
                            access_log=access_log, settings=settings)
    await uvicorn.Server(config).serve()


def run(nats_url: str, pools: Mapping[str, str] | None = None, *, host: str = "127.0.0.1",
        port: int = 8080, log_level: str = "info", access_log: bool = False,
        bundles_dir: Path | None = None, settings: GatewaySettings | None = None,
        gateway_id: str | None = None, config_url: str | None = None) -> None:
    """Blocking: build the app (ConfigError before binding) and serve it on uvloop."""
    app = create_app(nats_url, pools, bundles_dir=bundles_dir, settings=settings,
                     gateway_id=gateway_id, config_url=config_url)
    uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                  access_log=access_log, settings=settings)).run()
