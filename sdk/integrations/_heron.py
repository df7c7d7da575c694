"""What the framework integrations share: the Heron calls they make (``encode`` for
embeddings, ``score`` for reranking), sync and async, with the options every integration
takes. It imports no framework.

The SDK splits big calls itself (items and bytes per request) and ranks split ``score``
calls again over all documents, so nothing here batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from heron_sdk.aio import AsyncClient
from heron_sdk.client import Client


class HeronCalls:
    """One integration's connection to Heron and its call options.

    ``client``/``async_client``: existing clients to use (they stay the caller's to close).
    Without ``client``, one is made from ``base_url`` and ``api_key`` (default:
    ``$HERON_URL`` and ``$HERON_API_KEY``) on first use. Async calls use ``async_client``;
    without it, the given ``client`` in a thread; without either, an ``AsyncClient`` made
    for the running event loop (httpx connections belong to the loop that opened them).
    """

    def __init__(self, model: str, *, base_url: str | None = None,
                 api_key: str | None = None, client: Client | None = None,
                 async_client: AsyncClient | None = None, pool: str | None = None,
                 priority: int = 0, timeout: float | None = None) -> None:
        self.model = model
        self.base_url, self.api_key = base_url, api_key
        self._client, self._own_client = client, client is None
        self._given_async = async_client
        self._async: AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.options: dict[str, Any] = {"priority": priority, "pool": pool}
        if timeout is not None:
            self.options["timeout"] = timeout

    @property
    def client(self) -> Client:
        if self._client is None:
            if self._given_async is not None and self.base_url is None:
                raise TypeError("sync calls need a client= or base_url= too "
                                "(only an async_client was given)")
            self._client = Client(self.base_url, api_key=self.api_key)
        return self._client

    def _async_client(self) -> AsyncClient | None:
        """The async client for this loop; None: run the given sync client in a thread."""
        if self._given_async is not None:
            return self._given_async
        if not self._own_client:
            return None
        loop = asyncio.get_running_loop()
        if self._async is None or self._loop is not loop:
            self._async, self._loop = AsyncClient(self.base_url, api_key=self.api_key), loop
        return self._async

    # ---- embeddings ----------------------------------------------------------------------
    def embed(self, texts: Sequence[str], *, is_query: bool) -> list[list[float]]:
        """One dense vector per text, in order (queries with ``is_query=True``)."""
        if not texts:
            return []
        result = self.client.encode(self.model, list(texts), is_query=is_query,
                                    **self.options)
        return result.dense.tolist()

    async def aembed(self, texts: Sequence[str], *, is_query: bool) -> list[list[float]]:
        if not texts:
            return []
        client = self._async_client()
        if client is None:
            return await asyncio.to_thread(self.embed, texts, is_query=is_query)
        result = await client.encode(self.model, list(texts), is_query=is_query,
                                     **self.options)
        return result.dense.tolist()

    # ---- reranking -----------------------------------------------------------------------
    def rank(self, query: str, texts: Sequence[str],
             top_k: int | None = None) -> list[tuple[int, float]]:
        """(index into ``texts``, score) best first, ``top_k`` of them (None: all)."""
        if not texts:
            return []
        result = self.client.score(self.model, query, list(texts), top_k=top_k,
                                   **self.options)
        return [(r.index, r.score) for r in result]

    async def arank(self, query: str, texts: Sequence[str],
                    top_k: int | None = None) -> list[tuple[int, float]]:
        if not texts:
            return []
        client = self._async_client()
        if client is None:
            return await asyncio.to_thread(self.rank, query, texts, top_k)
        result = await client.score(self.model, query, list(texts), top_k=top_k,
                                    **self.options)
        return [(r.index, r.score) for r in result]

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Close the sync client this object made (given clients stay open)."""
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        """Close the clients this object made (given clients stay open)."""
        self.close()
        if self._async is not None:
            await self._async.close()
            self._async = self._loop = None
