"""LlamaIndex on Heron: ``HeronEmbedding`` (a ``BaseEmbedding``) and ``HeronRerank`` (a
``BaseNodePostprocessor``), sync and async, over the SDK's ``encode`` and ``score``.

``pip install 'heron-sdk[llamaindex]'``; docs/frameworks.md shows them in use.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from heron_sdk.aio import AsyncClient
from heron_sdk.client import Client
from heron_sdk.integrations._heron import HeronCalls

# LlamaIndex cuts a batch at embed_batch_size before calling the model; its largest allowed
# value, so the SDK does the splitting (by items and bytes per request).
MAX_EMBED_BATCH_SIZE = 2048


class _Closing:
    """Closing the clients an object made (given clients stay open)."""

    _calls: HeronCalls

    def close(self) -> None:
        self._calls.close()

    async def aclose(self) -> None:
        await self._calls.aclose()


class HeronEmbedding(_Closing, BaseEmbedding):
    """Dense embeddings from a Heron model (``model_name``): queries are encoded as queries
    (the model's query prompt or instruction, if it has one), texts as documents.

    ``client``/``async_client`` are existing SDK clients to use instead of ``base_url`` and
    ``api_key`` (default: ``$HERON_URL``, ``$HERON_API_KEY``)."""

    base_url: str | None = Field(default=None, description="Heron's URL")
    api_key: str | None = Field(default=None, exclude=True)
    pool: str | None = Field(default=None, description="route to this pool (cluster only)")
    priority: int = Field(default=0, description="0 is the highest")
    timeout: float | None = Field(default=None, description="seconds per call, retries in")

    _calls: HeronCalls = PrivateAttr()

    def __init__(self, model: str | None = None, *, client: Client | None = None,
                 async_client: AsyncClient | None = None,
                 embed_batch_size: int = MAX_EMBED_BATCH_SIZE, **kwargs: Any) -> None:
        model = model or kwargs.pop("model_name", None)  # from_dict passes model_name
        if not model:
            raise TypeError("HeronEmbedding needs a model")
        super().__init__(model_name=model, embed_batch_size=embed_batch_size, **kwargs)
        self._calls = HeronCalls(model, base_url=self.base_url, api_key=self.api_key,
                                 client=client, async_client=async_client, pool=self.pool,
                                 priority=self.priority, timeout=self.timeout)

    @classmethod
    def class_name(cls) -> str:
        return "HeronEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._calls.embed([query], is_query=True)[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await self._calls.aembed([query], is_query=True))[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._calls.embed([text], is_query=False)[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self._calls.aembed([text], is_query=False))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._calls.embed(texts, is_query=False)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await self._calls.aembed(texts, is_query=False)


class HeronRerank(_Closing, BaseNodePostprocessor):
    """Nodes reordered by a Heron reranker (cross-encoder) against the query, best first,
    each with its score; ``top_n`` keeps that many (None: all). The text scored is a node's
    content as LlamaIndex embeds it (``MetadataMode.EMBED``)."""

    model: str = Field(description="a reranker's model id or alias")
    top_n: int | None = Field(default=None, description="how many to keep (None: all)")
    base_url: str | None = Field(default=None, description="Heron's URL")
    api_key: str | None = Field(default=None, exclude=True)
    pool: str | None = Field(default=None, description="route to this pool (cluster only)")
    priority: int = Field(default=0, description="0 is the highest")
    timeout: float | None = Field(default=None, description="seconds per call, retries in")

    _calls: HeronCalls = PrivateAttr()

    def __init__(self, model: str, *, client: Client | None = None,
                 async_client: AsyncClient | None = None, **kwargs: Any) -> None:
        super().__init__(model=model, **kwargs)
        self._calls = HeronCalls(model, base_url=self.base_url, api_key=self.api_key,
                                 client=client, async_client=async_client, pool=self.pool,
                                 priority=self.priority, timeout=self.timeout)

    @classmethod
    def class_name(cls) -> str:
        return "HeronRerank"

    @staticmethod
    def _inputs(nodes: list[NodeWithScore],
                query_bundle: QueryBundle | None) -> tuple[str, list[str]]:
        if query_bundle is None:
            raise ValueError("HeronRerank needs the query (query_bundle or query_str)")
        return query_bundle.query_str, [n.node.get_content(metadata_mode=MetadataMode.EMBED)
                                        for n in nodes]

    @staticmethod
    def _ranked(nodes: list[NodeWithScore],
                ranking: list[tuple[int, float]]) -> list[NodeWithScore]:
        return [NodeWithScore(node=nodes[index].node, score=score) for index, score in ranking]

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        query, texts = self._inputs(nodes, query_bundle)
        return self._ranked(nodes, self._calls.rank(query, texts, self.top_n))

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None
                                  ) -> list[NodeWithScore]:
        query, texts = self._inputs(nodes, query_bundle)
        return self._ranked(nodes, await self._calls.arank(query, texts, self.top_n))
