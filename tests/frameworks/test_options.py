"""What every integration sends: its options on each request (pool header, priority,
timeout), queries as queries and documents as documents, through the client it was given,
which splits big calls. Read from the requests as they leave for the session's server.
Also: ``import heron_sdk`` imports no framework."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from haystack import Document as HaystackDocument
from langchain_core.documents import Document as LangChainDocument
from llama_index.core.schema import NodeWithScore, TextNode

from heron_sdk import AsyncClient, Client
from heron_sdk.integrations import haystack, langchain, llama_index
from tests.frameworks.conftest import DOCS, QUERY, RERANKER, SIDED, Sent
from tests.support.servers import loaded_after_import

OPTIONS = {"pool": "team-a", "priority": 3, "timeout": 30.0}
# A framework's calls: sync then async, each [query, documents, rerank].
Calls = tuple[Callable[[], object], Callable[[], Awaitable[object]]]


def _langchain(client: Client, aclient: AsyncClient) -> Calls:
    embeddings = langchain.HeronEmbeddings(model=SIDED, client=client, async_client=aclient,
                                           **OPTIONS)
    reranker = langchain.HeronRerank(model=RERANKER, client=client, async_client=aclient,
                                     **OPTIONS)
    docs = [LangChainDocument(page_content=text) for text in DOCS]

    def sync() -> object:
        return (embeddings.embed_query(QUERY), embeddings.embed_documents(DOCS),
                reranker.compress_documents(docs, QUERY))

    async def run_async() -> object:
        return (await embeddings.aembed_query(QUERY), await embeddings.aembed_documents(DOCS),
                await reranker.acompress_documents(docs, QUERY))

    return sync, run_async


def _llama_index(client: Client, aclient: AsyncClient) -> Calls:
    embedding = llama_index.HeronEmbedding(SIDED, client=client, async_client=aclient,
                                           **OPTIONS)
    reranker = llama_index.HeronRerank(RERANKER, client=client, async_client=aclient,
                                       **OPTIONS)
    nodes = [NodeWithScore(node=TextNode(text=text)) for text in DOCS]

    def sync() -> object:
        return (embedding.get_query_embedding(QUERY), embedding.get_text_embedding_batch(DOCS),
                reranker.postprocess_nodes(nodes, query_str=QUERY))

    async def run_async() -> object:
        return (await embedding.aget_query_embedding(QUERY),
                await embedding.aget_text_embedding_batch(DOCS),
                await reranker.apostprocess_nodes(nodes, query_str=QUERY))

    return sync, run_async


def _haystack(client: Client, aclient: AsyncClient) -> Calls:
    text = haystack.HeronTextEmbedder(SIDED, client=client, async_client=aclient, **OPTIONS)
    documents = haystack.HeronDocumentEmbedder(SIDED, client=client, async_client=aclient,
                                               **OPTIONS)
    ranker = haystack.HeronRanker(RERANKER, client=client, async_client=aclient, **OPTIONS)
    docs = [HaystackDocument(content=text) for text in DOCS]

    def sync() -> object:
        return (text.run(QUERY), documents.run(docs), ranker.run(QUERY, docs))

    async def run_async() -> object:
        return (await text.run_async(QUERY), await documents.run_async(docs),
                await ranker.run_async(QUERY, docs))

    return sync, run_async


@pytest.mark.parametrize("framework", [_langchain, _llama_index, _haystack],
                         ids=["langchain", "llama_index", "haystack"])
async def test_options_sides_and_splitting_reach_the_server(
        framework: Callable[[Client, AsyncClient], Calls],
        recording: tuple[Client, AsyncClient, list[Sent]]) -> None:
    client, aclient, sent = recording
    sync, run_async = framework(client, aclient)
    async with aclient:
        sync()
        await run_async()

    # DOCS (5) go in chunks of at most 2 items: the given clients split the calls
    one_pass = ([("/v1/encode/" + SIDED, True, 1)] + [("/v1/encode/" + SIDED, False, n)
                                                    for n in (2, 2, 1)]
                + [("/v1/score/" + RERANKER, None, n) for n in (2, 2, 1)])
    seen = [(s.path, s.body.get("is_query", False) if s.path.startswith("/v1/encode/")
             else None, len(s.body["items"])) for s in sent]
    assert seen == one_pass * 2
    for request in sent:
        assert request.headers["x-heron-pool"] == "team-a"
        assert (request.body["priority"], request.body["timeout_s"]) == (3, 30.0)
    assert all(s.body["query"] == QUERY for s in sent if s.path.startswith("/v1/score/"))


def test_importing_heron_sdk_imports_no_framework() -> None:
    frameworks = ("langchain_core", "llama_index", "haystack", "pydantic")
    assert loaded_after_import(["heron_sdk", "heron_sdk.integrations"], frameworks) == []
    assert loaded_after_import(["heron_sdk.integrations.langchain"],
                               frameworks) == ["langchain_core", "pydantic"]


async def test_async_calls_use_a_given_sync_client_in_a_thread(
        recording: tuple[Client, AsyncClient, list[Sent]]) -> None:
    client, _, sent = recording
    embedding = llama_index.HeronEmbedding(SIDED, client=client)
    assert len(await embedding.aget_text_embedding_batch(DOCS)) == len(DOCS)
    assert [len(s.body["items"]) for s in sent] == [2, 2, 1]  # through the given client
