"""The result cache's shared tier: model outputs in the NATS KV bucket ``heron_results``, so an
item one worker computed is answered by every other worker (cluster workers only, off unless
``--result-cache-shared-bytes`` is set; ``heron serve`` has no NATS and never uses it).

The per-process cache (worker/result_cache.py) keys its entries by a scope that is new on
every load, which no other process can know. The shared key says instead, in terms every
worker computes alike, what the output depends on (``SharedIdentity``):

- the model id, the adapter family it loaded as, the device type and compute dtype it runs
  in (a bf16 CPU worker and an fp32 one do not answer for each other), and Heron's version
  (a release may change what an adapter computes);
- its weights: a SHA-256 over every file of the weights directory (``weights_digest``);
  a changed file is a new key whichever tier it came from (a path, a package, the Hub's
  ``main`` at another commit). Measured for MiniLM (87 MiB, 13 files, page cache warm):
  60-95 ms on this 2-core machine, on a thread while the model loads; memoized per process
  by the files' sizes and mtimes, so a reload after an eviction costs a ``stat`` per file;
- its config: the canonical hash of the whole model config as the worker has it now (any
  config delta is a new key, as it is a new local scope) and of the profile it loaded with;
- the item: ``item_digest`` (tokens, query flag, prompt, special-token mask). Items with a
  LoRA adapter are not shared: an adapter's files have no digest here.

A value is one version byte and msgpack (numpy arrays in msgpack-numpy's form, decoded
numeric-only by heron_sdk.wire). Only plain outputs are shared: a score (float) or a dict
of arrays and sparse vectors; anything else (multi-vector outputs, a dict subclass that
computes MUVERA lazily) is not stored, and whatever fails to decode counts as a miss.

NATS never fails or stalls a request: a lookup is one concurrent batch of gets bounded by
``--result-cache-shared-timeout-s`` (a get that has not answered by then, NATS away, or an
unbound bucket: an error, counted, and the item is computed); a store is a background
publish, at most ``STORES_IN_FLIGHT`` at once, dropped beyond that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

import heron
from heron.runtime.modelconfig import ModelConfig, Profile, bundle_config_hash
from heron.runtime.nats_link import describe_nats_error
from heron.runtime.nats_names import RESULTS_BUCKET, ensure_results_bucket, token
from heron_sdk import wire
from heron_sdk.errors import HeronError
from heron_sdk.types import SparseVector

log = logging.getLogger("heron.worker.shared_results")

KEY_VERSION = 1  # in every scope: a new key layout never reads an old one's entries
VALUE_VERSION = 1  # the first byte of every value
# Larger outputs are not shared (a 1024-d float32 vector is 4 KiB; a sparse one a few KiB).
MAX_VALUE_BYTES = 256 * 1024
STORES_IN_FLIGHT = 64  # background publishes at once; more are dropped (counted)
STORE_TIMEOUT_S = 2.0  # one publish's wait for JetStream's acknowledgement
BIND_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # between failed bucket declarations; then every 5 s
_CHUNK = 1 << 20


# ---- keys ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SharedIdentity:
    """What a loaded model's outputs depend on, beyond its config (which can change while
    it stays loaded: ``scope`` takes the config as it is now)."""

    model_id: str
    weights: str  # weights_digest of its files
    profile: str  # hash of the profile it loaded with
    family: str  # the adapter family (what "auto" resolved to)
    compute: str  # "<device type>/<dtype>", e.g. "cpu/float32"

    @classmethod
    def of(cls, model_id: str, weights: str, profile: Profile, family: str, device: str,
           dtype: str) -> SharedIdentity:
        blob = json.dumps(asdict(profile), sort_keys=True, default=str).encode()
        return cls(model_id, weights, hashlib.sha256(blob).hexdigest(), family,
                   f"{device.split(':')[0]}/{dtype}")

    def scope(self, config: ModelConfig) -> str:
        """``<model token>.<32 hex>``: the prefix of this model's keys under ``config``."""
        parts = {"key": KEY_VERSION, "heron": heron.__version__, "model": self.model_id,
                 "weights": self.weights, "profile": self.profile, "family": self.family,
                 "compute": self.compute, "config": bundle_config_hash([config])}
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        return f"{token(self.model_id)}.{digest[:32]}"


def start_digest(root: Path) -> asyncio.Future[str]:
    """``weights_digest`` on a thread, from now: it runs while the model loads."""
    future = asyncio.ensure_future(asyncio.to_thread(weights_digest, root))
    # A load that fails never awaits it: its error must not be reported as unretrieved.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


async def identify(digest: asyncio.Future[str], model_id: str, profile: Profile,
                   family: str, device: str, dtype: str) -> SharedIdentity | None:
    """The loaded model's identity once its weights' digest is known; None (the model
    does not use the shared tier) when its files could not be read."""
    try:
        weights = await digest
    except OSError as exc:
        log.warning("%s: no shared result cache (cannot hash its weights: %s)", model_id, exc)
        return None
    return SharedIdentity.of(model_id, weights, profile, family, device, dtype)


def shared_key(scope: str, item: bytes) -> str:
    """An item's key in the bucket: its model's scope and its item digest (hex)."""
    return f"{scope}.{item.hex()}"


_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def weight_files(root: Path) -> list[Path]:
    """The files a model directory's outputs can depend on, in a fixed order: all of them
    but dotfiles (the weight cache's markers, .gitattributes) and compiled Python."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found += [Path(folder, f) for f in files
                  if not f.startswith(".") and not f.endswith(".pyc")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def weights_digest(root: Path) -> str:
    """SHA-256 (hex) over the relative path, size and bytes of every ``weight_files`` file
    (SHA-256, not blake2b: with the CPU's SHA extensions it ran at ~1.2 GB/s here, blake2b at
    ~0.7). Blocking: call it on a thread (hashlib releases the GIL while it hashes)."""
    files = weight_files(root)
    signature = tuple((p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns)
                      for p in files for st in (p.stat(),))
    memo = (str(root), signature)
    if memo in _DIGESTS:
        return _DIGESTS[memo]
    h = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    for path, (rel, size, _) in zip(files, signature, strict=True):
        h.update(f"{rel}\0{size}\0".encode())
        with path.open("rb") as f:
            while n := f.readinto(buffer):
                h.update(view[:n])
    _DIGESTS[memo] = h.hexdigest()
    return _DIGESTS[memo]


# ---- values -------------------------------------------------------------------------------
def encode_value(value: Any) -> bytes | None:
    """A model output as the bucket stores it; None for what is not shared (see above)."""
    if type(value) is float:
        body: Any = ["f", value]
    elif type(value) is dict and value:
        fields: list[Any] = []
        for name, v in value.items():
            if isinstance(v, np.ndarray) and v.dtype.kind in "biuf":
                fields.append([name, "a", v])
            elif isinstance(v, SparseVector):
                fields.append([name, "s", v.indices, v.values])
            else:
                return None
        body = ["m", fields]
    else:
        return None
    data = bytes([VALUE_VERSION]) + wire.encode(body, wire.MSGPACK)
    return data if len(data) <= MAX_VALUE_BYTES else None


def decode_value(data: bytes) -> Any | None:
    """``encode_value``'s output back; None for anything else (another version, garbage)."""
    if not data or data[0] != VALUE_VERSION:
        return None
    try:  # wire.decode: arrays numeric only (msgpack-numpy's own decoder would unpickle)
        kind, body = wire.decode(data[1:], wire.MSGPACK)
        if kind == "f" and type(body) is float:
            return body
        if kind != "m" or not isinstance(body, list) or not body:
            return None
        out: dict[str, Any] = {}
        for field in body:
            name, what, *arrays = field
            if not isinstance(name, str) or not all(isinstance(a, np.ndarray) for a in arrays):
                return None
            if what == "a" and len(arrays) == 1:
                out[name] = arrays[0]
            elif what == "s" and len(arrays) == 2 and arrays[0].shape == arrays[1].shape:
                out[name] = SparseVector(indices=arrays[0], values=arrays[1])
            else:
                return None
        return out
    except (HeronError, ValueError, TypeError):
        return None


# ---- the tier -----------------------------------------------------------------------------
@dataclass(slots=True)
class SharedStats:
    hits: int = 0  # lookups per item: found and decoded
    misses: int = 0  # not in the bucket (or not decodable)
    errors: int = 0  # no answer in time, NATS away, the bucket not bound: computed
    stored: int = 0  # outputs written to the bucket
    dropped: int = 0  # not written: too many stores in flight, NATS away, not shareable
    store_errors: int = 0  # writes that failed or timed out


class SharedResults:
    """The bucket, once ``attach`` has bound it; lookups and stores never raise."""

    def __init__(self, max_bytes: int, ttl_s: float, timeout_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.stats = SharedStats()
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._binding: asyncio.Task[None] | None = None
        self._stores: set[asyncio.Task[None]] = set()
        self._last_log = 0.0

    @property
    def bound(self) -> bool:
        return self._kv is not None

    def attach(self, nc: NatsClient, js: JetStreamContext) -> None:
        """Declare (or find) the bucket in the background, retrying until it works; again
        after a reconnect (a NATS that lost its store lost the bucket too)."""
        self._nc, self._js = nc, js
        if self._binding is not None and not self._binding.done():
            return
        self._binding = asyncio.get_running_loop().create_task(self._bind(js))

    async def _bind(self, js: JetStreamContext) -> None:
        for attempt in itertools.count():
            try:
                self._kv = await ensure_results_bucket(js, self.max_bytes, self.ttl_s,
                                                       MAX_VALUE_BYTES + 1024)
                return
            except Exception as exc:  # JetStream not ready, a refused declaration, NATS away
                if attempt == 0:
                    log.warning("result cache: cannot use the KV bucket %s yet (retrying): %s",
                                RESULTS_BUCKET, describe_nats_error(exc))
                await asyncio.sleep(BIND_RETRY_S[min(attempt, len(BIND_RETRY_S) - 1)])

    def _usable(self) -> KeyValue | None:
        nc = self._nc
        return self._kv if nc is not None and nc.is_connected else None

    async def get_many(self, keys: list[str]) -> list[Any | None]:
        """Each key's output, or None: one concurrent batch of gets, ``timeout_s`` at most."""
        out: list[Any | None] = [None] * len(keys)
        kv = self._usable()
        if kv is None:
            self.stats.errors += len(keys)
            return out
        tasks = [asyncio.ensure_future(kv.get(k, validate_keys=False)) for k in keys]
        try:
            done, _ = await asyncio.wait(tasks, timeout=self.timeout_s)
        finally:
            for t in tasks:
                t.cancel()  # a no-op on the finished ones
        failed: BaseException | None = None
        for i, t in enumerate(tasks):
            exc = t.exception() if t in done else TimeoutError("no answer in time")
            if exc is None:
                out[i] = decode_value(t.result().value)
                if out[i] is None:
                    self.stats.misses += 1
                else:
                    self.stats.hits += 1
            elif isinstance(exc, KeyNotFoundError):
                self.stats.misses += 1
            else:
                self.stats.errors += 1
                failed = exc
        if failed is not None:
            self._warn(f"lookup of {len(keys)} items: {describe_nats_error(failed)}")
        return out

    def store(self, key: str, value: Any) -> None:
        """Write ``value`` in the background (never waited on; dropped on overload)."""
        js = self._js
        if self._usable() is None or js is None or len(self._stores) >= STORES_IN_FLIGHT:
            self.stats.dropped += 1
            return
        data = encode_value(value)
        if data is None:
            self.stats.dropped += 1
            return
        task = asyncio.get_running_loop().create_task(self._publish(js, key, data))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    async def _publish(self, js: JetStreamContext, key: str, data: bytes) -> None:
        try:
            await js.publish(f"$KV.{RESULTS_BUCKET}.{key}", data, timeout=STORE_TIMEOUT_S)
            self.stats.stored += 1
        except Exception as exc:
            self.stats.store_errors += 1
            self._warn(f"store: {describe_nats_error(exc)}")
            if self._nc is not None:  # the bucket may be gone (deleted, NATS lost its store)
                self.attach(self._nc, js)

    def _warn(self, what: str) -> None:
        """One line per 10 s at most: an outage fails every lookup."""
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            log.warning("result cache, shared tier: %s (counted; items computed)", what)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the stores in flight (at most ``timeout_s``)."""
        if self._stores:
            await asyncio.wait(set(self._stores), timeout=timeout_s)

    async def close(self) -> None:
        """Let the stores in flight finish (a second at most), then stop."""
        await self.flush(1.0)
        for task in (self._binding, *self._stores):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
