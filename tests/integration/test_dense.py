"""MiniLM through `heron serve` equals sentence-transformers' own encode of the same files."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from heron_sdk import Client, wire
from tests.support.tiny_models import minilm_dir

SHORT = ["hello world", "A man is eating food.", "Paris is the capital of France."]
LONG = [" ".join(["the quick brown fox jumps over the lazy dog"] * 25)]  # ~227 tokens
TRUNCATED = [" ".join(["embeddings are vectors that carry meaning"] * 80)]  # > 256 tokens


@pytest.fixture(scope="module")
def st_model() -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir()), device="cpu")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def encode(http: httpx.Client, texts: list[str], **opts: object) -> dict:
    r = http.post("/v1/encode/sentence-transformers/all-MiniLM-L6-v2",
                  json={"items": texts, **opts})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("texts", [SHORT, LONG, TRUNCATED, SHORT + LONG + TRUNCATED],
                         ids=["short", "long", "truncated", "mixed"])
def test_minilm_matches_sentence_transformers(http: httpx.Client, st_model, texts) -> None:
    body = encode(http, texts)
    ours = np.array([item["dense"] for item in body["items"]])
    theirs = st_model.encode(texts, normalize_embeddings=True)
    assert ours.shape == (len(texts), 384)
    assert (cosine(ours, theirs) >= 0.9999).all(), cosine(ours, theirs)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, rtol=1e-5)


def test_truncation_is_flagged_and_token_counts_are_real(http: httpx.Client, st_model) -> None:
    body = encode(http, SHORT + TRUNCATED)
    tokenizer = st_model.tokenizer
    for text, item in zip(SHORT, body["items"], strict=False):
        assert item["tokens"] == len(tokenizer(text)["input_ids"])
        assert item["truncated"] is False
    assert body["items"][-1]["truncated"] is True and body["items"][-1]["tokens"] == 256
    assert body["usage"]["tokens"] == sum(i["tokens"] for i in body["items"])


def test_msgpack_client_gets_numpy_arrays_equal_to_json(base_url: str, http) -> None:
    with Client(base_url) as client:
        out = client.encode("minilm", SHORT)
    dense = out[0].dense
    assert isinstance(dense, np.ndarray) and dense.dtype == np.float32
    as_json = encode(http, SHORT)
    np.testing.assert_allclose(out.dense,
                               np.array([i["dense"] for i in as_json["items"]]), atol=1e-6)


def test_accept_picks_the_response_format(http: httpx.Client) -> None:
    r = http.post("/v1/encode/minilm", json={"items": ["x"]},
                  headers={"accept": "application/msgpack"})
    assert r.headers["content-type"] == "application/msgpack"
    assert wire.decode(r.content, wire.MSGPACK)["items"][0]["dense"].shape == (384,)


def test_base64_encoding_envelope(http: httpx.Client) -> None:
    plain = encode(http, ["base64 please"])["items"][0]["dense"]
    env = encode(http, ["base64 please"], encoding="base64")["items"][0]["dense"]
    assert env["dtype"] == "float32" and env["shape"] == [384]
    vec = np.frombuffer(base64.b64decode(env["b64"]), dtype="<f4")
    np.testing.assert_allclose(vec, plain, atol=1e-7)


def test_dims_truncates_then_renormalizes(http: httpx.Client) -> None:
    full = np.array(encode(http, ["matryoshka"])["items"][0]["dense"])
    cut = np.array(encode(http, ["matryoshka"], dims=64)["items"][0]["dense"])
    assert cut.shape == (64,)
    np.testing.assert_allclose(np.linalg.norm(cut), 1.0, rtol=1e-5)
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


@pytest.mark.parametrize(("dtype", "shape", "np_dtype"), [
    ("float16", (384,), np.float16), ("int8", (384,), np.int8), ("uint8", (384,), np.uint8),
    ("binary", (48,), np.uint8)])
def test_output_dtypes(base_url: str, dtype: str, shape: tuple, np_dtype: type) -> None:
    with Client(base_url) as client:
        ref = client.encode("minilm", ["quantize me"])[0].dense
        got = client.encode("minilm", ["quantize me"], output_dtype=dtype)[0].dense
    assert got.shape == shape and got.dtype == np_dtype
    if dtype == "binary":
        np.testing.assert_array_equal(np.unpackbits(got), (ref > 0).astype(np.uint8))
    else:
        as_float = got.astype(np.float32) - (128 if dtype == "uint8" else 0)
        assert cosine(as_float, ref) > 0.999


def test_query_and_document_instructions_come_from_config(http: httpx.Client) -> None:
    """tiny-dense-cls is configured with 'query: ' and 'passage: ' prefixes."""
    def vec(**opts: object) -> np.ndarray:
        r = http.post("/v1/encode/tiny-dense-cls", json={"items": ["what is heron"], **opts})
        assert r.status_code == 200, r.text
        return np.array(r.json()["items"][0]["dense"])

    doc, query = vec(), vec(is_query=True)
    explicit_query = vec(instruction="query: ")
    plain = vec(instruction="")
    np.testing.assert_allclose(query, explicit_query, atol=1e-6)
    # A random-init model maps every text close together: compare exactly, not by cosine.
    assert np.abs(doc - query).max() > 1e-4 and np.abs(doc - plain).max() > 1e-4
    raw = http.post("/v1/encode/tiny-dense-cls", json={"items": ["passage: what is heron"],
                                                       "instruction": ""}).json()
    np.testing.assert_allclose(doc, raw["items"][0]["dense"], atol=1e-6)


def test_sentencepiece_model_serves(http: httpx.Client) -> None:
    texts = ["paris is the capital of france", "the lazy dog"]
    r = http.post("/v1/encode/tiny-sentencepiece", json={"items": texts})
    assert r.status_code == 200, r.text
    vecs = np.array([i["dense"] for i in r.json()["items"]])
    assert vecs.shape == (2, 32) and not np.allclose(vecs[0], vecs[1])
    again = np.array([i["dense"] for i in http.post("/v1/encode/tiny-sentencepiece",
                                                    json={"items": texts}).json()["items"]])
    np.testing.assert_allclose(vecs, again, atol=1e-6)


def test_bi_encoder_score_ranks_by_cosine(http: httpx.Client, st_model) -> None:
    docs = ["The stock market fell today.", "A cat sat on the mat.", "Kittens are small cats."]
    r = http.post("/v1/score/minilm", json={"query": "Where is the cat?",
                                            "items": [{"text": d, "id": f"d{i}"}
                                                      for i, d in enumerate(docs)]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    q = st_model.encode(["Where is the cat?"], normalize_embeddings=True)[0]
    expected = st_model.encode(docs, normalize_embeddings=True) @ q
    assert [x["index"] for x in results] == list(np.argsort(-expected))
    assert [x["rank"] for x in results] == [1, 2, 3]
    for row in results:
        assert row["id"] == f"d{row['index']}"
        assert abs(row["score"] - expected[row["index"]]) < 1e-4
    top = http.post("/v1/score/minilm", json={"query": "cat", "items": docs, "top_k": 1})
    assert len(top.json()["results"]) == 1
