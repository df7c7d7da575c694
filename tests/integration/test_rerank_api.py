"""The official `cohere` client reranks through /v2/rerank and /v1/rerank, on `heron serve`
and through the gateway, and gets what Heron's own /v1/score gives; Jina's body shape is
answered on /v1/rerank; errors come in Cohere's shape with its statuses."""

from __future__ import annotations

from collections.abc import Iterator

import cohere
import pytest

from tests.support import local_http

QUERY = "where do herons nest?"
DOCUMENTS = ["Herons nest in colonies near water.", "The stock market fell today.",
             "Grey herons build nests high in trees.", "x", "Recipes for lemon cake."]
# The model's own task decides how it ranks: pairs, cosine, MaxSim.
MODELS = ["tiny-cross-encoder", "minilm", "tiny-multi-vector"]


@pytest.fixture(params=["serve", "gateway"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("base_url" if request.param == "serve" else "cluster_url")


@pytest.fixture()
def co(url: str) -> Iterator[cohere.ClientV2]:
    client = cohere.ClientV2(api_key="unused", base_url=url, timeout=60)
    yield client


def same_ranking(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [i for i, _ in got] == [i for i, _ in expected]
    assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-6)


def heron_score(url: str, model: str, **extra: object) -> list[tuple[int, float]]:
    r = local_http.post(f"{url}/v1/score/{model}",
                        json={"query": QUERY, "items": DOCUMENTS, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return [(row["index"], row["score"]) for row in r.json()["results"]]


@pytest.mark.parametrize("model", MODELS)
def test_cohere_v2_client_reranks_as_score_does(co: cohere.ClientV2, url: str,
                                                model: str) -> None:
    res = co.rerank(model=model, query=QUERY, documents=DOCUMENTS, top_n=3)
    expected = heron_score(url, model, top_k=3)
    same_ranking([(r.index, r.relevance_score) for r in res.results], expected)
    assert res.meta is not None and res.meta.billed_units is not None
    assert res.meta.billed_units.search_units == 1
    assert res.id  # the request id, as X-Request-Id


def test_cohere_v1_client_returns_documents_and_keeps_object_fields(url: str) -> None:
    co = cohere.Client(api_key="unused", base_url=url, timeout=60)
    docs = [{"text": t, "source": f"doc-{i}"} for i, t in enumerate(DOCUMENTS)]
    res = co.rerank(model="tiny-cross-encoder", query=QUERY, documents=docs, top_n=2,
                    return_documents=True)
    expected = heron_score(url, "tiny-cross-encoder", top_k=2)
    same_ranking([(r.index, r.relevance_score) for r in res.results], expected)
    for r in res.results:
        assert r.document is not None and r.document.text == DOCUMENTS[r.index]
        assert r.document.source == f"doc-{r.index}"  # type: ignore[attr-defined]
    plain = co.rerank(model="tiny-cross-encoder", query=QUERY, documents=DOCUMENTS)
    assert len(plain.results) == len(DOCUMENTS)
    assert all(r.document is None for r in plain.results)  # Cohere's default: none


def test_unknown_model_raises_the_clients_not_found_error(co: cohere.ClientV2) -> None:
    with pytest.raises(cohere.NotFoundError) as caught:
        co.rerank(model="no-such-model", query=QUERY, documents=DOCUMENTS)
    assert "no-such-model" in caught.value.body["message"]
    assert caught.value.body["code"] == "model_not_found"


def test_bad_requests_raise_bad_request_error_naming_the_field(co: cohere.ClientV2) -> None:
    with pytest.raises(cohere.BadRequestError) as caught:
        co.rerank(model="tiny-cross-encoder", query=QUERY, documents=DOCUMENTS, top_n=0)
    assert caught.value.body["param"] == "top_n"
    with pytest.raises(cohere.BadRequestError):  # encode-only model: score is not its task
        co.rerank(model="splade-tiny", query=QUERY, documents=DOCUMENTS)


def test_jina_shaped_body_gets_jinas_fields(url: str) -> None:
    body = {"model": "tiny-cross-encoder", "query": QUERY, "top_n": 2,
            "documents": [{"text": t} for t in DOCUMENTS], "return_documents": True}
    r = local_http.post(f"{url}/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "test/tiny-cross-encoder"
    assert out["usage"]["total_tokens"] > 0
    expected = heron_score(url, "tiny-cross-encoder", top_k=2)
    same_ranking([(x["index"], x["relevance_score"]) for x in out["results"]], expected)
    assert [x["document"]["text"] for x in out["results"]] == [DOCUMENTS[i]
                                                               for i, _ in expected]
    refused = local_http.post(f"{url}/v1/rerank", json={**body, "documents": [{"txt": "a"}]})
    assert refused.status_code == 400
    assert refused.json()["detail"] == refused.json()["message"]
    assert refused.json()["param"] == "documents[0].text"


def test_max_tokens_per_doc_cuts_documents_before_scoring(base_url: str) -> None:
    """A document cut to 3 tokens scores as its first 3 tokens' text does."""
    co = cohere.ClientV2(api_key="unused", base_url=base_url, timeout=60)
    long_doc = "The cat sat on the mat by the door of the old house."
    cut = co.rerank(model="minilm", query=QUERY, documents=[long_doc], max_tokens_per_doc=3)
    short = co.rerank(model="minilm", query=QUERY, documents=["The cat sat"])
    full = co.rerank(model="minilm", query=QUERY, documents=[long_doc])
    assert cut.results[0].relevance_score == pytest.approx(short.results[0].relevance_score,
                                                           abs=1e-6)
    assert cut.results[0].relevance_score != pytest.approx(full.results[0].relevance_score)


def test_more_documents_than_one_request_takes_are_ranked_together(base_url: str) -> None:
    """Cohere takes up to 10,000 documents; Heron's own routes take 2,048 a request."""
    docs = [f"document number {i} about herons" if i % 500 == 7 else f"filler {i}"
            for i in range(2_500)]
    co = cohere.ClientV2(api_key="unused", base_url=base_url, timeout=120)
    res = co.rerank(model="minilm", query="herons", documents=docs, top_n=5)
    assert {r.index for r in res.results} == {7, 507, 1007, 1507, 2007}
    scores = [r.relevance_score for r in res.results]
    assert scores == sorted(scores, reverse=True)
