"""Padded BERT batches through Heron's plain path (worker/adapters/plain_bert.py) give the
model's own hidden states at every real token; a batch run in a bigger bucket's static
tensors keeps them (checked on CPU with a replay that recomputes); and on CUDA the captured
graphs of worker/adapters/cuda_graphs.py give the eager path's (those tests need a GPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from heron.runtime.modelconfig import model_config_from_dir
from heron.worker.adapters.cuda_graphs import (
    CapturedPass,
    GraphedBert,
    bucket,
    cuda_graphs_enabled,
)
from heron.worker.adapters.dense import DenseAdapter
from heron.worker.adapters.plain_bert import PlainBert
from tests.support.tiny_models import build_sentencepiece_model, minilm_dir
from tests.unit.test_plain_bert import TEXTS

CUDA = torch.cuda.is_available()


def load(device: str = "cpu", dtype: torch.dtype = torch.float32) -> DenseAdapter:
    config = model_config_from_dir("m", "dense", minilm_dir())
    adapter = DenseAdapter(config, dataclasses.replace(config.profile, packing="off"))
    adapter.load(minilm_dir(), torch.device(device), dtype)
    return adapter


def padded(adapter: DenseAdapter, texts: list[str]):
    return adapter._collate_padded(adapter.tokenize(texts))


def real(states: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """The states at real tokens only (padding's are never read)."""
    return states.float().cpu()[mask.cpu().bool()].numpy()


def test_padded_plain_path_gives_the_models_states_at_real_tokens() -> None:
    adapter = load()
    plain = PlainBert.build(adapter.model)
    assert plain is not None
    with torch.inference_mode():
        batch = padded(adapter, TEXTS)
        assert batch.packing is None and batch.attention_mask.shape[0] == len(TEXTS)
        ours = plain.padded_states(batch.input_ids, batch.token_type_ids,
                                   batch.attention_mask)
        own = adapter.model(**batch.model_inputs()).last_hidden_state
    assert ours.shape == own.shape
    np.testing.assert_allclose(real(ours, batch.attention_mask),
                               real(own, batch.attention_mask), atol=1e-5)


def test_padded_plain_path_for_xlm_roberta(tmp_path: Path) -> None:
    """XLM-R's positions start after its padding index (2 here): the plain path's too."""
    path = build_sentencepiece_model(tmp_path / "xlmr")
    config = model_config_from_dir("x", "dense", path)
    adapter = DenseAdapter(config, config.profile)
    adapter.load(path, torch.device("cpu"), torch.float32)
    plain = PlainBert.build(adapter.model)
    assert plain is not None and plain.position_offset == 2
    assert GraphedBert(plain, torch.device("cpu")).max_width == 128  # 130 positions
    texts = ["paris", "the quick brown fox jumps over the lazy dog",
             "heron serves embeddings " * 6, "france is"]
    with torch.inference_mode():
        batch = padded(adapter, texts)
        ours = plain.padded_states(batch.input_ids, batch.token_type_ids,
                                   batch.attention_mask)
        own = adapter.model(**batch.model_inputs()).last_hidden_state
    assert batch.attention_mask.sum(1).tolist() != [batch.input_ids.shape[1]] * len(texts)
    np.testing.assert_allclose(real(ours, batch.attention_mask),
                               real(own, batch.attention_mask), atol=1e-5)


def test_buckets_and_the_switch() -> None:
    assert [bucket(r, 8) for r in (1, 2, 3, 4, 5, 17, 32, 33)] == [
        (1, 32), (2, 32), (4, 32), (4, 32), (8, 32), (32, 32), (32, 32), (64, 32)]
    assert [bucket(1, w)[1] for w in (1, 32, 33, 64, 65, 512)] == [32, 32, 64, 64, 96, 512]
    assert cuda_graphs_enabled({}) and cuda_graphs_enabled({"HERON_CUDA_GRAPHS": "1"})
    assert not cuda_graphs_enabled({"HERON_CUDA_GRAPHS": "0"})


def test_no_graphs_off_cuda() -> None:
    assert load().graphed_bert is None


def test_a_failed_capture_leaves_the_model_eager(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    adapter = load()
    plain = PlainBert.build(adapter.model)
    assert plain is not None
    graphed = GraphedBert(plain, torch.device("cpu"))
    tries = []

    def refuse(rows: int, width: int) -> None:
        tries.append((rows, width))
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graphed, "_capture", refuse)
    with torch.inference_mode():
        batch = padded(adapter, TEXTS)
        for _ in range(2):
            assert graphed.states(batch.input_ids, batch.token_type_ids,
                                  batch.attention_mask) is None
    assert tries == [(8, 96)] and graphed.failed and not graphed.graphs
    assert "runs eagerly" in caplog.text


class Recompute:
    """Stands for a captured graph on CPU: a replay computes the bucket's output again from
    its static tensors, as the graph's kernels do on the GPU."""

    def __init__(self, plain: PlainBert, captured: list[CapturedPass]) -> None:
        self.plain, self.captured = plain, captured

    def replay(self) -> None:
        c = self.captured[0]
        c.output.copy_(self.plain.padded_states(c.input_ids, c.token_type_ids,
                                                c.attention_mask))


def test_bucket_padding_keeps_each_rows_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static tensors a replay reads (rows and columns past the batch, left over from
    the bucket's last batch) change nothing at the batch's real tokens."""
    adapter = load()
    plain = PlainBert.build(adapter.model)
    assert plain is not None
    graphed = GraphedBert(plain, torch.device("cpu"))

    def capture(rows: int, width: int) -> CapturedPass:
        ids = torch.zeros(rows, width, dtype=torch.int64)
        mask = torch.zeros(rows, width, dtype=torch.int64)
        holder: list[CapturedPass] = []
        holder.append(CapturedPass(
            graph=Recompute(plain, holder),  # type: ignore[arg-type]
            input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=mask,
            output=torch.empty(rows, width, adapter.hidden_size)))
        return holder[0]
    monkeypatch.setattr(graphed, "_capture", capture)
    with torch.inference_mode():
        # In the bucket (8, 96): 6 rows of 92 tokens, then 5 of 92, then 5 of 70; then 3
        # rows of 92 in (4, 96), and the first batch again.
        shorter = [" ".join(["long"] * 68), *TEXTS[:3], TEXTS[4]]
        for texts in (TEXTS, TEXTS[:5], shorter, TEXTS[1:4], TEXTS):
            batch = padded(adapter, texts)
            states = graphed.states(batch.input_ids, batch.token_type_ids,
                                    batch.attention_mask)
            own = adapter.model(**batch.model_inputs()).last_hidden_state
            assert states is not None and states.shape == own.shape
            np.testing.assert_allclose(real(states, batch.attention_mask),
                                       real(own, batch.attention_mask), atol=1e-5)
    assert set(graphed.graphs) == {(8, 96), (4, 96)}


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_graph_replays_give_the_eager_states(dtype: torch.dtype) -> None:
    adapter = load("cuda", dtype)
    graphed = adapter.graphed_bert
    assert isinstance(graphed, GraphedBert)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for texts in (TEXTS, TEXTS[:1], TEXTS[1:4], TEXTS * 3, TEXTS[2:3]):
            batch = padded(adapter, texts)
            eager = adapter.model(**batch.model_inputs()).last_hidden_state
            for _ in range(2):  # the capture, then a replay
                states = adapter.hidden_states(batch)
                np.testing.assert_allclose(real(states, batch.attention_mask),
                                           real(eager, batch.attention_mask), atol=tolerance)
        assert set(graphed.graphs) == {(8, 96), (1, 32), (4, 96), (32, 96)}
    # A replaced weight: captured again, and the new weight is used.
    attention = adapter.model.encoder.layer[0].attention.self
    with torch.no_grad():
        attention.key.weight = torch.nn.Parameter(attention.key.weight * 0.5,
                                                  requires_grad=False)
    with torch.inference_mode():
        batch = padded(adapter, TEXTS)
        eager = adapter.model(**batch.model_inputs()).last_hidden_state
        states = adapter.hidden_states(batch)
        assert set(graphed.graphs) == {(8, 96)}
        np.testing.assert_allclose(real(states, batch.attention_mask),
                                   real(eager, batch.attention_mask), atol=tolerance)
        # Over the token bound: eager.
        assert graphed.states(torch.ones(64, 512, dtype=torch.int64, device="cuda"), None,
                              torch.ones(64, 512, dtype=torch.int64, device="cuda")) is None
