"""`heron encode | score | extract | models` against the session's `heron serve`."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np

from tests.support.servers import REPO


def heron(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "heron.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, input=stdin)


def test_encode_prints_the_servers_json(base_url: str, http: httpx.Client) -> None:
    out = heron("encode", "minilm", "hello heron", "second text", "--dims", "16", "--url",
                base_url)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = http.post("/v1/encode/minilm",
                     json={"items": ["hello heron", "second text"], "dims": 16}).json()
    assert got["model"] == want["model"] and got["usage"] == want["usage"]
    np.testing.assert_allclose([i["dense"] for i in got["items"]],
                               [i["dense"] for i in want["items"]], atol=1e-5)
    # One text per line from stdin with "-"
    piped = heron("encode", "minilm", "-", "--url", base_url, stdin="a\nb\n\nc\n")
    assert piped.returncode == 0 and len(json.loads(piped.stdout)["items"]) == 3


def test_score_extract_and_models(base_url: str, http: httpx.Client) -> None:
    score = heron("score", "tiny-cross-encoder", "capital of France?", "Paris", "Berlin",
                  "--top-k", "1", "--url", base_url)
    assert score.returncode == 0, score.stderr
    assert [r["rank"] for r in json.loads(score.stdout)["results"]] == [1]
    extract = heron("extract", "tiny-ner", "Ada Lovelace lived in London.", "--labels", "PER",
                    "LOC", "--url", base_url)
    assert extract.returncode == 0, extract.stderr
    want = http.post("/v1/extract/tiny-ner", json={"items": ["Ada Lovelace lived in London."],
                                                   "labels": ["PER", "LOC"]}).json()
    assert json.loads(extract.stdout)["items"] == want["items"]
    models = heron("models", "--url", base_url)
    assert [m["id"] for m in json.loads(models.stdout)["data"]] == \
        [m["id"] for m in http.get("/v1/models").json()["data"]]
    one = heron("models", "minilm", "--url", base_url)
    assert json.loads(one.stdout)["id"] == "sentence-transformers/all-MiniLM-L6-v2"


def test_errors_print_the_code_and_exit_1(base_url: str) -> None:
    out = heron("encode", "no-such-model", "x", "--url", base_url)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("heron: MODEL_NOT_FOUND [404]"), out.stderr
    bad = heron("encode", "minilm", "x", "--dims", "0", "--url", base_url)
    assert bad.returncode == 1 and "INVALID_FIELD [422] (dims)" in bad.stderr


def test_adapter_flag_is_model_at_adapter(base_url: str) -> None:
    """`--adapter NAME` computes with the model's LoRA adapter (tiny-lora's "legal",
    tests/conftest.py): the answer equals MODEL@NAME's and differs from the base model's,
    for encode and score; extract sends it too."""
    def dense(*args: str) -> np.ndarray:
        out = heron("encode", *args, "--url", base_url)
        assert out.returncode == 0, out.stderr
        return np.array([i["dense"] for i in json.loads(out.stdout)["items"]])

    texts = ("a contract between two parties", "the court found for the plaintiff")
    flagged = dense("tiny-lora", *texts, "--adapter", "legal")
    np.testing.assert_allclose(flagged, dense("tiny-lora@legal", *texts), atol=1e-6)
    assert not np.allclose(flagged, dense("tiny-lora", *texts), atol=1e-3)

    def scores(*args: str) -> list[float]:
        out = heron("score", *args, "--url", base_url)
        assert out.returncode == 0, out.stderr
        return [r["score"] for r in sorted(json.loads(out.stdout)["results"],
                                           key=lambda r: r["index"])]

    query = ("who won the case?", *texts)
    flagged_scores = scores("tiny-lora", *query, "--adapter", "legal")
    np.testing.assert_allclose(flagged_scores, scores("tiny-lora@legal", *query), atol=1e-6)
    assert not np.allclose(flagged_scores, scores("tiny-lora", *query), atol=1e-4)

    missing = heron("extract", "tiny-ner", "Ada Lovelace lived in London.", "--adapter",
                    "legal", "--url", base_url)
    assert missing.returncode == 1
    assert missing.stderr.startswith("heron: ADAPTER_NOT_FOUND [404] (adapter)"), missing.stderr
    both = heron("encode", "tiny-lora@legal", "x", "--adapter", "other", "--url", base_url)
    assert both.returncode == 1 and "INVALID_FIELD [422]" in both.stderr, both.stderr
