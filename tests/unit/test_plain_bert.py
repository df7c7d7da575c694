"""Heron's plain BERT path for packed batches (worker/adapters/plain_bert.py) gives the
model's own hidden states, holds the weights once, and steps aside whenever the model is no
longer as loaded."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest
import torch

from heron.runtime.modelconfig import model_config_from_dir
from heron.worker.adapters.dense import DenseAdapter
from heron.worker.adapters.plain_bert import PlainBert
from heron.worker.memory import module_bytes
from tests.support.tiny_models import minilm_dir

TEXTS = ["a", "herons stand still in shallow water", "mid length text here",
         " ".join(["long"] * 90), "two words", " ".join(["river"] * 30)]


def load(bf16: bool = False) -> DenseAdapter:
    config = model_config_from_dir("m", "dense", minilm_dir())
    adapter = DenseAdapter(config, config.profile)
    adapter.load(minilm_dir(), torch.device("cpu"), torch.float32)
    if bf16:
        adapter.store_matmul_weights(torch.bfloat16)
    assert adapter.packed and adapter.plain_bert is not None
    return adapter


def both(adapter: DenseAdapter, bf16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(the adapter's hidden states, the model's own forward's) for TEXTS, packed."""
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    with torch.inference_mode(), autocast:
        batch = adapter.collate(adapter.tokenize(TEXTS))
        assert batch.packing is not None
        ours = adapter.hidden_states(batch).float().numpy()
        own = adapter.model(**batch.model_inputs()).last_hidden_state.float().numpy()
    return ours, own


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_plain_path_gives_the_models_hidden_states(bf16: bool) -> None:
    adapter = load(bf16)
    assert adapter.plain_bert is not None and adapter.plain_bert.usable()
    ours, own = both(adapter, bf16)
    assert ours.shape == own.shape
    # Adding the embeddings in another order already moved bf16 states by 0.01-0.02.
    np.testing.assert_allclose(ours, own, atol=1e-3 if bf16 else 1e-5)


def test_fused_projections_hold_the_weights_once() -> None:
    adapter = load()
    attention = adapter.model.encoder.layer[0].attention.self
    before = [m.weight.detach().clone() for m in (attention.query, attention.key,
                                                    attention.value)]
    size = module_bytes(adapter.model)
    both(adapter)  # the first pass fuses
    weights = [attention.query.weight, attention.key.weight, attention.value.weight]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    for w, b in zip(weights, before, strict=True):
        assert torch.equal(w, b)
    assert module_bytes(adapter.model) == size


def test_a_weight_changed_or_replaced_after_fusing_is_used() -> None:
    adapter = load()
    both(adapter)
    attention = adapter.model.encoder.layer[2].attention.self
    with torch.no_grad():
        attention.key.weight.mul_(0.5)  # in place: a slice of the fused weight
        attention.value.weight = torch.nn.Parameter(attention.value.weight * 2)  # replaced
    ours, own = both(adapter)
    np.testing.assert_allclose(ours, own, atol=1e-5)


class Shifted(torch.nn.Module):
    """Stands for a wrapper such as LoRA's: the layer's output, changed."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 0.5


def test_steps_aside_for_a_replaced_module_or_training_mode() -> None:
    adapter = load()
    plain, _ = both(adapter)
    attention = adapter.model.encoder.layer[1].attention.self
    attention.value = Shifted(attention.value)
    assert adapter.plain_bert is not None and not adapter.plain_bert.usable()
    ours, own = both(adapter)
    np.testing.assert_array_equal(ours, own)  # the model's forward, wrapper and all
    assert np.abs(ours - plain).max() > 0.01
    attention.value = attention.value.base
    assert adapter.plain_bert.usable()
    adapter.model.train()
    assert not adapter.plain_bert.usable()


def test_released_model_drops_the_path() -> None:
    adapter = load()
    adapter.release()
    assert adapter.plain_bert is None


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_scripted_layers_match_the_eager_loop_bit_for_bit(bf16: bool) -> None:
    """Packed batches run the layers as one TorchScript call (adapters/scripted_bert.py),
    on an inference thread as the worker runs them; the eager loop gives the same bits."""
    adapter = load(bf16)
    plain = adapter.plain_bert
    assert plain is not None and plain.scripted is not None
    scripted = plain.scripted
    results: dict[str, np.ndarray] = {}

    def on_a_thread(name: str) -> None:
        def run() -> None:
            results[name] = both(adapter, bf16)[0]
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    on_a_thread("scripted")
    plain.scripted = None
    on_a_thread("eager")
    plain.scripted = scripted
    on_a_thread("scripted again")  # its plan was made once; the same answer
    np.testing.assert_array_equal(results["scripted"], results["eager"])
    np.testing.assert_array_equal(results["scripted again"], results["eager"])


def test_scripted_layers_only_for_exact_gelu() -> None:
    """Another activation (tanh-approximated GELU here) keeps the eager loop, which calls
    the model's own activation module."""
    from transformers.activations import ACT2FN

    adapter = load()
    for layer in adapter.model.encoder.layer:
        layer.intermediate.intermediate_act_fn = ACT2FN["gelu_new"]
    rebuilt = PlainBert.build(adapter.model)
    assert rebuilt is not None and rebuilt.scripted is None
    adapter.plain_bert = rebuilt
    ours, own = both(adapter)
    np.testing.assert_allclose(ours, own, atol=1e-5)


def test_scripted_layers_on_two_threads_at_once_keep_each_batchs_answer() -> None:
    """Two inference threads share the scripted function, as a worker's
    ``--inference-threads 2`` do; each batch's states are what it gives alone."""
    adapter = load(bf16=True)
    batches = [adapter.collate(adapter.tokenize(texts)) for texts in (TEXTS, TEXTS[::-1][:4])]

    def states(batch: Any) -> torch.Tensor:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return adapter.hidden_states(batch)
    alone = [states(batch) for batch in batches]
    wrong: list[int] = []

    def run(index: int) -> None:
        for _ in range(10):
            if not torch.equal(states(batches[index]), alone[index]):
                wrong.append(index)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_an_activation_replaced_after_loading_takes_the_eager_loop() -> None:
    adapter = load()
    before, _ = both(adapter)
    layer = adapter.model.encoder.layer[3].intermediate
    layer.intermediate_act_fn = torch.nn.ReLU()
    ours, own = both(adapter)
    np.testing.assert_allclose(ours, own, atol=1e-5)  # the ReLU, as the model computes it
    assert np.abs(ours - before).max() > 0.01
