"""The official `openai` client against /v1/embeddings gets the vectors /v1/encode gives."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml
from openai import OpenAI
from transformers import AutoTokenizer

from tests.support.servers import REPO, start_serve
from tests.support.tiny_models import minilm_dir

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
    with pytest.raises(openai.NotFoundError) as missing:
        oai.embeddings.create(model="no-such-model", input="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        oai.embeddings.create(model="minilm", input="x", dimensions=4096)
    assert (bad.value.code, bad.value.param) == ("invalid_field", "dims")
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as outside:  # not in MiniLM's vocabulary
        oai.embeddings.create(model="minilm", input=[[1, 2, 10**6]])
    assert outside.value.param == "items[0].tokens"
    with pytest.raises(openai.BadRequestError):  # multi-vector models take texts only
        oai.embeddings.create(model="tiny-multi-vector", input=[[1, 2, 3]])


@pytest.mark.parametrize("shape", ["one", "many"])
def test_token_id_input_equals_the_same_text(oai: OpenAI, http: httpx.Client,
                                             shape: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    given = ids[0] if shape == "one" else ids
    res = oai.embeddings.create(model="minilm", input=given, encoding_format="float")
    texts = TEXTS[:1] if shape == "one" else TEXTS
    np.testing.assert_allclose([d.embedding for d in res.data], encode(http, texts),
                               atol=1e-6)
    tokens = sum(i["tokens"] for i in http.post("/v1/encode/minilm", json={"items": texts}
                                                ).json()["items"])
    assert res.usage.prompt_tokens == tokens


def test_a_full_queue_raises_rate_limit_error_with_retry_after(
        tmp_path: Path) -> None:
    """MiniLM with room for 2 queued items: a burst of 8-text requests finds it full."""
    bundle = tmp_path / "bundle"
    (bundle / "models").mkdir(parents=True)
    config = yaml.safe_load((REPO / "bundles/models/all-minilm-l6-v2.yaml").read_text())
    for profile in config["profiles"].values():
        profile["max_queue_items"] = 2
    (bundle / "models" / "minilm.yaml").write_text(yaml.safe_dump(config))
    (bundle / "small.yaml").write_text(yaml.safe_dump({"name": "small",
                                                        "models": ["minilm.yaml"]}))
    server = start_serve(bundle / "small.yaml", tmp_path)
    try:
        oai = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        long = " ".join(["heron"] * 120)

        def call(n: int) -> str:
            # Texts of their own: identical ones would be computed once (result cache).
            texts = [f"{n} {i} {long}" for i in range(8)]
            try:
                oai.embeddings.create(model="minilm", input=texts)
                return "ok"
            except openai.RateLimitError as exc:
                assert int(exc.response.headers["retry-after"]) >= 1
                assert exc.code == "queue_full"
                return "limited"

        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(call, range(24)))
        assert "limited" in outcomes and "ok" in outcomes, outcomes
    finally:
        server.stop()


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
                       ({"model": "minilm", "input": "x", "dimensions": 0}, "dimensions"),
                       ({"model": "minilm", "input": [[]]}, "input[0]"),
                       ({"model": "minilm", "input": ["a", 1]}, "input")]:
        r = http.post("/v1/embeddings", json=bad)
        assert r.status_code == 400, (bad, r.text)
        error = r.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "invalid_field", field, "invalid_request_error")
        assert set(error) == {"message", "type", "param", "code"}
