"""Cross-encoder reranking: (query, document) pairs through a sequence classifier."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from heron.worker.adapters.base import Adapter, Batch


class CrossEncoderAdapter(Adapter):
    name = "cross_encoder"

    def load_model(self, path: Path) -> torch.nn.Module:
        return self.load_with_head(AutoModelForSequenceClassification, path)

    def forward(self, batch: Batch) -> torch.Tensor:
        logits = self.model(**batch.model_inputs()).logits.float()
        # The profile's, else the CrossEncoder's saved activation_fn, else sentence-
        # transformers' default (sigmoid for one label).
        activation = self.profile.activation or self.checkpoint.activation or "sigmoid"
        if logits.shape[-1] == 1:
            scores = logits[:, 0]
            # softmax over one logit is always 1; for one-logit models it means sigmoid.
            return scores if activation == "none" else torch.sigmoid(scores)
        # Several labels: the last one is "relevant" (the usual 2-label convention).
        if activation == "none":
            return logits[:, -1]
        return torch.softmax(logits, dim=-1)[:, -1]

    def postprocess(self, batch: Batch, output: torch.Tensor) -> list[float]:
        return [float(x) for x in output.cpu().tolist()]
