"""LlamaIndex: ``HeronEmbedding``'s query, text and batch embeddings, sync and async, are
the SDK's own vectors for the query and document sides; ``HeronRerank`` orders nodes as
the SDK's ``score`` does, with the same scores."""

from __future__ import annotations

import numpy as np
import pytest
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from heron_sdk import Client
from heron_sdk.integrations.llama_index import HeronEmbedding, HeronRerank
from tests.frameworks.conftest import DOCS, QUERY, RERANKER, SIDED, assert_same_vectors


@pytest.fixture(scope="module")
def expected(client: Client) -> tuple[np.ndarray, np.ndarray]:
    """The SDK's query vector of QUERY and document vectors of DOCS."""
    return (client.encode(SIDED, [QUERY], is_query=True).dense[0],
            client.encode(SIDED, DOCS).dense)


def test_embeddings_are_the_sdks_vectors(base_url: str,
                                         expected: tuple[np.ndarray, np.ndarray]) -> None:
    query, documents = expected
    embedding = HeronEmbedding(SIDED, base_url=base_url)
    assert_same_vectors(embedding.get_query_embedding(QUERY), query)
    assert_same_vectors(embedding.get_text_embedding(DOCS[0]), documents[0])
    assert_same_vectors(embedding.get_text_embedding_batch(DOCS), documents)
    as_text = np.asarray(embedding.get_text_embedding(QUERY), dtype=np.float32)
    assert np.abs(as_text - query).max() > 1e-4  # a text is embedded as a document
    embedding.close()


async def test_async_embeddings_are_the_sdks_vectors(
        base_url: str, expected: tuple[np.ndarray, np.ndarray]) -> None:
    query, documents = expected
    embedding = HeronEmbedding(SIDED, base_url=base_url)
    assert_same_vectors(await embedding.aget_query_embedding(QUERY), query)
    assert_same_vectors(await embedding.aget_text_embedding(DOCS[0]), documents[0])
    assert_same_vectors(await embedding.aget_text_embedding_batch(DOCS), documents)
    await embedding.aclose()


def test_serialized_embedding_comes_back_the_same(base_url: str) -> None:
    embedding = HeronEmbedding(SIDED, base_url=base_url, priority=2, api_key="secret")
    data = embedding.to_dict()
    assert "api_key" not in data  # never written out
    again = HeronEmbedding.from_dict(data)
    assert (again.model_name, again.base_url, again.priority) == (SIDED, base_url, 2)
    assert again.embed_batch_size == 2048  # LlamaIndex's largest: the SDK splits


def _nodes() -> list[NodeWithScore]:
    return [NodeWithScore(node=TextNode(text=text, id_=f"doc-{n}"), score=0.0)
            for n, text in enumerate(DOCS)]


def _check(ranked: list[NodeWithScore], expected: list[tuple[int, float]]) -> None:
    assert [n.node.node_id for n in ranked] == [f"doc-{i}" for i, _ in expected]
    assert [n.score for n in ranked] == pytest.approx([s for _, s in expected], abs=1e-6)


def test_rerank_orders_as_heron_scores(base_url: str,
                                       reference_ranking: list[tuple[int, float]]) -> None:
    nodes = _nodes()
    _check(HeronRerank(RERANKER, base_url=base_url).postprocess_nodes(nodes, query_str=QUERY),
           reference_ranking)
    top = HeronRerank(RERANKER, base_url=base_url, top_n=2)
    _check(top.postprocess_nodes(nodes, QueryBundle(QUERY)), reference_ranking[:2])
    assert all(n.score == 0.0 for n in nodes)  # the inputs are left as they were
    with pytest.raises(ValueError, match="query"):
        top.postprocess_nodes(nodes)


async def test_async_rerank_orders_as_heron_scores(
        base_url: str, reference_ranking: list[tuple[int, float]]) -> None:
    reranker = HeronRerank(RERANKER, base_url=base_url, top_n=3)
    _check(await reranker.apostprocess_nodes(_nodes(), query_str=QUERY), reference_ranking[:3])
    assert await reranker.apostprocess_nodes([], query_str=QUERY) == []
    await reranker.aclose()
