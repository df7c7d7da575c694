"""Tokenizing from many threads at once keeps truncation flags right (a fast tokenizer's
truncation settings are shared mutable state)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from heron.runtime.modelconfig import model_config_from_dir
from heron.worker.adapters.dense import DenseAdapter
from tests.support.tiny_models import minilm_dir


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
