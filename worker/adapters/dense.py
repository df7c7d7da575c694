"""Dense sentence embeddings: pooled hidden states (mean, cls or last token), normalized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel

from heron.worker.adapters.base import Adapter, Batch, masked_mean, to_numpy


class DenseAdapter(Adapter):
    name = "dense"
    supports_packing = True

    def load_model(self, path: Path) -> torch.nn.Module:
        return AutoModel.from_pretrained(str(path))

    def forward(self, batch: Batch) -> torch.Tensor:
        hidden = self.model(**batch.model_inputs()).last_hidden_state
        pooling = self.profile.pooling
        if batch.packing is not None:
            tokens = hidden[0]
            if pooling == "cls":
                pooled = batch.packing.first(tokens)
            elif pooling == "last":
                pooled = batch.packing.last(tokens, batch.lengths)
            else:
                pooled = batch.packing.mean(tokens, batch.lengths)
        elif pooling == "cls":
            pooled = hidden[:, 0]
        elif pooling == "last":
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device),
                            batch.lengths - 1]
        else:
            pooled = masked_mean(hidden, batch.attention_mask)
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=-1) if self.profile.normalize else pooled

    def postprocess(self, batch: Batch, output: torch.Tensor) -> list[dict[str, np.ndarray]]:
        return [{"dense": row} for row in to_numpy(output)]
