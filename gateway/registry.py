"""The gateway's model registry: model name or alias -> (model id, bundle, pool).

The data comes from a ``RegistrySource``: ``BundleDirSource`` (bundle YAMLs under bundles/,
read once at start) or the config service's snapshot (gateway/configs.py); swapping the
source changes none of the callers. The registry also knows what each adapter can do, so
requests a model can never serve are answered here (404/422) without reaching a worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from heron.runtime.adapters import adapter_family
from heron.runtime.backend import model_description
from heron.runtime.modelconfig import (
    Bundle,
    ConfigError,
    ModelConfig,
    load_bundle,
)
from heron_sdk.chunking import check_chunking
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import EncodeRequest, check_outputs


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where requests for one model go."""

    config: ModelConfig
    bundle: str
    pool: str
    # For a config with adapter "auto": the family a worker of the pool loaded it as (its
    # heartbeat says), once one has. Until then every call goes to the workers, who refuse
    # what the family does not answer.
    detected_adapter: str | None = None

    @property
    def model_id(self) -> str:
        return self.config.id

    @property
    def adapter(self) -> str:
        return self.detected_adapter or self.config.adapter

    @property
    def tasks(self) -> tuple[str, ...]:
        return adapter_family(self.adapter).tasks

    @property
    def output_types(self) -> frozenset[str]:
        return adapter_family(self.adapter).output_types

    def check_task(self, task: str) -> None:
        """422 UNSUPPORTED_TASK unless the model answers ``task``."""
        if task not in self.tasks:
            raise HeronError(ErrorCode.UNSUPPORTED_TASK,
                             f"model {self.model_id} does not support {task}; "
                             f"it serves {', '.join(self.tasks)}")


@dataclass(frozen=True, slots=True)
class PoolBundle:
    """A bundle and the pool of workers that serves it."""

    bundle: Bundle
    pool: str


class RegistrySource(Protocol):
    """Where the registry's data comes from (bundle files, or the config service)."""

    def load(self) -> list[PoolBundle]: ...


class BundleDirSource:
    """Bundles read from YAML files: ``pools`` maps bundle name (or path) -> pool name."""

    def __init__(self, pools: Mapping[str, str], bundles_dir: Path | None = None) -> None:
        self.pools = dict(pools)
        self.bundles_dir = bundles_dir

    def load(self) -> list[PoolBundle]:
        return [PoolBundle(load_bundle(name, self.bundles_dir), pool)
                for name, pool in self.pools.items()]


class RouteTable:
    """Model id or alias -> its route (bundle, pool, config): what the gateway resolves each
    request with. Not the worker's ModelRegistry, which holds loaded models."""

    def __init__(self, source: RegistrySource) -> None:
        self.source = source
        self._routes: dict[str, ModelRoute] = {}  # id and every alias -> route
        self._models: list[ModelRoute] = []
        self._pools: dict[str, str] = {}  # pool -> bundle name
        self._hashes: dict[str, str] = {}  # pool -> bundle config hash
        self.loaded = False

    def load(self) -> None:
        """Read the source; a pool claimed by two bundles or a name in two bundles is a
        ConfigError (the gateway could not know where to send it)."""
        routes: dict[str, ModelRoute] = {}
        models: list[ModelRoute] = []
        pools: dict[str, str] = {}
        hashes: dict[str, str] = {}
        for entry in self.source.load():
            name = entry.bundle.name
            if entry.pool in pools and pools[entry.pool] != name:
                raise ConfigError(entry.bundle.source or name, "pool",
                                  f"pool {entry.pool!r} already serves bundle "
                                  f"{pools[entry.pool]!r}; a pool serves one bundle")
            pools[entry.pool] = name
            hashes[entry.pool] = entry.bundle.config_hash
            for config in entry.bundle.models:
                route = ModelRoute(config, name, entry.pool)
                for key in (config.id, *config.aliases):
                    # One name, one pool: routing a model served by two pools needs a
                    # policy (the pools API), not a silent last-bundle-wins.
                    if key in routes:
                        raise ConfigError(entry.bundle.source or name, "models",
                                          f"{key!r} is served by bundles "
                                          f"{routes[key].bundle!r} and {name!r}")
                    routes[key] = route
                models.append(route)
        self._routes, self._models, self._pools, self._hashes = routes, models, pools, hashes
        self.loaded = True

    def pool_names(self) -> dict[str, str]:
        """bundle -> pool as the source was configured (before any load)."""
        pools = getattr(self.source, "pools", None)
        return dict(pools) if isinstance(pools, Mapping) else {}

    # ---- lookups -------------------------------------------------------------------------
    def pools(self) -> dict[str, str]:
        """pool -> bundle name, for every pool the gateway routes to."""
        return dict(self._pools)

    def bundle_hash(self, pool: str) -> str:
        """The config hash of the bundle ``pool`` serves (workers report theirs in beats)."""
        return self._hashes[pool]

    def models(self) -> list[ModelRoute]:
        return list(self._models)

    def canonical_id(self, name: str) -> str | None:
        route = self._routes.get(name)
        return None if route is None else route.model_id

    def resolve(self, name: str) -> ModelRoute:
        route = self._routes.get(name)
        if route is None and not self.loaded:
            # Waiting for the config service's first snapshot: not "unknown model" yet.
            raise HeronError(ErrorCode.NOT_READY, "the model registry is not loaded yet "
                             "(waiting for the config service)", retry_after_s=1.0)
        if route is None:
            raise HeronError(ErrorCode.MODEL_NOT_FOUND,
                             f"model {name!r} is not served here; GET /v1/models lists "
                             "what is")
        return route

    def route_for(self, name: str, task: str) -> ModelRoute:
        """The route of a model that can run ``task`` (404 unknown, 422 wrong task)."""
        route = self.resolve(name)
        route.check_task(task)
        return route


def check_encode_outputs(route: ModelRoute, req: EncodeRequest) -> None:
    """The worker's adapter-only output checks, here too (heron_sdk.types.check_outputs), and
    what chunking needs of the request (heron_sdk.chunking.check_chunking). Checks
    needing the weights (``dims`` over the hidden size, ``truncate: false`` on a too-long
    text) stay with the worker."""
    check_outputs(route.model_id, route.output_types, req)
    check_chunking(req.chunking, req.items, req.output_types)  # its limit is the worker's


def describe(route: ModelRoute, state: str) -> dict[str, Any]:
    """A model as GET /v1/models shows it (every server's shape, with its pool and bundle);
    an ``auto`` model that a worker has loaded, as the family it loaded as."""
    config = route.config
    if route.detected_adapter is not None:  # tasks and outputs as that family's
        config = dataclasses.replace(config, adapter=route.detected_adapter)
    return model_description(config, state=state, bundle=route.bundle, pool=route.pool)
