"""Haystack: ``HeronTextEmbedder`` and ``HeronDocumentEmbedder`` give the SDK's own vectors
(query and document sides), ``HeronRanker`` orders documents as the SDK's ``score`` does,
with ``run`` and ``run_async``, alone and in indexing and query pipelines."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from haystack import Document, Pipeline
from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
from haystack.components.writers import DocumentWriter
from haystack.document_stores.in_memory import InMemoryDocumentStore
from haystack.utils import Secret

from heron_sdk import Client
from heron_sdk.integrations.haystack import (
    HeronDocumentEmbedder,
    HeronRanker,
    HeronTextEmbedder,
)
from tests.frameworks.conftest import DOCS, QUERY, RERANKER, SIDED, assert_same_vectors

try:  # haystack-ai 2.x runs pipelines asynchronously in a class of its own
    from haystack import AsyncPipeline  # type: ignore[attr-defined]
except ImportError:  # 3.x: Pipeline.run_async
    AsyncPipeline = Pipeline


@pytest.fixture(scope="module")
def expected(client: Client) -> tuple[np.ndarray, np.ndarray]:
    return (client.encode(SIDED, [QUERY], is_query=True).dense[0],
            client.encode(SIDED, DOCS).dense)


def _documents() -> list[Document]:
    return [Document(id=f"doc-{n}", content=text) for n, text in enumerate(DOCS)]


def _vectors(documents: list[Document]) -> np.ndarray:
    return np.asarray([d.embedding for d in documents], dtype=np.float32)


def test_embedders_give_the_sdks_vectors(base_url: str, client: Client,
                                         expected: tuple[np.ndarray, np.ndarray]) -> None:
    query, documents = expected
    assert_same_vectors(HeronTextEmbedder(SIDED, base_url=base_url).run(QUERY)["embedding"],
                        query)
    as_document = HeronTextEmbedder(SIDED, base_url=base_url, is_query=False).run(QUERY)
    assert_same_vectors(as_document["embedding"], client.encode(SIDED, [QUERY]).dense[0])
    assert np.abs(np.asarray(as_document["embedding"]) - query).max() > 1e-4

    inputs = _documents()
    embedded = HeronDocumentEmbedder(SIDED, base_url=base_url).run(inputs)["documents"]
    assert_same_vectors(_vectors(embedded), documents)
    assert [d.id for d in embedded] == [d.id for d in inputs]
    assert all(d.embedding is None for d in inputs)  # copies; the inputs are left alone


async def test_async_embedders_give_the_sdks_vectors(
        base_url: str, expected: tuple[np.ndarray, np.ndarray]) -> None:
    query, documents = expected
    embedder = HeronTextEmbedder(SIDED, base_url=base_url)
    assert_same_vectors((await embedder.run_async(QUERY))["embedding"], query)
    document_embedder = HeronDocumentEmbedder(SIDED, base_url=base_url)
    embedded = (await document_embedder.run_async(_documents()))["documents"]
    assert_same_vectors(_vectors(embedded), documents)
    await embedder.close_async()
    await document_embedder.close_async()


def _check(ranked: list[Document], expected: list[tuple[int, float]]) -> None:
    assert [d.id for d in ranked] == [f"doc-{i}" for i, _ in expected]
    assert [d.score for d in ranked] == pytest.approx([s for _, s in expected], abs=1e-6)


def test_ranker_orders_as_heron_scores(base_url: str,
                                       reference_ranking: list[tuple[int, float]]) -> None:
    ranker = HeronRanker(RERANKER, base_url=base_url)
    _check(ranker.run(QUERY, _documents())["documents"], reference_ranking)
    _check(ranker.run(QUERY, _documents(), top_k=2)["documents"], reference_ranking[:2])
    _check(HeronRanker(RERANKER, base_url=base_url, top_k=1).run(QUERY, _documents())[
        "documents"], reference_ranking[:1])
    assert ranker.run(QUERY, [])["documents"] == []


async def test_async_ranker_orders_as_heron_scores(
        base_url: str, reference_ranking: list[tuple[int, float]]) -> None:
    ranker = HeronRanker(RERANKER, base_url=base_url)
    _check((await ranker.run_async(QUERY, _documents(), top_k=3))["documents"],
           reference_ranking[:3])
    await ranker.close_async()


def _pipelines(base_url: str, store: InMemoryDocumentStore,
               pipeline: type[Pipeline]) -> tuple[Pipeline, Pipeline]:
    indexing = pipeline()
    indexing.add_component("embedder", HeronDocumentEmbedder(SIDED, base_url=base_url))
    indexing.add_component("writer", DocumentWriter(store))
    indexing.connect("embedder.documents", "writer.documents")
    query = pipeline()
    query.add_component("embedder", HeronTextEmbedder(SIDED, base_url=base_url))
    query.add_component("retriever", InMemoryEmbeddingRetriever(store, top_k=len(DOCS)))
    query.add_component("ranker", HeronRanker(RERANKER, base_url=base_url, top_k=3))
    query.connect("embedder.embedding", "retriever.query_embedding")
    query.connect("retriever.documents", "ranker.documents")
    return indexing, query


def test_pipelines_index_retrieve_and_rerank(
        base_url: str, expected: tuple[np.ndarray, np.ndarray],
        reference_ranking: list[tuple[int, float]]) -> None:
    store = InMemoryDocumentStore()
    indexing, query = _pipelines(base_url, store, Pipeline)
    assert indexing.run({"embedder": {"documents": _documents()}})["writer"][
        "documents_written"] == len(DOCS)
    stored = sorted(store.filter_documents(), key=lambda d: d.id)
    assert_same_vectors(_vectors(stored), expected[1])
    answer = query.run({"embedder": {"text": QUERY}, "ranker": {"query": QUERY}})
    _check(answer["ranker"]["documents"], reference_ranking[:3])

    # the components serialize and load back (Haystack 3 loads only modules it is told to)
    trusted = ({"allowed_modules": ["heron_sdk.integrations.haystack"]}
               if "allowed_modules" in inspect.signature(Pipeline.loads).parameters else {})
    saved = Pipeline.loads(query.dumps(), **trusted)
    assert saved.get_component("ranker").to_dict() == query.get_component("ranker").to_dict()


async def test_async_pipelines_index_retrieve_and_rerank(
        base_url: str, reference_ranking: list[tuple[int, float]]) -> None:
    store = InMemoryDocumentStore()
    indexing, query = _pipelines(base_url, store, AsyncPipeline)
    await indexing.run_async({"embedder": {"documents": _documents()}})
    assert store.count_documents() == len(DOCS)
    answer = await query.run_async({"embedder": {"text": QUERY}, "ranker": {"query": QUERY}})
    _check(answer["ranker"]["documents"], reference_ranking[:3])


def test_api_key_is_saved_by_name_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERON_API_KEY", "key-1")
    data = HeronTextEmbedder("minilm").to_dict()
    assert "key-1" not in str(data)
    assert data["init_parameters"]["api_key"]["env_vars"] == ["HERON_API_KEY"]
    assert HeronTextEmbedder.from_dict(data).api_key == Secret.from_env_var(
        "HERON_API_KEY", strict=False)
