"""SPLADE sparse embeddings: log(1 + relu(MLM logits)), max (or sum) over tokens, as
sentence-transformers' SparseEncoder (MLMTransformer + SpladePooling) computes them.

Inference-free SPLADE (a SparseEncoder ``Router`` whose query route is a
``SparseStaticEmbedding``): queries never reach the transformer; a query's vector is the
static weight of each vocabulary id it contains (tokenized without special tokens).
Documents take the route's MLM transformer and pooling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from heron.runtime.checkpoint import CheckpointError
from heron.worker.adapters.base import Adapter, Batch, TextInput, Tokenized
from heron_sdk.types import SparseVector


class SparseAdapter(Adapter):
    # Its own tokenization (query marks, static query weights) takes texts only.
    accepts_token_ids = False
    name = "sparse"

    def load_model(self, path: Path) -> torch.nn.Module:
        self.pooling = self.checkpoint.splade_pooling or "max"
        if self.pooling not in ("max", "sum"):
            raise CheckpointError(f"SpladePooling: pooling_strategy {self.pooling!r} is not "
                                  "served (max or sum)")
        self.static_weights: torch.Tensor | None = None
        static = self.checkpoint.inference_free_query
        if static is not None:
            from safetensors.torch import load_file

            state = load_file(str(static / "model.safetensors"))
            self.static_weights = state["weight"].float()
            self.static_tokenizer = AutoTokenizer.from_pretrained(str(static),
                                                                  **self.remote_code)
        return self.load_with_head(AutoModelForMaskedLM, path)  # its MLM head makes the terms

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().load(path, device, dtype)
        self.dimensions = int(self.model.config.vocab_size)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "splade_pooling": self.pooling,
                "inference_free_query": self.static_weights is not None}

    def _tokenize_locked(self, inputs: list[TextInput], query: bool) -> list[Tokenized]:
        if not (query and self.static_weights is not None):
            return super()._tokenize_locked(inputs, query)
        limit = self.static_tokenizer.model_max_length
        limit = limit if limit and limit < 1_000_000 else self.max_length
        out = []
        for text in inputs:
            assert isinstance(text, str)
            ids = self.static_tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Tokenized(input_ids=ids[:limit] or [0], token_type_ids=None,
                                 truncated=len(ids) > limit, text=text, query=True))
        return out

    def forward(self, batch: Batch) -> list[torch.Tensor]:
        """One [vocab] row per item: documents through the model, static queries by lookup."""
        rows: list[torch.Tensor | None] = [None] * len(batch.items)
        docs = [i for i, t in enumerate(batch.items)
                if not (t.query and self.static_weights is not None)]
        if docs:
            sub = batch if len(docs) == len(batch.items) else self.collate(
                [batch.items[i] for i in docs])
            logits = self.model(**sub.model_inputs()).logits.float()
            weights = torch.log1p(torch.relu(logits)) * sub.attention_mask.unsqueeze(-1)
            pooled = weights.max(dim=1).values if self.pooling == "max" else weights.sum(dim=1)
            for row, i in zip(pooled.cpu(), docs, strict=True):
                rows[i] = row
        for i, item in enumerate(batch.items):
            if rows[i] is None:
                assert self.static_weights is not None
                present = torch.zeros_like(self.static_weights)
                # An empty query was given one pad id to have a length: it has no terms.
                ids = set(item.input_ids) - {self.static_tokenizer.pad_token_id}
                present[torch.tensor(sorted(ids), dtype=torch.long)] = 1.0
                rows[i] = present * self.static_weights
        return [r for r in rows if r is not None]

    def postprocess(self, batch: Batch, output: list[torch.Tensor]
                    ) -> list[dict[str, SparseVector]]:
        out = []
        for row in output:
            idx = torch.nonzero(row, as_tuple=True)[0]
            out.append({"sparse": SparseVector(indices=idx.numpy().astype(np.int32),
                                               values=row[idx].numpy().astype(np.float32))})
        return out
