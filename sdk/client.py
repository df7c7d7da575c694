"""The synchronous Heron client (``AsyncClient`` in sdk/aio.py is the same API, awaited).

One ``Client`` works against ``heron serve`` and against a cluster gateway: it speaks
msgpack (numpy arrays) by default, waits out 202/503 while capacity is provisioned, retries
what another attempt may fix, splits calls over the server's per-request limits and
returns typed results (sdk/results.py). The decisions live in sdk/calls.py; this module
only sends requests and sleeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Unpack

import httpx

from heron_sdk import wire
from heron_sdk.calls import (
    CallBuilder,
    CallPolicy,
    EncodeOptions,
    ExtractOptions,
    HttpCall,
    ItemLike,
    Reply,
    ScoreOptions,
    SplitCall,
    attempts,
    decode_reply,
)
from heron_sdk.errors import HeronError, PoolError
from heron_sdk.jobs import Jobs
from heron_sdk.pools import DEFAULT_TTL_S
from heron_sdk.results import EncodedChunk, EncodeResult, ExtractResult, ScoreResult
from heron_sdk.streaming import DEFAULT_MAX_IN_FLIGHT, EncodeStream, ProgressBar

log = logging.getLogger("heron.sdk")

DEFAULT_URL = "http://127.0.0.1:8080"


def default_url() -> str:
    return os.environ.get("HERON_URL", DEFAULT_URL)


class Client:
    """``Client("http://127.0.0.1:8080")``; a context manager (or call ``close()``).

    ``timeout`` bounds each call, retries included; ``provision_timeout_s`` bounds how long
    a call waits for capacity (202 while a pool scales from zero, 503 while a model loads)
    before ``ProvisioningTimeout``. ``api_key`` (default: ``HERON_API_KEY``) is sent as a
    bearer token. Thread-safe: share one client.
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 wire: str = "msgpack", timeout: float = 60.0,
                 wait_for_capacity: bool = True, provision_timeout_s: float = 300.0,
                 max_items_per_request: int | None = None,
                 http: httpx.Client | None = None) -> None:
        self.base_url = (base_url or default_url()).rstrip("/")
        self._b = _builder(wire, api_key, timeout, wait_for_capacity,
                           provision_timeout_s, max_items_per_request)
        self._http = http or httpx.Client(base_url=self.base_url, timeout=timeout)
        # Bulk jobs (cluster gateway only): client.jobs.create(...), job.wait(progress=True)
        self.jobs = Jobs(lambda method, path, body, ok: self._run(
            self._b.request(method, path, body, ok=ok)))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ---- I/O: the only part that differs from AsyncClient ------------------------------------
    def _send(self, call: HttpCall) -> Reply:
        content = None if call.body is None else self._b.encode_body(call.body)
        response = self._http.request(call.method, call.path, content=content,
                                      headers=call.headers, timeout=call.timeout_s)
        return decode_reply(response.status_code, response.headers, response.content)

    def _run(self, call: HttpCall, policy: CallPolicy | None = None) -> Any:
        plan: Generator[HttpCall | float, Reply | Exception | None, Reply] = attempts(
            call, policy or self._b.policy)
        step = next(plan)
        while True:
            outcome: Reply | Exception | None = None
            if isinstance(step, HttpCall):
                try:
                    outcome = self._send(step)
                except httpx.TransportError as exc:
                    outcome = exc
            else:
                time.sleep(step)
            try:
                step = plan.send(outcome)
            except StopIteration as done:
                return done.value.body

    def _run_split(self, split: tuple[SplitCall, CallPolicy]) -> Any:
        calls, policy = split
        return calls.finish([self._run(call, policy) for call in calls.calls])

    # ---- inference -------------------------------------------------------------------------
    def encode(self, model: str, items: Iterable[ItemLike] | str, *,
               progress: bool | ProgressBar = False,
               **options: Unpack[EncodeOptions]) -> EncodeResult:
        """Embeddings of ``items`` (strings or ``Item(text, id)``), in order.

        A list (any Sequence) is sent as is, split into requests over the limits. Any
        other iterable (a generator, ...), or ``progress`` asked for, goes through
        ``encode_stream`` and is collected: the whole result is held, so for inputs that
        do not fit in memory use ``encode_stream`` itself."""
        if isinstance(items, str | Sequence) and not progress:
            return self._run_split(self._b.encode(model, items, options))
        return EncodeResult.joined([chunk.result for chunk in self.encode_stream(
            model, items, progress=progress, **options)])

    def encode_stream(self, model: str, items: Iterable[ItemLike] | str, *,
                      chunk_size: int | None = None,
                      max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                      progress: bool | ProgressBar = False, total: int | None = None,
                      **options: Unpack[EncodeOptions]) -> Iterator[EncodedChunk]:
        """Embeddings of any iterable, read lazily, ``chunk_size`` items a request (default:
        the most a request may hold) with at most ``max_in_flight`` chunks read and not
        yet handed back; ``EncodedChunk``s in input order. ``progress=True`` shows a tqdm
        bar (``total`` sizes it when ``items`` has no length). On an error, every chunk
        before it is handed back and then it is raised (see docs/sdk.md)."""
        stream = EncodeStream(self._b, model, items, chunk_size=chunk_size,
                              max_in_flight=max_in_flight, progress=progress, total=total,
                              options=options)
        return stream.run_sync(self._run_split)

    def score(self, model: str, query: str | Any, items: Sequence[ItemLike],
              **options: Unpack[ScoreOptions]) -> ScoreResult:
        """``items`` ranked against ``query``, best first."""
        return self._run_split(self._b.score(model, query, items, options))

    def extract(self, model: str, items: Sequence[ItemLike] | str,
                **options: Unpack[ExtractOptions]) -> ExtractResult:
        """Entities in each of ``items``."""
        return self._run_split(self._b.extract(model, items, options))

    # ---- models and capacity ---------------------------------------------------------------
    def list_models(self, *, pool: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._b.request("GET", "/v1/models", pool=pool))["data"]

    def get_model(self, model: str, *, pool: str | None = None) -> dict[str, Any]:
        return self._run(self._b.request("GET", f"/v1/models/{model}", pool=pool))

    def wait_for_capacity(self, model: str, *, pool: str | None = None,
                          provision_timeout_s: float | None = None) -> dict[str, Any]:
        """Block until a worker has ``model`` loaded and ready (starting one if the pool is
        scaled to zero); ``ProvisioningTimeout`` if none is ready in time."""
        return self._run(self._b.request("POST", f"/v1/models/{model}/provision", {},
                                         pool=pool),
                         self._b.call_policy(wait_for_capacity=True,
                                             provision_timeout_s=provision_timeout_s))

    # ---- pools (cluster gateway only) ------------------------------------------------------
    def create_pool(self, name: str, bundle: str, *, workers: int = 1,
                    ttl_s: float = DEFAULT_TTL_S) -> dict[str, Any]:
        body = {"name": name, "bundle": bundle, "workers": workers, "ttl_s": ttl_s}
        return self._run(self._b.request("POST", "/v1/pools", body, ok=(201,)))

    def get_pool(self, name: str) -> dict[str, Any]:
        return self._run(self._b.request("GET", f"/v1/pools/{name}"))

    def list_pools(self) -> list[dict[str, Any]]:
        return self._run(self._b.request("GET", "/v1/pools"))["data"]

    def renew_pool(self, name: str, ttl_s: float | None = None) -> dict[str, Any]:
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        return self._run(self._b.request("POST", f"/v1/pools/{name}/renew", body))

    def delete_pool(self, name: str) -> dict[str, Any]:
        return self._run(self._b.request("DELETE", f"/v1/pools/{name}"))

    def pool(self, name: str, bundle: str, *, workers: int = 1, ttl_s: float = 60.0,
             renew_every_s: float | None = None) -> Pool:
        """A leased pool for a ``with`` block: created on entry, renewed in the background,
        deleted on exit. Its ``encode``/``score``/``extract`` route to it."""
        return Pool(self, name, bundle, workers=workers, ttl_s=ttl_s,
                    renew_every_s=renew_every_s)


def _builder(wire_format: str, api_key: str | None, timeout: float, wait_for_capacity: bool,
             provision_timeout_s: float, max_items: int | None) -> CallBuilder:
    """Shared by Client and AsyncClient: validate the settings once."""
    if wire_format not in ("msgpack", "json"):
        raise ValueError("wire must be 'msgpack' or 'json'")
    policy = CallPolicy(timeout_s=timeout, wait_for_capacity=wait_for_capacity,
                        provision_timeout_s=provision_timeout_s)
    fmt = wire.MSGPACK if wire_format == "msgpack" else wire.JSON
    builder = CallBuilder(fmt, api_key or os.environ.get("HERON_API_KEY"), policy)
    if max_items is not None:
        builder.max_items = max_items
    return builder


class PoolLeaseState:
    """What both pool handles share: the lease's settings and how renewal went."""

    def __init__(self, name: str, bundle: str, workers: int, ttl_s: float,
                 renew_every_s: float | None) -> None:
        self.name, self.bundle, self.workers, self.ttl_s = name, bundle, workers, ttl_s
        # A third of the TTL: two renewals may fail (a gateway restarting) before it lapses.
        self.renew_every_s = renew_every_s or max(0.2, ttl_s / 3)
        self.lease: dict[str, Any] | None = None  # the latest answer of create or renew
        self.lost = False  # the lease ended under us (expired or deleted elsewhere)
        self.renewals = 0

    def renewed(self, lease: dict[str, Any]) -> None:
        self.lease, self.renewals = lease, self.renewals + 1

    def renewal_failed(self, exc: HeronError) -> bool:
        """Log it; True when renewing is pointless now (the lease is gone)."""
        if isinstance(exc, PoolError):
            self.lost = True
            log.warning("pool %s: its lease is gone (%s); requests to it now fail",
                        self.name, exc.message)
            return True
        log.warning("pool %s: renewing the lease failed (%s); retrying in %.1f s",
                    self.name, exc, self.renew_every_s)
        return False


class Pool(PoolLeaseState):
    """A leased pool in a ``with`` block (see ``Client.pool``)."""

    def __init__(self, client: Client, name: str, bundle: str, *, workers: int, ttl_s: float,
                 renew_every_s: float | None) -> None:
        super().__init__(name, bundle, workers, ttl_s, renew_every_s)
        self.client = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Pool:
        self.lease = self.client.create_pool(self.name, self.bundle, workers=self.workers,
                                             ttl_s=self.ttl_s)
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"heron-pool-{self.name}")
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                self.renewed(self.client.renew_pool(self.name, self.ttl_s))
            except HeronError as exc:
                if self.renewal_failed(exc):
                    return

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def close(self) -> None:
        """Stop renewing and delete the pool (its workers stop; requests to it end)."""
        self.stop_renewing()
        if not self.lost:
            with contextlib.suppress(PoolError):  # already gone: expired or deleted
                self.client.delete_pool(self.name)
            self.lost = True

    def info(self) -> dict[str, Any]:
        return self.client.get_pool(self.name)

    def encode(self, model: str, items: Iterable[ItemLike] | str, *,
               progress: bool | ProgressBar = False,
               **options: Unpack[EncodeOptions]) -> EncodeResult:
        return self.client.encode(model, items, progress=progress,
                                  **{**options, "pool": self.name})

    def encode_stream(self, model: str, items: Iterable[ItemLike] | str, *,
                      chunk_size: int | None = None,
                      max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                      progress: bool | ProgressBar = False, total: int | None = None,
                      **options: Unpack[EncodeOptions]) -> Iterator[EncodedChunk]:
        return self.client.encode_stream(model, items, chunk_size=chunk_size,
                                         max_in_flight=max_in_flight, progress=progress,
                                         total=total, **{**options, "pool": self.name})

    def score(self, model: str, query: str | Any, items: Sequence[ItemLike],
              **options: Unpack[ScoreOptions]) -> ScoreResult:
        return self.client.score(model, query, items, **{**options, "pool": self.name})

    def extract(self, model: str, items: Sequence[ItemLike] | str,
                **options: Unpack[ExtractOptions]) -> ExtractResult:
        return self.client.extract(model, items, **{**options, "pool": self.name})

    def wait_for_capacity(self, model: str,
                          provision_timeout_s: float | None = None) -> dict[str, Any]:
        return self.client.wait_for_capacity(model, pool=self.name,
                                             provision_timeout_s=provision_timeout_s)
