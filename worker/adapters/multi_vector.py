"""Multi-vector (ColBERT-style) embeddings: one normalized vector per real token.

Padding and special tokens ([CLS], [SEP], ...) are dropped. ``dense`` is also offered: the
normalized mean of the same token vectors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel

from heron.worker.adapters.base import Adapter, Batch, masked_mean, to_numpy


class MultiVectorAdapter(Adapter):
    name = "multi_vector"
    needs_special_mask = True

    def load_model(self, path: Path) -> torch.nn.Module:
        return AutoModel.from_pretrained(str(path))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(**batch.model_inputs()).last_hidden_state.float()
        keep = batch.attention_mask.clone()
        for row, item in enumerate(batch.items):
            if item.special_mask is not None:
                keep[row, : item.length] *= 1 - torch.tensor(item.special_mask,
                                                              device=keep.device)
        tokens = F.normalize(hidden, p=2, dim=-1)
        pooled = F.normalize(masked_mean(hidden, keep), p=2, dim=-1)
        return tokens, keep, pooled

    def postprocess(self, batch: Batch, output: tuple) -> list[dict[str, np.ndarray]]:
        tokens, keep, pooled = output
        tokens_np, keep_np, pooled_np = to_numpy(tokens), keep.cpu().numpy(), to_numpy(pooled)
        return [{"multi_vector": tokens_np[row][keep_np[row].astype(bool)],
                 "dense": pooled_np[row]} for row in range(len(batch.items))]
