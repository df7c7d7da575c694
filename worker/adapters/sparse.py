"""SPLADE sparse embeddings: max over tokens of log(1 + relu(MLM logits))."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForMaskedLM

from heron.worker.adapters.base import Adapter, Batch
from heron_sdk.types import SparseVector


class SparseAdapter(Adapter):
    name = "sparse"

    def load_model(self, path: Path) -> torch.nn.Module:
        return AutoModelForMaskedLM.from_pretrained(str(path))

    def forward(self, batch: Batch) -> torch.Tensor:
        logits = self.model(**batch.model_inputs()).logits.float()
        weights = torch.log1p(torch.relu(logits)) * batch.attention_mask.unsqueeze(-1)
        return weights.max(dim=1).values  # [B, vocab]

    def postprocess(self, batch: Batch, output: torch.Tensor) -> list[dict[str, SparseVector]]:
        out = []
        for row in output.cpu():
            idx = torch.nonzero(row, as_tuple=True)[0]
            out.append({"sparse": SparseVector(indices=idx.numpy().astype(np.int32),
                                               values=row[idx].numpy().astype(np.float32))})
        return out
