"""Tokenizing from many threads at once keeps truncation flags right (a fast tokenizer's
truncation settings are shared mutable state)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from heron.runtime.modelconfig import model_config_from_dir
from heron.worker.adapters.dense import DenseAdapter
from tests.support.tiny_models import build_sentencepiece_model, minilm_dir


def test_concurrent_tokenize_flags_truncation_every_time() -> None:
    config = model_config_from_dir("m", "dense", minilm_dir(), max_sequence_length=32)
    adapter = DenseAdapter(config, config.profile)
    adapter.load(minilm_dir(), torch.device("cpu"), torch.float32)
    long_text, short_text = "word " * 200, "a short one"

    def run(i: int) -> tuple[bool, int]:
        (t,) = adapter.tokenize([long_text if i % 2 else short_text])
        return t.truncated, t.length

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(2000)))
    assert all(r == (True, 32) for r in results[1::2])
    assert all(r == (False, 5) for r in results[0::2])


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["wordpiece", "sentencepiece"])
def test_plain_texts_tokenize_as_transformers_does(family: str, side: str,
                                                   tmp_path: Path) -> None:
    """Single texts skip transformers' per-call conversion (the Rust tokenizer's fast
    batch encode): the same ids and type ids as transformers' own call, truncation side
    and special-looking text included."""
    path = minilm_dir() if family == "wordpiece" else build_sentencepiece_model(tmp_path / "sp")
    config = model_config_from_dir("m", "dense", path, max_sequence_length=24)
    adapter = DenseAdapter(config, config.profile)
    adapter.load(path, torch.device("cpu"), torch.float32)
    adapter.tokenizer.truncation_side = side
    texts = ["", " ", "paris is the capital of france", "word " * 60,
             "Ünïcödé 東京 🙂 [SEP] [CLS] <s> </s>", "a\tb\nc", "the quick brown fox " * 3]
    ours = adapter.tokenize(texts)
    theirs = adapter.tokenizer(texts, truncation=True, max_length=24)
    assert [t.input_ids for t in ours] == theirs["input_ids"]
    assert [t.token_type_ids for t in ours] == theirs.get("token_type_ids",
                                                          [None] * len(texts))
    assert [t.truncated for t in ours] == [len(t) > 24 for t in adapter.tokenizer(
        texts, add_special_tokens=True)["input_ids"]]
