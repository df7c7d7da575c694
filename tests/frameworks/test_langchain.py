"""LangChain: ``HeronEmbeddings`` passes LangChain's standard embeddings suites (unit, and
integration against the session's `heron serve`), and its vectors are the SDK's own;
``HeronRerank`` orders documents as the SDK's ``score`` does, with the same scores."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from langchain_core.documents import Document
from langchain_tests.integration_tests import EmbeddingsIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests

from heron_sdk import AsyncClient, Client
from heron_sdk.integrations.langchain import HeronEmbeddings, HeronRerank
from tests.frameworks.conftest import DOCS, QUERY, RERANKER, SIDED, Sent, assert_same_vectors


class TestHeronEmbeddingsUnit(EmbeddingsUnitTests):
    """Construction only: nothing is sent, so no server is needed."""

    @property
    def embeddings_class(self) -> type[HeronEmbeddings]:
        return HeronEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"model": "minilm", "base_url": "http://127.0.0.1:9"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return ({"HERON_URL": "http://heron.internal:8080", "HERON_API_KEY": "key-1"},
                {"model": "minilm"},
                {"base_url": "http://heron.internal:8080", "api_key": "key-1"})


class TestHeronEmbeddingsIntegration(EmbeddingsIntegrationTests):
    """Every call goes to the session's `heron serve` (MiniLM)."""

    @pytest.fixture(autouse=True)
    def _live_server(self, base_url: str) -> None:
        # Runs before the suite's ``model`` fixture, which reads embedding_model_params.
        self.base_url = base_url

    @property
    def embeddings_class(self) -> type[HeronEmbeddings]:
        return HeronEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"model": "minilm", "base_url": self.base_url}


# ---- the vectors are the SDK's --------------------------------------------------------------
def test_queries_and_documents_are_the_sdks_vectors(base_url: str, client: Client) -> None:
    embeddings = HeronEmbeddings(model=SIDED, base_url=base_url)
    query = np.asarray(embeddings.embed_query(QUERY), dtype=np.float32)
    assert_same_vectors(query, client.encode(SIDED, [QUERY], is_query=True).dense[0])
    assert_same_vectors(embeddings.embed_documents(DOCS), client.encode(SIDED, DOCS).dense)
    # the sides differ: a query is not embedded as a document
    assert np.abs(query - client.encode(SIDED, [QUERY]).dense[0]).max() > 1e-4


async def test_async_queries_and_documents_are_the_sdks_vectors(base_url: str,
                                                                 client: Client) -> None:
    embeddings = HeronEmbeddings(model=SIDED, base_url=base_url)
    assert_same_vectors(await embeddings.aembed_query(QUERY),
                        client.encode(SIDED, [QUERY], is_query=True).dense[0])
    assert_same_vectors(await embeddings.aembed_documents(DOCS),
                        client.encode(SIDED, DOCS).dense)
    await embeddings.aclose()


async def test_given_clients_split_big_calls(
        recording: tuple[Client, AsyncClient, list[Sent]], client: Client) -> None:
    """Clients of one's own (here: at most 2 items a request) do the batching."""
    small, small_async, sent = recording
    texts = [f"document number {n}" for n in range(7)]
    async with small_async:
        embeddings = HeronEmbeddings(model="minilm", client=small, async_client=small_async)
        sync_vectors = embeddings.embed_documents(texts)
        async_vectors = await embeddings.aembed_documents(texts)
    expected = client.encode("minilm", texts).dense
    assert_same_vectors(sync_vectors, expected)
    assert_same_vectors(async_vectors, expected)
    assert [len(s.body["items"]) for s in sent] == [2, 2, 2, 1] * 2
    assert embeddings.embed_documents([]) == []
    assert len(sent) == 8  # nothing sent for no texts


# ---- reranking --------------------------------------------------------------------------
def _documents() -> list[Document]:
    return [Document(page_content=text, metadata={"n": n}) for n, text in enumerate(DOCS)]


def _check(ranked: list[Document], expected: list[tuple[int, float]]) -> None:
    assert [doc.metadata["n"] for doc in ranked] == [index for index, _ in expected]
    assert [doc.page_content for doc in ranked] == [DOCS[index] for index, _ in expected]
    assert [doc.metadata["relevance_score"] for doc in ranked] == pytest.approx(
        [score for _, score in expected], abs=1e-6)


def test_rerank_orders_as_heron_scores(base_url: str,
                                       reference_ranking: list[tuple[int, float]]) -> None:
    documents = _documents()
    _check(list(HeronRerank(model=RERANKER, base_url=base_url).compress_documents(
        documents, QUERY)), reference_ranking)
    _check(list(HeronRerank(model=RERANKER, base_url=base_url, top_n=2).compress_documents(
        documents, QUERY)), reference_ranking[:2])
    assert "relevance_score" not in documents[0].metadata  # the inputs are left as they were


async def test_async_rerank_orders_as_heron_scores(
        base_url: str, reference_ranking: list[tuple[int, float]]) -> None:
    reranker = HeronRerank(model=RERANKER, base_url=base_url, top_n=3)
    _check(list(await reranker.acompress_documents(_documents(), QUERY)),
           reference_ranking[:3])
    assert list(await reranker.acompress_documents([], QUERY)) == []
