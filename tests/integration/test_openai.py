"""The official `openai` client against /v1/embeddings gets the vectors /v1/encode gives."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

TEXTS = ["The official client works.", "Embeddings over HTTP", "x"]


@pytest.fixture()
def oai(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def encode(http: httpx.Client, texts: list[str], **opts: object) -> np.ndarray:
    r = http.post("/v1/encode/minilm", json={"items": texts, **opts})
    return np.array([i["dense"] for i in r.json()["items"]], dtype=np.float32)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_matches_encode(oai: OpenAI, http: httpx.Client,
                                      encoding_format: str) -> None:
    res = oai.embeddings.create(model="sentence-transformers/all-MiniLM-L6-v2", input=TEXTS,
                                encoding_format=encoding_format)
    if encoding_format == "base64":  # asked for explicitly, the client hands over the text
        got = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in res.data])
    else:
        got = np.array([d.embedding for d in res.data], dtype=np.float32)
    np.testing.assert_allclose(got, encode(http, TEXTS), atol=1e-6)
    assert [d.index for d in res.data] == [0, 1, 2]
    assert res.model == "sentence-transformers/all-MiniLM-L6-v2"
    tokens = sum(i["tokens"] for i in http.post("/v1/encode/minilm", json={"items": TEXTS}
                                                ).json()["items"])
    assert res.usage.prompt_tokens == res.usage.total_tokens == tokens


def test_openai_client_default_is_base64_and_decodes(oai: OpenAI, http: httpx.Client) -> None:
    # openai-python asks for base64 unless told otherwise, and decodes it itself.
    res = oai.embeddings.create(model="minilm", input="single string")
    np.testing.assert_allclose(res.data[0].embedding, encode(http, ["single string"])[0],
                               atol=1e-6)


def test_dimensions(oai: OpenAI, http: httpx.Client) -> None:
    res = oai.embeddings.create(model="minilm", input=TEXTS, dimensions=128,
                                encoding_format="float")
    got = np.array([d.embedding for d in res.data])
    assert got.shape == (3, 128)
    np.testing.assert_allclose(got, encode(http, TEXTS, dims=128), atol=1e-6)


def test_errors_reach_the_client_typed(oai: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.UnprocessableEntityError):
        oai.embeddings.create(model="minilm", input=[[1, 2, 3]])
    with pytest.raises(openai.UnprocessableEntityError):
        oai.embeddings.create(model="minilm", input="x", dimensions=4096)


def test_raw_http_shapes(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": "minilm", "input": ["a", "b"]})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["data"][1]["object"] == "embedding"
    assert len(body["data"][0]["embedding"]) == 384
    for bad, field in [({"input": "x"}, "model"), ({"model": "minilm"}, "input"),
                       ({"model": "minilm", "input": []}, "input"),
                       ({"model": "minilm", "input": "x", "encoding_format": "hex"},
                        "encoding_format"),
                       ({"model": "minilm", "input": "x", "dimensions": 0}, "dimensions")]:
        r = http.post("/v1/embeddings", json=bad)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["code"] == "INVALID_FIELD"
        assert r.json()["error"]["field"] == field
