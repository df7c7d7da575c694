"""LangChain on Heron: ``HeronEmbeddings`` (an ``Embeddings``) and ``HeronRerank`` (a
``BaseDocumentCompressor``), sync and async, over the SDK's ``encode`` and ``score``.

``pip install 'heron-sdk[langchain]'``; docs/frameworks.md shows them in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.embeddings import Embeddings
from langchain_core.utils import secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from heron_sdk.aio import AsyncClient
from heron_sdk.client import Client, default_url
from heron_sdk.integrations._heron import HeronCalls


class _HeronSettings(BaseModel):
    """The options both classes take; set them when constructing (later changes are not
    seen by the connection)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    model: str  # a model id or alias the server knows
    base_url: str = Field(default_factory=default_url)  # $HERON_URL, else 127.0.0.1:8080
    api_key: SecretStr | None = Field(default_factory=secret_from_env("HERON_API_KEY",
                                                                      default=None))
    client: Client | None = Field(default=None, exclude=True)  # instead of base_url/api_key
    async_client: AsyncClient | None = Field(default=None, exclude=True)
    pool: str | None = None  # route to this pool (cluster only)
    priority: int = 0  # 0 is the highest
    timeout: float | None = None  # seconds per call, retries included (None: the client's)

    _calls: HeronCalls = PrivateAttr()

    def model_post_init(self, context: Any, /) -> None:
        self._calls = HeronCalls(
            self.model, base_url=self.base_url,
            api_key=self.api_key.get_secret_value() if self.api_key else None,
            client=self.client, async_client=self.async_client, pool=self.pool,
            priority=self.priority, timeout=self.timeout)

    def close(self) -> None:
        """Close the client made here (given clients stay open)."""
        self._calls.close()

    async def aclose(self) -> None:
        """Close the clients made here, sync and async (given clients stay open)."""
        await self._calls.aclose()


class HeronEmbeddings(_HeronSettings, Embeddings):
    """Dense embeddings from a Heron model: queries are encoded as queries (the model's
    query prompt or instruction, if it has one), documents as documents."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._calls.embed(texts, is_query=False)

    def embed_query(self, text: str) -> list[float]:
        return self._calls.embed([text], is_query=True)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self._calls.aembed(texts, is_query=False)

    async def aembed_query(self, text: str) -> list[float]:
        return (await self._calls.aembed([text], is_query=True))[0]


class HeronRerank(_HeronSettings, BaseDocumentCompressor):
    """Documents reordered by a Heron reranker (cross-encoder), best first, each with its
    score in ``metadata["relevance_score"]``; ``top_n`` keeps that many (None: all)."""

    top_n: int | None = None

    def _ranked(self, documents: Sequence[Document],
                ranking: list[tuple[int, float]]) -> list[Document]:
        return [documents[index].model_copy(update={"metadata": {
            **documents[index].metadata, "relevance_score": score}})
            for index, score in ranking]

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        texts = [doc.page_content for doc in documents]
        return self._ranked(documents, self._calls.rank(query, texts, self.top_n))

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Callbacks | None = None) -> Sequence[Document]:
        texts = [doc.page_content for doc in documents]
        return self._ranked(documents, await self._calls.arank(query, texts, self.top_n))
