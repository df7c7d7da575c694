"""Packed batches (no padding) give the same vectors as padded ones."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from heron.runtime.modelconfig import model_config_from_dir
from heron.worker.adapters.dense import DenseAdapter
from heron.worker.batcher import TokenBudgetBatcher, WorkItem
from tests.support.tiny_models import build_sentencepiece_model, minilm_dir

TEXTS = ["a", "a somewhat longer sentence about herons and rivers",
         "mid length text here", " ".join(["long"] * 120)]


def load(pooling: str, packing: str) -> DenseAdapter:
    config = model_config_from_dir("m", "dense", minilm_dir(), pooling=pooling,
                                   packing=packing)
    adapter = DenseAdapter(config, config.profile)
    adapter.load(minilm_dir(), torch.device("cpu"), torch.float32)
    return adapter


def embed(adapter: DenseAdapter, texts: list[str]) -> np.ndarray:
    with torch.inference_mode():
        batch = adapter.collate(adapter.tokenize(texts))
        return np.stack([r["dense"] for r in adapter.postprocess(batch,
                                                                 adapter.forward(batch))])


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_packed_equals_padded(pooling: str) -> None:
    packed, padded = load(pooling, "auto"), load(pooling, "off")
    assert packed.packed and not padded.packed
    np.testing.assert_allclose(embed(packed, TEXTS), embed(padded, TEXTS), atol=1e-5)
    # and equal to each text alone (no cross-talk between packed items)
    alone = np.stack([embed(packed, [t])[0] for t in TEXTS])
    np.testing.assert_allclose(embed(packed, TEXTS), alone, atol=1e-5)


def test_families_with_offset_positions_are_padded(tmp_path) -> None:
    path = build_sentencepiece_model(tmp_path / "sp")
    config = model_config_from_dir("sp", "dense", path)
    adapter = DenseAdapter(config, config.profile)
    adapter.load(path, torch.device("cpu"), torch.float32)
    assert not adapter.packed  # XLM-R positions start after padding_idx


async def test_packed_batcher_counts_real_tokens_not_padding() -> None:
    loop = asyncio.get_running_loop()
    kwargs = dict(max_batch_tokens=200, max_batch_items=64, max_wait_s=0.0,
                  max_queue_items=100)
    padded = TokenBudgetBatcher(**kwargs)
    packed = TokenBudgetBatcher(**kwargs, packed=True)
    for b in (padded, packed):
        b.submit([WorkItem(payload=n, length=n, priority=0, deadline=None,
                           future=loop.create_future()) for n in [5] * 10 + [100]])
    # Padded: mixing the 100-token item with short ones wastes 95 tokens each.
    assert sorted(w.length for w in await padded.next_batch()) == [5] * 10
    # Packed: 10 x 5 + 100 = 150 real tokens fit the budget in one forward pass.
    assert len(await packed.next_batch()) == 11


def test_packed_lengths_round_up_to_few_shapes() -> None:
    from heron.worker.adapters.packing import bucketed_length

    sizes = {bucketed_length(t) for t in range(1, 8193)}
    assert len(sizes) <= 110  # oneDNN builds kernels per shape: keep them few
    for t in range(1, 8193):
        b = bucketed_length(t)
        assert t <= b <= max(t + 7, t * 1.125)


def test_padding_of_a_long_packed_batch_stays_within_the_models_positions(
        tiny_models: dict) -> None:
    """Rounding 47 x 60 = 2820 real tokens up to 3072 pads by 252 tokens: more than this
    model's 128 positions."""
    import torch

    from heron.runtime.modelconfig import parse_model_config
    from heron.worker.adapters.dense import DenseAdapter

    config = parse_model_config({
        "id": "t/pack", "adapter": "dense", "source": {"path": str(tiny_models["tiny-dense-cls"])},
        "profiles": {"default": {"max_sequence_length": 60}}})
    adapter = DenseAdapter(config, config.profile)
    adapter.load(tiny_models["tiny-dense-cls"], torch.device("cpu"), torch.float32)
    assert adapter.packed
    items = adapter.tokenize(["x " * 58] * 47)
    assert {t.length for t in items} == {60}
    with torch.inference_mode():
        batch = adapter.collate(items)
        assert batch.input_ids.shape[1] - 2820 > adapter.model.config.max_position_embeddings
        vectors = adapter.postprocess(batch, adapter.forward(batch))
    assert len(vectors) == 47


def test_attention_groups_cover_each_token_once_with_similar_lengths() -> None:
    from heron.worker.adapters.packing import GROUP_LENGTH_RATIO, attention_groups

    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 257, size=64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    segments = [(int(s), int(s + n)) for s, n in zip(starts, lengths, strict=True)]
    groups = attention_groups(segments, torch.device("cpu"))
    assert 1 < len(groups) < len(segments)  # fewer attention calls than items
    rows = np.concatenate([g.rows.numpy() for g in groups])
    assert sorted(rows.tolist()) == list(range(int(lengths.sum())))  # every token, once
    for g in groups:
        gathered = g.gather.numpy().reshape(g.items, g.length)
        real = gathered if g.valid is None else gathered.reshape(-1)[g.valid.numpy()]
        assert np.array_equal(np.sort(real.reshape(-1)), np.sort(g.rows.numpy()))
        item_lengths = (g.mask.view(g.items, g.length).sum(1).numpy() if g.mask is not None
                        else np.full(g.items, g.length))
        assert item_lengths.max() == g.length
        assert item_lengths.min() >= GROUP_LENGTH_RATIO * g.length


def test_many_mixed_lengths_packed_equal_each_text_alone() -> None:
    """Items grouped for attention (padded to their group's longest and masked) get the
    vectors they get alone."""
    adapter = load("mean", "auto")
    texts = [" ".join(["word"] * n) for n in (1, 2, 3, 5, 8, 9, 13, 20, 21, 34, 40, 55, 89,
                                               100, 120)]
    together = embed(adapter, texts)
    alone = np.stack([embed(adapter, [t])[0] for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)
