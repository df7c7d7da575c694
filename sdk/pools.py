"""Pools on lease: the shape gateways, the local autoscaler and the SDK share.

A pool is a group of workers serving one bundle. The pools named on a gateway's command
line are *static*. Users add *leased* pools at run time (``POST /v1/pools``): each lease is a
key in the NATS KV bucket ``heron_pools`` (``POOLS_BUCKET`` of the server) with a per-key
TTL, so any gateway replica serves it and a lease nobody renews disappears by itself.
A request names its pool with the ``X-Heron-Pool`` header.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from heron_sdk.errors import ProtocolError, invalid_field
from heron_sdk.types import check_fields, check_finite, integral

POOL_HEADER = "X-Heron-Pool"

# Pool names become NATS subject tokens, stream names and KV keys unchanged, so they are
# restricted to what all three accept (and what Kubernetes accepts in a label value).
POOL_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?$")
MIN_TTL_S = 1.0  # NATS per-message TTLs have a one-second resolution
MAX_TTL_S = 86_400.0
DEFAULT_TTL_S = 300.0
MAX_POOL_WORKERS = 64


def check_pool_name(name: object, field: str = "name") -> str:
    # fullmatch: a bare "$" also matches before a trailing newline ("team-a\n").
    if not isinstance(name, str) or not POOL_NAME_RE.fullmatch(name):
        raise invalid_field(field, "must be 1-63 characters of a-z, 0-9, '-' and '_', "
                            "starting and ending with a letter or digit")
    return name


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_field(key, "must be a number")
    check_finite(value, key)
    if not low <= value <= high:
        raise invalid_field(key, f"must be between {low:g} and {high:g}")
    return float(value)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What ``POST /v1/pools`` asks for."""

    name: str
    bundle: str
    workers: int = 1  # workers the autoscaler keeps while the lease lives
    ttl_s: float = DEFAULT_TTL_S

    @classmethod
    def from_wire(cls, body: Any) -> PoolSpec:
        if not isinstance(body, dict):
            raise invalid_field("body", "must be an object")
        check_fields(body, ("name", "bundle", "workers", "ttl_s"))
        bundle = body.get("bundle")
        if not isinstance(bundle, str) or not bundle:
            raise invalid_field("bundle", "must be a bundle name")
        workers = integral(body.get("workers", 1))  # 2.0 is 2, as JSON Schema reads it
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise invalid_field("workers", "must be an integer")
        if not 0 <= workers <= MAX_POOL_WORKERS:
            raise invalid_field("workers", f"must be between 0 and {MAX_POOL_WORKERS}")
        return cls(name=check_pool_name(body.get("name")), bundle=bundle, workers=workers,
                   ttl_s=_number(body, "ttl_s", DEFAULT_TTL_S, MIN_TTL_S, MAX_TTL_S))


def renew_ttl(body: Any, current: float) -> float:
    """The TTL a ``/renew`` body asks for (an empty body keeps the lease's own)."""
    if body in (None, b"", {}):
        return current
    if not isinstance(body, dict) or set(body) - {"ttl_s"}:
        raise invalid_field("body", "may only hold ttl_s")
    return _number(body, "ttl_s", current, MIN_TTL_S, MAX_TTL_S)


@dataclass(frozen=True, slots=True)
class PoolLease:
    """A live leased pool: the value stored under its name in the ``heron_pools`` bucket
    (JSON, so ``nats kv get heron_pools team-a`` is readable)."""

    name: str
    bundle: str
    workers: int
    ttl_s: float
    created_at: float  # unix seconds
    renewed_at: float  # unix seconds; the lease ends at renewed_at + ttl_s

    @classmethod
    def new(cls, spec: PoolSpec, now: float | None = None) -> PoolLease:
        now = time.time() if now is None else now
        return cls(spec.name, spec.bundle, spec.workers, spec.ttl_s, now, now)

    def renewed(self, ttl_s: float, now: float | None = None) -> PoolLease:
        now = time.time() if now is None else now
        return PoolLease(self.name, self.bundle, self.workers, ttl_s, self.created_at, now)

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.ttl_s

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def to_kv(self) -> bytes:
        """The value stored under the pool's name in ``heron_pools``: JSON of the six
        fields, in field order."""
        return orjson.dumps(asdict(self))

    @classmethod
    def from_kv(cls, data: bytes) -> PoolLease:
        """Read a stored value; ProtocolError when it is not JSON of a lease."""
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"a pool lease is not JSON: {exc}") from None
        return cls.from_wire(raw)

    @classmethod
    def from_wire(cls, data: Any) -> PoolLease:
        """A lease from its dict form: the stored value, or the pools API's view (whose
        extra keys, ``kind`` and ``expires_*``, are derived and ignored here).
        ProtocolError when a field is missing or of the wrong kind."""
        if not isinstance(data, dict):
            raise ProtocolError(f"a pool lease must be an object, not {type(data).__name__}")
        try:
            return cls(name=str(data["name"]), bundle=str(data["bundle"]),
                       workers=int(data["workers"]), ttl_s=float(data["ttl_s"]),
                       created_at=float(data["created_at"]),
                       renewed_at=float(data["renewed_at"]))
        except KeyError as exc:
            raise ProtocolError(f"a pool lease has no {exc.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as exc:  # int(inf) overflows
            raise ProtocolError(f"a pool lease has a malformed field: {exc}") from None

    def to_wire(self, now: float | None = None) -> dict[str, Any]:
        """The lease as the pools API shows it (the gateway adds state and worker counts):
        the stored fields, plus ``kind``, ``expires_at`` and ``expires_in_s``."""
        now = time.time() if now is None else now
        return {**asdict(self), "kind": "lease", "expires_at": self.expires_at,
                "expires_in_s": round(max(0.0, self.expires_at - now), 3)}
