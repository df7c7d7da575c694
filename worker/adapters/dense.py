"""Dense sentence embeddings, computed as the checkpoint's sentence-transformers modules say:
Transformer -> Pooling (cls, mean, max, lasttoken, weightedmean, mean_sqrt_len_tokens) ->
Dense layers -> Normalize. A bare transformers checkpoint gets mean pooling, normalized
(last-token pooling for a causal decoder); a profile field that is set overrides.

Decoder embedders (Qwen3-Embedding, e5-mistral, gte-Qwen2) pool the last token, which must
be the EOS token: where the tokenizer does not append it, this adapter does, as their model
cards do by hand. Batches are right-padded (or packed), so the last real token is found by
length and the tokenizer's padding side does not matter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel

from heron.runtime.checkpoint import CheckpointError, DenseLayer
from heron.worker.adapters.base import Adapter, Batch, TextInput, Tokenized, to_numpy

log = logging.getLogger("heron.worker.adapters.dense")


def load_dense_layer(layer: DenseLayer) -> torch.nn.Module:
    """A sentence-transformers Dense module (``linear.weight``/``linear.bias``) as torch."""
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
    state = read_module_weights(layer.path)
    try:
        linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    except RuntimeError as exc:
        raise CheckpointError(f"{layer.path.name}: weights do not fit the layer: {exc}") from exc
    return torch.nn.Sequential(linear, activation_module(layer))


def activation_module(layer: DenseLayer) -> torch.nn.Module:
    """The layer's activation, a torch.nn class by the name its config gives."""
    activation = getattr(torch.nn, layer.activation, None)
    if activation is None:
        raise CheckpointError(f"{layer.path.name}: unknown activation {layer.activation!r}")
    return activation()


def read_module_weights(path: Path) -> dict[str, torch.Tensor]:
    """A sentence-transformers module folder's weights (safetensors, else a torch file)."""
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").exists():
        return torch.load(str(path / "pytorch_model.bin"), map_location="cpu",
                          weights_only=True)
    raise CheckpointError(f"{path.name}: no model.safetensors or pytorch_model.bin")


class DenseAdapter(Adapter):
    name = "dense"
    supports_packing = True

    def load_model(self, path: Path) -> torch.nn.Module:
        ckpt = self.checkpoint
        self.pooling = self.profile.pooling or ckpt.pooling or (
            "lasttoken" if ckpt.is_decoder else "mean")
        if self.pooling == "last":
            self.pooling = "lasttoken"
        self.normalize = (self.profile.normalize if self.profile.normalize is not None
                          else ckpt.normalize if ckpt.normalize is not None else True)
        self.dense_layers = torch.nn.ModuleList(load_dense_layer(d) for d in ckpt.dense_layers)
        model = AutoModel.from_pretrained(str(path), **self.remote_code)
        model.heron_dense_layers = self.dense_layers  # moved and cast with the model
        return model

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().load(path, device, dtype)
        out = self.checkpoint.dense_layers[-1].out_features if self.checkpoint.dense_layers \
            else self.hidden_size
        self.dimensions = out
        self.eos_id = self.tokenizer.eos_token_id
        self.append_eos = False
        if self.pooling == "lasttoken" and self.checkpoint.is_decoder and self.eos_id is not None:
            probe = self.tokenizer("a")["input_ids"]
            self.append_eos = not probe or probe[-1] != self.eos_id
            if self.append_eos:
                log.info("model %s: the tokenizer does not end texts with EOS; appending it",
                         self.config.id)

    def packing_refusal(self) -> str | None:
        if not self.checkpoint.pooling_include_prompt:
            return "its Pooling leaves prompt tokens out, which the padded path does"
        return None

    def _encode(self, inputs: list[TextInput], max_length: int) -> list[Tokenized]:
        if not self.append_eos:
            return super()._encode(inputs, max_length)
        out = super()._encode(inputs, max_length - 1)
        for t in out:
            t.input_ids = [*t.input_ids, self.eos_id]
            if t.token_type_ids is not None:
                t.token_type_ids = [*t.token_type_ids, 0]
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pooling": self.pooling, "normalize": self.normalize}

    def forward(self, batch: Batch) -> torch.Tensor:
        hidden = self.hidden_states(batch)
        pooled = (self._pool_packed(hidden[0], batch) if batch.packing is not None
                  else self._pool_padded(hidden, batch))
        for layer in self.dense_layers:
            pooled = layer(pooled.to(layer[0].weight.dtype))
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled

    def _pool_packed(self, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        packing, lengths = batch.packing, batch.lengths
        assert packing is not None
        mode = self.pooling
        if mode == "cls":
            return packing.first(tokens)
        if mode == "lasttoken":
            return packing.last(tokens, lengths)
        if mode == "max":
            return packing.max(tokens)
        if mode == "weightedmean":
            assert batch.position_ids is not None
            weights = (batch.position_ids[0, : len(packing.segment_ids)] + 1).to(tokens.dtype)
            return packing.sum(tokens, weights) / packing.sum(weights.unsqueeze(-1)).clamp(
                min=1e-9)
        total = packing.sum(tokens)
        count = lengths.unsqueeze(-1).to(tokens.dtype)
        return total / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)

    def _pool_padded(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        mode = self.pooling
        if mode == "cls":
            return hidden[:, 0]
        if mode == "lasttoken":
            return hidden[torch.arange(hidden.shape[0], device=hidden.device),
                          batch.lengths - 1]
        mask = batch.attention_mask.unsqueeze(-1).to(hidden.dtype)
        if any(t.prompt_tokens for t in batch.items):
            mask = mask.clone()
            for row, item in enumerate(batch.items):
                mask[row, : item.prompt_tokens] = 0
        if mode == "max":
            return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
        if mode == "weightedmean":
            positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device)
            weights = mask * positions.view(1, -1, 1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        total = (hidden * mask).sum(1)
        count = mask.sum(1).clamp(min=1e-9)
        return total / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)

    def postprocess(self, batch: Batch, output: torch.Tensor) -> list[dict[str, np.ndarray]]:
        return [{"dense": row} for row in to_numpy(output)]
