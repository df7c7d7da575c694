"""Haystack on Heron: ``HeronTextEmbedder``, ``HeronDocumentEmbedder`` and ``HeronRanker``
components, with ``run`` and ``run_async``, over the SDK's ``encode`` and ``score``.

``pip install 'heron-sdk[haystack]'``; docs/frameworks.md shows them in use.
"""

# No `from __future__ import annotations`: older Haystack 2.x (2.12, the oldest supported)
# takes the run methods' annotations as they are, and a string is not a type to it.
from dataclasses import replace
from typing import Any, Self, TypedDict, Unpack

from haystack import Document, component, default_from_dict, default_to_dict
from haystack.utils import Secret, deserialize_secrets_inplace

from heron_sdk.aio import AsyncClient
from heron_sdk.client import Client
from heron_sdk.integrations._heron import HeronCalls


class HeronOptions(TypedDict, total=False):
    base_url: str | None  # Heron's URL (default: $HERON_URL, else 127.0.0.1:8080)
    api_key: Secret | None  # default: $HERON_API_KEY, if set
    pool: str | None  # route to this pool (cluster only)
    priority: int  # 0 is the highest
    timeout: float | None  # seconds per call, retries included (None: the client's)
    client: Client | None  # an existing client instead of base_url and api_key
    async_client: AsyncClient | None  # the same for run_async


class _HeronComponent:
    """What the three components share: options, serialization (clients are not saved)
    and closing the clients they made. ``@component`` rebuilds each class, so they call
    this one by name, not with ``super()``."""

    def __init__(self, model: str, **options: Unpack[HeronOptions]) -> None:
        self.model = model
        self.base_url = options.get("base_url")
        self.api_key = options.get("api_key", Secret.from_env_var("HERON_API_KEY",
                                                                   strict=False))
        self.pool = options.get("pool")
        self.priority = options.get("priority", 0)
        self.timeout = options.get("timeout")
        self._calls = HeronCalls(
            model, base_url=self.base_url,
            api_key=self.api_key.resolve_value() if self.api_key else None,
            client=options.get("client"), async_client=options.get("async_client"),
            pool=self.pool, priority=self.priority, timeout=self.timeout)

    def _init_parameters(self) -> dict[str, Any]:
        return {"model": self.model, "base_url": self.base_url,
                "api_key": self.api_key.to_dict() if self.api_key else None,
                "pool": self.pool, "priority": self.priority, "timeout": self.timeout}

    def to_dict(self) -> dict[str, Any]:
        return default_to_dict(self, **self._init_parameters())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        deserialize_secrets_inplace(data["init_parameters"], keys=["api_key"])
        return default_from_dict(cls, data)

    def close(self) -> None:
        self._calls.close()

    async def close_async(self) -> None:
        await self._calls.aclose()


@component
class HeronTextEmbedder(_HeronComponent):
    """Embeds one text, by default as a query (``is_query=False``: as a document)."""

    def __init__(self, model: str, *, is_query: bool = True,
                 **options: Unpack[HeronOptions]) -> None:
        _HeronComponent.__init__(self, model, **options)
        self.is_query = is_query

    def _init_parameters(self) -> dict[str, Any]:
        return {**_HeronComponent._init_parameters(self), "is_query": self.is_query}

    @component.output_types(embedding=list[float])
    def run(self, text: str) -> dict[str, Any]:
        return {"embedding": self._calls.embed([text], is_query=self.is_query)[0]}

    @component.output_types(embedding=list[float])
    async def run_async(self, text: str) -> dict[str, Any]:
        return {"embedding": (await self._calls.aembed([text], is_query=self.is_query))[0]}


@component
class HeronDocumentEmbedder(_HeronComponent):
    """Embeds documents' content as documents; returns copies with ``embedding`` set."""

    @component.output_types(documents=list[Document])
    def run(self, documents: list[Document]) -> dict[str, Any]:
        vectors = self._calls.embed([d.content or "" for d in documents], is_query=False)
        return {"documents": [replace(d, embedding=v) for d, v in zip(documents, vectors,
                                                                       strict=True)]}

    @component.output_types(documents=list[Document])
    async def run_async(self, documents: list[Document]) -> dict[str, Any]:
        vectors = await self._calls.aembed([d.content or "" for d in documents],
                                           is_query=False)
        return {"documents": [replace(d, embedding=v) for d, v in zip(documents, vectors,
                                                                       strict=True)]}


@component
class HeronRanker(_HeronComponent):
    """Documents reordered by a Heron reranker (cross-encoder) against the query, best
    first, as copies with ``score`` set; ``top_k`` keeps that many (None: all)."""

    def __init__(self, model: str, *, top_k: int | None = None,
                 **options: Unpack[HeronOptions]) -> None:
        _HeronComponent.__init__(self, model, **options)
        self.top_k = top_k

    def _init_parameters(self) -> dict[str, Any]:
        return {**_HeronComponent._init_parameters(self), "top_k": self.top_k}

    @staticmethod
    def _ranked(documents: list[Document],
                ranking: list[tuple[int, float]]) -> dict[str, Any]:
        return {"documents": [replace(documents[i], score=score) for i, score in ranking]}

    @component.output_types(documents=list[Document])
    def run(self, query: str, documents: list[Document],
            top_k: int | None = None) -> dict[str, Any]:
        texts = [d.content or "" for d in documents]
        return self._ranked(documents, self._calls.rank(query, texts, top_k or self.top_k))

    @component.output_types(documents=list[Document])
    async def run_async(self, query: str, documents: list[Document],
                        top_k: int | None = None) -> dict[str, Any]:
        texts = [d.content or "" for d in documents]
        return self._ranked(documents,
                            await self._calls.arank(query, texts, top_k or self.top_k))
