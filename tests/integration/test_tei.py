"""TEI's routes on live servers, `heron serve` and a gateway over a real cluster: each route in
TEI's shapes and equal to Heron's own answer for the same work (/embed to /v1/encode, /rerank
to /v1/score, ...), /tokenize and /decode from the model's own tokenizer (through a worker
of the pool on a gateway), errors in TEI's body with TEI's statuses, the model each route
picks, the real huggingface_hub InferenceClient and LangChain's HuggingFaceEndpointEmbeddings
against them, CORS (off by default; preflights and answers for allowed origins only), and
`heron --version`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from heron import __version__
from heron.gateway.settings import GatewaySettings
from tests.support import local_http
from tests.support.gateway_harness import GatewayThread, unique, write_bundles
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, start_serve

ORIGIN = "https://app.example"
TEXTS = ["Heron serves embeddings.", "Reranking and extraction too.", "héron cendré"]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
        "The Seine flows through Paris."]
# The TEI servers' setting: /embed, /info and POST / use MiniLM, /rerank and /predict the
# cross-encoder (made for them, though MiniLM can score too).
DEFAULTS = "minilm,tiny-cross-encoder"


# ---- the servers: the session's (no default model, no CORS) and TEI-configured twins -----------
@pytest.fixture(scope="module")
def tei_serve_url(test_bundle: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[str]:
    """`heron serve` with --default-model and --cors-origins (four of the bundle's models)."""
    server = start_serve(test_bundle, tmp_path_factory.mktemp("tei-serve"), extra_args=[
        "--models", "minilm,tiny-cross-encoder,splade-tiny,tiny-dense-cls",
        "--default-model", DEFAULTS, "--cors-origins", ORIGIN])
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def tei_gateway_url(cluster_url: str, nats_server: NatsServer, test_bundle: Path
                    ) -> Iterator[str]:
    """A second gateway on the session cluster's pool, with the TEI servers' settings."""
    pools = local_http.get(cluster_url + "/readyz", timeout=30).json()["pools"]
    (pool,) = pools
    gateway = GatewayThread(nats_server.url, {str(test_bundle): pool}, settings=GatewaySettings(
        default_model=DEFAULTS, cors_origins=ORIGIN)).start()
    gateway.wait_for_capacity(pool, 30)  # a beat a second; a busy host can outlast the grace
    yield gateway.url
    gateway.stop()


@pytest.fixture(params=["serve", "gateway"])
def plain(request: pytest.FixtureRequest) -> str:
    """The session's servers: every model of the test bundle, no --default-model."""
    return request.getfixturevalue("base_url" if request.param == "serve" else "cluster_url")


@pytest.fixture(params=["serve", "gateway"])
def tei(request: pytest.FixtureRequest) -> str:
    """The servers with --default-model and --cors-origins."""
    return request.getfixturevalue("tei_serve_url" if request.param == "serve"
                                   else "tei_gateway_url")


def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return local_http.post(url + path, json=body, timeout=60, **kwargs)


def ok(url: str, path: str, body: Any) -> Any:
    answer = post(url, path, body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    return answer.json()


def tei_error(answer: httpx.Response, status: int, kind: str) -> str:
    """The message of a TEI error answer with ``status`` and ``error_type`` ``kind``."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == kind, body
    assert isinstance(body["error"], str) and body["error"]
    return body["error"]


def heron_vectors(url: str, model: str, texts: list[str], **options: Any) -> np.ndarray:
    body = ok(url, f"/v1/encode/{model}", {"items": texts, **options})
    return np.array([item["dense"] for item in body["items"]], dtype=np.float32)


# ---- /embed, /embed_sparse ----------------------------------------------------------------------
def test_embed_equals_heron_encode(plain: str) -> None:
    vectors = ok(plain, "/embed", {"inputs": TEXTS, "model": "minilm"})
    assert isinstance(vectors, list) and len(vectors) == 3
    assert all(isinstance(v, list) and len(v) == 384 for v in vectors)
    np.testing.assert_allclose(np.array(vectors, dtype=np.float32),
                               heron_vectors(plain, "minilm", TEXTS), atol=1e-5)
    one = ok(plain, "/embed", {"inputs": TEXTS[0], "model": "minilm"})  # still a batch of 1
    np.testing.assert_allclose(one, [vectors[0]], atol=1e-5)


def test_embed_options_map_to_heron_options(tei: str) -> None:
    """dimensions is Matryoshka (dims), normalize gives unit vectors, prompt_name the side
    of a search, truncate and its direction as Heron truncates."""
    short = ok(tei, "/embed", {"inputs": TEXTS, "dimensions": 8, "normalize": True})
    np.testing.assert_allclose(short, heron_vectors(tei, "minilm", TEXTS, dims=8), atol=1e-5)
    assert np.allclose(np.linalg.norm(np.array(short), axis=1), 1.0, atol=1e-5)
    query = ok(tei, "/embed", {"inputs": TEXTS[:1], "prompt_name": "query", "truncate": True,
                               "truncation_direction": "Right", "normalize": False})
    np.testing.assert_allclose(query, heron_vectors(tei, "minilm", TEXTS[:1], is_query=True),
                               atol=1e-5)
    # A model with prompts: the side's prompt is applied, as Heron's input_type does.
    doc = ok(tei, "/embed", {"inputs": TEXTS[:1], "model": "tiny-dense-cls",
                             "prompt_name": "passage"})
    np.testing.assert_allclose(doc, heron_vectors(tei, "tiny-dense-cls", TEXTS[:1],
                                                  input_type="document"), atol=1e-5)


def test_embed_sparse_equals_heron_sparse_encode(plain: str) -> None:
    sparse = ok(plain, "/embed_sparse", {"inputs": TEXTS[:2], "model": "splade-tiny"})
    heron = ok(plain, "/v1/encode/splade-tiny", {"items": TEXTS[:2],
                                                 "output_types": ["sparse"]})["items"]
    assert len(sparse) == 2
    for values, item in zip(sparse, heron, strict=True):
        assert all(set(v) == {"index", "value"} for v in values)
        assert [v["index"] for v in values] == item["sparse"]["indices"]
        np.testing.assert_allclose([v["value"] for v in values], item["sparse"]["values"],
                                   atol=1e-6)


def test_the_root_route_embeds_with_the_default_model(tei: str) -> None:
    """huggingface_hub posts feature extraction to the URL it is given: POST /."""
    root = ok(tei, "/", {"inputs": TEXTS})
    np.testing.assert_allclose(root, heron_vectors(tei, "minilm", TEXTS), atol=1e-5)
    sparse = ok(tei, "/", {"inputs": TEXTS[:1], "model": "splade-tiny"})
    assert set(sparse[0][0]) == {"index", "value"}  # a sparse-only model: /embed_sparse
    ranks = ok(tei, "/", {"query": QUERY, "texts": DOCS})  # a rerank body: /rerank
    assert {r["index"] for r in ranks} == {0, 1, 2}


# ---- /rerank, /predict ------------------------------------------------------------------------
def test_rerank_equals_heron_score(plain: str) -> None:
    """The one cross-encoder of the bundle is /rerank's model with no --default-model."""
    ranks = ok(plain, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True,
                                  "raw_scores": False})
    heron = ok(plain, "/v1/score/tiny-cross-encoder", {"query": QUERY, "items": DOCS})
    assert [r["index"] for r in ranks] == [r["index"] for r in heron["results"]]
    np.testing.assert_allclose([r["score"] for r in ranks],
                               [r["score"] for r in heron["results"]], atol=1e-6)
    assert all(r["text"] == DOCS[r["index"]] and set(r) == {"index", "score", "text"}
               for r in ranks)
    bare = ok(plain, "/rerank", {"query": QUERY, "texts": DOCS})
    assert all(set(r) == {"index", "score"} for r in bare)
    # A dense model ranks by similarity when named, as /v1/score does.
    dense = ok(plain, "/rerank", {"query": QUERY, "texts": DOCS, "model": "minilm"})
    heron_dense = ok(plain, "/v1/score/minilm", {"query": QUERY, "items": DOCS})["results"]
    assert [r["index"] for r in dense] == [r["index"] for r in heron_dense]


def test_predict_scores_pairs_with_the_cross_encoder(tei: str) -> None:
    single = ok(tei, "/predict", {"inputs": [QUERY, DOCS[0]]})
    assert len(single) == 1 and set(single[0]) == {"score", "label"}
    batch = ok(tei, "/predict", {"inputs": [[QUERY, DOCS[0]], ["other", DOCS[1]],
                                            [QUERY, DOCS[2]]]})
    assert [len(row) for row in batch] == [1, 1, 1]
    heron = {r["index"]: r["score"] for r in ok(
        tei, "/v1/score/tiny-cross-encoder", {"query": QUERY, "items": DOCS})["results"]}
    np.testing.assert_allclose([batch[0][0]["score"], batch[2][0]["score"]],
                               [heron[0], heron[2]], atol=1e-6)
    assert single[0]["score"] == pytest.approx(heron[0], abs=1e-6)
    other = ok(tei, "/v1/score/tiny-cross-encoder", {"query": "other", "items": [DOCS[1]]})
    assert batch[1][0]["score"] == pytest.approx(other["results"][0]["score"], abs=1e-6)
    tei_error(post(tei, "/predict", {"inputs": [QUERY, DOCS[0]], "model": "minilm"}), 424,
              "Backend")  # not a cross-encoder


# ---- /tokenize, /decode -------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["minilm", "tiny-sentencepiece"])
def test_tokenize_gives_the_tokens_encode_computes_with(plain: str, model: str) -> None:
    rows = ok(plain, "/tokenize", {"inputs": TEXTS, "model": model})
    assert len(rows) == len(TEXTS)
    heron = ok(plain, f"/v1/encode/{model}", {"items": TEXTS})["items"]
    for text, tokens, item in zip(TEXTS, rows, heron, strict=True):
        assert len(tokens) == item["tokens"]  # the tokens encode computes with
        assert all(set(t) == {"id", "text", "special", "start", "stop"} for t in tokens)
        assert tokens[0]["special"] and tokens[0]["start"] is None
        regular = [t for t in tokens if not t["special"]]
        assert regular and all(t["start"] is not None for t in regular)
        for t in regular:  # the text's own characters, at byte offsets, as TEI's
            assert text.encode()[t["start"]:t["stop"]].decode() == t["text"]
    bare = ok(plain, "/tokenize", {"inputs": TEXTS[0], "add_special_tokens": False,
                                   "model": model})
    assert len(bare) == 1 and not any(t["special"] for t in bare[0])


def test_tokenize_and_decode_round_trip(plain: str) -> None:
    rows = ok(plain, "/tokenize", {"inputs": TEXTS[:2], "model": "minilm"})
    ids = [[t["id"] for t in tokens] for tokens in rows]
    decoded = ok(plain, "/decode", {"ids": ids, "model": "minilm"})
    for text, back in zip(TEXTS[:2], decoded, strict=True):  # lowercased, as MiniLM reads
        assert back.replace(" ", "") == text.lower().replace(" ", "")
    (single,) = ok(plain, "/decode", {"ids": ids[0], "skip_special_tokens": False,
                                      "model": "minilm"})
    assert single.startswith("[CLS]") and single.endswith("[SEP]")


def test_tokenize_through_the_gateway_is_the_workers(base_url: str, cluster_url: str) -> None:
    body = {"inputs": TEXTS, "model": "tiny-dense-cls", "prompt_name": "query"}
    assert ok(cluster_url, "/tokenize", body) == ok(base_url, "/tokenize", body)
    ids = [[101, 2054, 102], [7592]]
    assert ok(cluster_url, "/decode", {"ids": ids, "model": "minilm"}) == ok(
        base_url, "/decode", {"ids": ids, "model": "minilm"})


# ---- errors and the model choice --------------------------------------------------------------
def test_errors_take_tei_shape_and_statuses(plain: str) -> None:
    tei_error(post(plain, "/embed", {"inputs": [], "model": "minilm"}), 400, "Empty")
    tei_error(post(plain, "/rerank", {"query": "q", "texts": []}), 400, "Empty")
    assert "unknown field" in tei_error(post(plain, "/embed", {"inputs": "a", "top_n": 1}),
                                        422, "Validation")
    tei_error(post(plain, "/embed", {"inputs": "a", "model": "splade-tiny"}), 424, "Backend")
    tei_error(post(plain, "/embed", {"inputs": "a", "model": "no-such-model"}), 404,
              "Validation")
    assert "token-id" in tei_error(post(plain, "/embed", {"inputs": [101, 7592],
                                                          "model": "minilm"}),
                                   422, "Validation")
    tei_error(post(plain, "/embed", {"inputs": "a", "model": "minilm",
                                     "truncation_direction": "left"}), 422, "Validation")
    tei_error(post(plain, "/rerank", {"query": "q", "texts": ["a"], "raw_scores": True}),
              422, "Validation")
    long = "word " * 400  # MiniLM's limit is 256 tokens
    message = tei_error(post(plain, "/embed", {"inputs": ["a", long], "truncate": False,
                                               "model": "minilm"}), 422, "Validation")
    assert "inputs[1]" in message  # named as the TEI body names it
    message = tei_error(post(plain, "/decode", {"ids": [[1], [10**9]], "model": "minilm"}),
                        422, "Validation")
    assert "ids[1]" in message and "vocabulary" in message
    tei_error(post(plain, "/embed", {"inputs": ["a"] * 2049, "model": "minilm"}), 422,
              "Validation")
    not_json = local_http.post(plain + "/embed", content=b"{", timeout=30,
                               headers={"Content-Type": "application/json"})
    tei_error(not_json, 400, "Validation")


def test_with_several_models_and_no_default_the_answer_names_the_setting(plain: str) -> None:
    message = tei_error(post(plain, "/embed", {"inputs": "a"}), 422, "Validation")
    assert "--default-model" in message and "HERON_DEFAULT_MODEL" in message
    assert "sentence-transformers/all-MiniLM-L6-v2" in message
    tei_error(post(plain, "/tokenize", {"inputs": "a"}), 422, "Validation")


def test_a_pool_with_no_worker_is_tei_unhealthy_with_retry_after(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """TEI's clients know no 202: a gateway's provisioning answer is a 503 Unhealthy."""
    root = write_bundles(tmp_path, {"cold": ["dense"]})
    gateway = GatewayThread(nats_server.url, {"cold": unique("cold")}, root,
                            GatewaySettings(startup_grace_s=0.2)).start()
    try:
        answer = post(gateway.url, "/embed", {"inputs": "a"})  # its one model: no default
        assert "provisioning" in tei_error(answer, 503, "Unhealthy")
        assert int(answer.headers["retry-after"]) >= 1
    finally:
        gateway.stop()


def test_info_reports_the_model_and_the_version(plain: str, tei: str) -> None:
    info = local_http.get(tei + "/info", timeout=30).json()
    assert info["version"] == __version__
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["model_type"]["embedding"]["pooling"] in ("mean", None)
    assert info["max_client_batch_size"] == 2048 and info["auto_truncate"] is True
    unnamed = local_http.get(plain + "/info", timeout=30)  # many models: no model, still 200
    assert unnamed.status_code == 200 and unnamed.json()["version"] == __version__
    assert unnamed.json()["model_id"] is None


# ---- the clients that speak TEI -----------------------------------------------------------------
@pytest.fixture()
def hub_client_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub refuses every request while HF_HUB_OFFLINE is set (the suite sets it:
    no test reaches a hub); these clients only ever talk to the loopback server."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.mark.usefixtures("hub_client_online")
def test_huggingface_hub_inference_client(tei: str) -> None:
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=tei)
    vectors = client.feature_extraction(TEXTS)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, heron_vectors(tei, "minilm", TEXTS), atol=1e-5)
    one = client.feature_extraction(TEXTS[0], normalize=True, truncate=True)
    np.testing.assert_allclose(one, heron_vectors(tei, "minilm", TEXTS[:1]), atol=1e-5)


@pytest.mark.usefixtures("hub_client_online")
def test_langchain_huggingface_endpoint_embeddings(tei: str) -> None:
    from huggingface_hub import AsyncInferenceClient, InferenceClient
    from langchain_huggingface import HuggingFaceEndpointEmbeddings

    try:
        embeddings = HuggingFaceEndpointEmbeddings(model=tei)
    except ValueError:
        # langchain-huggingface 1.2.3 refuses a URL as `model` (its docs still show it);
        # its class is the same: point its clients at the server, as older versions do.
        embeddings = HuggingFaceEndpointEmbeddings(model="sentence-transformers/all-MiniLM-L6-v2")
        embeddings.client = InferenceClient(model=tei)
        embeddings.async_client = AsyncInferenceClient(model=tei)
    documents = embeddings.embed_documents(TEXTS)
    np.testing.assert_allclose(documents, heron_vectors(tei, "minilm", TEXTS), atol=1e-5)
    query = embeddings.embed_query(TEXTS[0])
    np.testing.assert_allclose(query, heron_vectors(tei, "minilm", TEXTS[:1])[0], atol=1e-5)


# ---- CORS ---------------------------------------------------------------------------------
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type, authorization"}


@pytest.mark.parametrize("path", ["/embed", "/v1/encode/minilm", "/v1/models"])
def test_cors_preflight_and_answers_for_allowed_origins_only(tei: str, path: str) -> None:
    preflight = httpx.options(tei + path, headers=PREFLIGHT, timeout=30)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    assert "access-control-allow-credentials" not in preflight.headers
    other = httpx.options(tei + path, headers={**PREFLIGHT, "Origin": "https://evil.example"},
                          timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"inputs": "a"} if path == "/embed" else {"items": ["a"]}
    method = "GET" if path == "/v1/models" else "POST"
    for origin, allowed in ((ORIGIN, True), ("https://evil.example", False), (None, False)):
        headers = {"Origin": origin} if origin else {}
        answer = local_http.request(method, tei + path, json=None if method == "GET" else body,
                                    headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        assert (answer.headers.get("access-control-allow-origin") == ORIGIN) is allowed
        if allowed:  # what a page's script may read
            assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()


def test_cors_is_off_by_default(plain: str) -> None:
    preflight = httpx.options(plain + "/v1/encode/minilm", headers=PREFLIGHT, timeout=30)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in (
        preflight.headers)
    answer = local_http.post(plain + "/v1/encode/minilm", json={"items": ["a"]},
                             headers={"Origin": ORIGIN}, timeout=30)
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_wildcard_origin_never_allows_credentials(test_bundle: Path,
                                                    tmp_path: Path) -> None:
    server = start_serve(test_bundle, tmp_path, extra_args=["--models", "tiny-dense-cls"],
                         env={"HERON_CORS_ORIGINS": "*"})
    try:
        answer = local_http.post(server.url + "/embed", json={"inputs": "a"}, timeout=30,
                                 headers={"Origin": "https://any.example", "Cookie": "a=b"})
        assert answer.status_code == 200, answer.text  # its one model: no default needed
        assert answer.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in answer.headers
        preflight = httpx.options(server.url + "/embed", timeout=30, headers={
            **PREFLIGHT, "Origin": "https://any.example"})
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in preflight.headers
    finally:
        server.stop()


def test_a_bad_cors_origin_stops_the_server_before_it_binds(test_bundle: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "heron.cli", "serve", "--bundle",
                           str(test_bundle), "--cors-origins", "https://app.example/"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    assert "config error" in done.stderr and "no trailing slash" in done.stderr


def test_heron_version() -> None:
    done = subprocess.run([sys.executable, "-m", "heron.cli", "--version"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == f"heron {__version__}"
