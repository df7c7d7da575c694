"""``AsyncClient``: the ``Client`` API for asyncio. The chunks of a split call run
concurrently (a few at a time), ``encode_stream`` runs its requests as tasks
(sdk/streaming.py); pool leases renew in a task."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, Unpack

import httpx

from heron_sdk.calls import (
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
from heron_sdk.client import PoolLeaseState, _builder, default_url
from heron_sdk.errors import HeronError, PoolError
from heron_sdk.jobs import AsyncJobs
from heron_sdk.pools import DEFAULT_TTL_S
from heron_sdk.results import EncodedChunk, EncodeResult, ExtractResult, ScoreResult
from heron_sdk.streaming import DEFAULT_MAX_IN_FLIGHT, EncodeStream, ProgressBar

# Chunks of one split call in flight at once: enough to keep a server busy, not a flood.
MAX_CONCURRENT_CHUNKS = 4


class AsyncClient:
    """``async with AsyncClient("http://127.0.0.1:8080") as client: ...`` (see ``Client``)."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 wire: str = "msgpack", timeout: float = 60.0,
                 wait_for_capacity: bool = True, provision_timeout_s: float = 300.0,
                 max_items_per_request: int | None = None,
                 http: httpx.AsyncClient | None = None) -> None:
        self.base_url = (base_url or default_url()).rstrip("/")
        self._b = _builder(wire, api_key, timeout, wait_for_capacity,
                           provision_timeout_s, max_items_per_request)
        self._http = http or httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        # Bulk jobs (cluster gateway only): await client.jobs.create(...), job.wait()
        self.jobs = AsyncJobs(lambda method, path, body, ok: self._run(
            self._b.request(method, path, body, ok=ok)))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # ---- I/O ---------------------------------------------------------------------------------
    async def _send(self, call: HttpCall) -> Reply:
        content = None if call.body is None else self._b.encode_body(call.body)
        response = await self._http.request(call.method, call.path, content=content,
                                            headers=call.headers, timeout=call.timeout_s)
        return decode_reply(response.status_code, response.headers, response.content)

    async def _run(self, call: HttpCall, policy: CallPolicy | None = None) -> Any:
        plan: Generator[HttpCall | float, Reply | Exception | None, Reply] = attempts(
            call, policy or self._b.policy)
        step = next(plan)
        while True:
            outcome: Reply | Exception | None = None
            if isinstance(step, HttpCall):
                try:
                    outcome = await self._send(step)
                except httpx.TransportError as exc:
                    outcome = exc
            else:
                await asyncio.sleep(step)
            try:
                step = plan.send(outcome)
            except StopIteration as done:
                return done.value.body

    async def _run_split(self, split: tuple[SplitCall, CallPolicy]) -> Any:
        calls, policy = split
        gate = asyncio.Semaphore(MAX_CONCURRENT_CHUNKS)

        async def one(call: HttpCall) -> Any:
            async with gate:
                return await self._run(call, policy)

        return calls.finish(await asyncio.gather(*(one(c) for c in calls.calls)))

    # ---- inference -------------------------------------------------------------------------
    async def encode(self, model: str,
                     items: Iterable[ItemLike] | AsyncIterable[ItemLike] | str, *,
                     progress: bool | ProgressBar = False,
                     **options: Unpack[EncodeOptions]) -> EncodeResult:
        """See ``Client.encode``; ``items`` may also be an async iterable."""
        if isinstance(items, str | Sequence) and not progress:
            return await self._run_split(self._b.encode(model, items, options))
        return EncodeResult.joined([chunk.result async for chunk in self.encode_stream(
            model, items, progress=progress, **options)])

    def encode_stream(self, model: str,
                      items: Iterable[ItemLike] | AsyncIterable[ItemLike] | str, *,
                      chunk_size: int | None = None,
                      max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                      progress: bool | ProgressBar = False, total: int | None = None,
                      **options: Unpack[EncodeOptions]) -> AsyncIterator[EncodedChunk]:
        """``async for chunk in client.encode_stream(model, items): ...`` (see
        ``Client.encode_stream``): up to ``max_in_flight`` requests run as tasks, and
        stopping early (``break`` inside ``contextlib.aclosing``, or an error) cancels the
        rest. ``items`` may be an iterable or an async iterable."""
        stream = EncodeStream(self._b, model, items, chunk_size=chunk_size,
                              max_in_flight=max_in_flight, progress=progress, total=total,
                              options=options)
        return stream.run_async(self._run_split)

    async def score(self, model: str, query: str | Any, items: Sequence[ItemLike],
                    **options: Unpack[ScoreOptions]) -> ScoreResult:
        return await self._run_split(self._b.score(model, query, items, options))

    async def extract(self, model: str, items: Sequence[ItemLike] | str,
                      **options: Unpack[ExtractOptions]) -> ExtractResult:
        return await self._run_split(self._b.extract(model, items, options))

    # ---- models and capacity ---------------------------------------------------------------
    async def list_models(self, *, pool: str | None = None) -> list[dict[str, Any]]:
        return (await self._run(self._b.request("GET", "/v1/models", pool=pool)))["data"]

    async def get_model(self, model: str, *, pool: str | None = None) -> dict[str, Any]:
        return await self._run(self._b.request("GET", f"/v1/models/{model}", pool=pool))

    async def wait_for_capacity(self, model: str, *, pool: str | None = None,
                                provision_timeout_s: float | None = None) -> dict[str, Any]:
        return await self._run(
            self._b.request("POST", f"/v1/models/{model}/provision", {}, pool=pool),
            self._b.call_policy(wait_for_capacity=True,
                                provision_timeout_s=provision_timeout_s))

    # ---- pools -------------------------------------------------------------------------------
    async def create_pool(self, name: str, bundle: str, *, workers: int = 1,
                          ttl_s: float = DEFAULT_TTL_S) -> dict[str, Any]:
        body = {"name": name, "bundle": bundle, "workers": workers, "ttl_s": ttl_s}
        return await self._run(self._b.request("POST", "/v1/pools", body, ok=(201,)))

    async def get_pool(self, name: str) -> dict[str, Any]:
        return await self._run(self._b.request("GET", f"/v1/pools/{name}"))

    async def list_pools(self) -> list[dict[str, Any]]:
        return (await self._run(self._b.request("GET", "/v1/pools")))["data"]

    async def renew_pool(self, name: str, ttl_s: float | None = None) -> dict[str, Any]:
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        return await self._run(self._b.request("POST", f"/v1/pools/{name}/renew", body))

    async def delete_pool(self, name: str) -> dict[str, Any]:
        return await self._run(self._b.request("DELETE", f"/v1/pools/{name}"))

    def pool(self, name: str, bundle: str, *, workers: int = 1, ttl_s: float = 60.0,
             renew_every_s: float | None = None) -> AsyncPool:
        """``async with client.pool(...) as pool:`` (see ``Client.pool``)."""
        return AsyncPool(self, name, bundle, workers=workers, ttl_s=ttl_s,
                         renew_every_s=renew_every_s)


class AsyncPool(PoolLeaseState):
    def __init__(self, client: AsyncClient, name: str, bundle: str, *, workers: int,
                 ttl_s: float, renew_every_s: float | None) -> None:
        super().__init__(name, bundle, workers, ttl_s, renew_every_s)
        self.client = client
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncPool:
        self.lease = await self.client.create_pool(self.name, self.bundle,
                                                   workers=self.workers, ttl_s=self.ttl_s)
        self._task = asyncio.get_running_loop().create_task(self._renew_loop())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every_s)
            try:
                self.renewed(await self.client.renew_pool(self.name, self.ttl_s))
            except HeronError as exc:
                if self.renewal_failed(exc):
                    return

    async def stop_renewing(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def close(self) -> None:
        await self.stop_renewing()
        if not self.lost:
            with contextlib.suppress(PoolError):  # already gone: expired or deleted
                await self.client.delete_pool(self.name)
            self.lost = True

    async def info(self) -> dict[str, Any]:
        return await self.client.get_pool(self.name)

    async def encode(self, model: str,
                     items: Iterable[ItemLike] | AsyncIterable[ItemLike] | str, *,
                     progress: bool | ProgressBar = False,
                     **options: Unpack[EncodeOptions]) -> EncodeResult:
        return await self.client.encode(model, items, progress=progress,
                                        **{**options, "pool": self.name})

    def encode_stream(self, model: str,
                      items: Iterable[ItemLike] | AsyncIterable[ItemLike] | str, *,
                      chunk_size: int | None = None,
                      max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                      progress: bool | ProgressBar = False, total: int | None = None,
                      **options: Unpack[EncodeOptions]) -> AsyncIterator[EncodedChunk]:
        return self.client.encode_stream(model, items, chunk_size=chunk_size,
                                         max_in_flight=max_in_flight, progress=progress,
                                         total=total, **{**options, "pool": self.name})

    async def score(self, model: str, query: str | Any, items: Sequence[ItemLike],
                    **options: Unpack[ScoreOptions]) -> ScoreResult:
        return await self.client.score(model, query, items, **{**options, "pool": self.name})

    async def extract(self, model: str, items: Sequence[ItemLike] | str,
                      **options: Unpack[ExtractOptions]) -> ExtractResult:
        return await self.client.extract(model, items, **{**options, "pool": self.name})

    async def wait_for_capacity(self, model: str,
                                provision_timeout_s: float | None = None) -> dict[str, Any]:
        return await self.client.wait_for_capacity(model, pool=self.name,
                                                   provision_timeout_s=provision_timeout_s)
