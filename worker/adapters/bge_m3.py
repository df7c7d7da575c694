"""BGE-M3 (FlagEmbedding's M3 format): dense, sparse and ColBERT vectors from one forward pass.

The checkpoint is a transformers encoder (XLM-R for BGE-M3 itself) with two heads saved
beside it as torch state dicts: ``colbert_linear.pt`` (hidden -> colbert dim) and
``sparse_linear.pt`` (hidden -> 1). As FlagEmbedding's M3Embedder computes them:
- dense: the [CLS] token's hidden state, L2-normalized;
- sparse: ``relu(sparse_linear(h))`` per token, the largest weight for each vocabulary id,
  keeping only positive weights and dropping the tokenizer's CLS, EOS, PAD and UNK ids
  (other special tokens, such as BERT's [SEP], stay: FlagEmbedding keeps them);
- multi_vector: ``colbert_linear(h)`` for every token after [CLS] (the closing EOS/[SEP]
  included), each L2-normalized.
A request picks any of the three; all come from the same pass. ``score`` is the cosine of
the dense vectors (FlagEmbedding's dense score: the inner product of normalized vectors).

Texts are cut at the model's own limit (BGE-M3: 8192 tokens), where FlagEmbedding's encode
cuts at its query/passage_max_length argument (512 unless given). The checkpoint's
sentence-transformers files, where it ships them, do not change pooling, prompts or case:
FlagEmbedding reads none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel

from heron.runtime.checkpoint import CheckpointError
from heron.worker.adapters.base import Adapter, Batch, masked_mean, to_numpy
from heron_sdk.types import SparseVector

# FlagEmbedding's pooling methods for the dense vector; BGE-M3 uses cls.
POOLINGS = ("cls", "mean")


def _load_head(path: Path, hidden: int, out_features: int | None) -> torch.nn.Linear:
    """A head saved as ``torch.save(linear.state_dict())``; its shape is the file's."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or non-torch file: say which one
        raise CheckpointError(f"{path.name}: cannot be read as a torch state dict: {exc}") \
            from exc
    weight = state.get("weight") if isinstance(state, dict) else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden \
            or (out_features is not None and weight.shape[0] != out_features):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        want = f"[{out_features if out_features is not None else 'n'}, {hidden}]"
        raise CheckpointError(f"{path.name}: expected a Linear state dict with weight {want} "
                              f"(the backbone's hidden size is {hidden}), found {shape}")
    linear = torch.nn.Linear(hidden, int(weight.shape[0]), bias="bias" in state)
    try:
        linear.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{path.name}: weights do not fit a Linear layer: {exc}") from exc
    return linear


class BgeM3Adapter(Adapter):
    name = "bge_m3"
    # Padded batches only: packing has not been checked against FlagEmbedding's answers
    # (XLM-R also derives its position ids from the padding token).
    supports_packing = False

    def load_model(self, path: Path) -> torch.nn.Module:
        self.pooling = self.profile.pooling or "cls"
        if self.pooling not in POOLINGS:
            raise CheckpointError(f"BGE-M3 pools its dense vector by {' or '.join(POOLINGS)}, "
                                  f"not {self.pooling!r}")
        # FlagEmbedding normalizes the dense and the ColBERT vectors together.
        self.normalize = self.profile.normalize if self.profile.normalize is not None else True
        model = AutoModel.from_pretrained(str(path), **self.remote_code)
        hidden = int(getattr(model.config, "hidden_size", 0) or 0)
        # Attached to the backbone so that .to(device, dtype) moves and casts them with it.
        model.heron_colbert_linear = _load_head(path / "colbert_linear.pt", hidden, None)
        model.heron_sparse_linear = _load_head(path / "sparse_linear.pt", hidden, 1)
        return model

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().load(path, device, dtype)
        # XLM-R/RoBERTa number positions from padding_idx + 1: 8194 position embeddings hold
        # 8192 tokens. The base limit reads max_position_embeddings alone.
        embeddings = getattr(self.model, "embeddings", None)
        offset = getattr(embeddings, "padding_idx", None)
        if isinstance(offset, int) and hasattr(embeddings, "create_position_ids_from_input_ids"):
            positions = int(self.model.config.max_position_embeddings)
            self.max_length = min(self.max_length, positions - offset - 1)
        # FlagEmbedding neither lowercases nor reads sentence-transformers' do_lower_case.
        self.lowercase = False
        self.dimensions = self.hidden_size
        self.colbert_dimensions = int(self.model.heron_colbert_linear.out_features)
        tok = self.tokenizer
        # The ids FlagEmbedding leaves out of the lexical weights (those the tokenizer has).
        dropped = {tok.cls_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
        self.dropped_ids = np.asarray(sorted(i for i in dropped if i is not None),
                                      dtype=np.int64)

    def prompt(self, query: bool, override: str | None = None,
               input_type: str | None = None) -> str:
        """The request's instruction, else the profile's; never the checkpoint's
        sentence-transformers prompts, which FlagEmbedding's M3 does not apply (BGE-M3 takes
        no instruction)."""
        if override is not None:
            return override
        configured = (self.profile.query_instruction if query
                      else self.profile.document_instruction)
        return configured or ""

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pooling": self.pooling, "normalize": self.normalize,
                "multi_vector_dimensions": self.colbert_dimensions}

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.hidden_states(batch)
        mask = batch.attention_mask
        dense = hidden[:, 0] if self.pooling == "cls" else masked_mean(hidden, mask)
        weights = torch.relu(self.model.heron_sparse_linear(hidden)).squeeze(-1)
        colbert = self.model.heron_colbert_linear(hidden[:, 1:])
        colbert = colbert * mask[:, 1:].unsqueeze(-1).to(colbert.dtype)
        dense, colbert = dense.float(), colbert.float()
        if self.normalize:
            dense = F.normalize(dense, p=2, dim=-1)
            colbert = F.normalize(colbert, p=2, dim=-1)
        return dense, weights.float(), colbert

    def postprocess(self, batch: Batch, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                    ) -> list[dict[str, Any]]:
        dense, weights, colbert = (to_numpy(t) for t in output)
        results = []
        for row, item in enumerate(batch.items):
            n = item.length
            results.append({"dense": dense[row],
                            "sparse": self._lexical(np.asarray(item.input_ids[:n]),
                                                    weights[row, :n]),
                            # Every token but [CLS]: n - 1 vectors.
                            "multi_vector": colbert[row, : n - 1]})
        return results

    def _lexical(self, ids: np.ndarray, weights: np.ndarray) -> SparseVector:
        """Per vocabulary id, its largest positive token weight; dropped ids left out."""
        keep = (weights > 0) & ~np.isin(ids, self.dropped_ids)
        ids, weights = ids[keep], weights[keep]
        terms, where = np.unique(ids, return_inverse=True)
        values = np.zeros(len(terms), dtype=np.float32)
        np.maximum.at(values, where, weights)
        return SparseVector(indices=terms.astype(np.int32), values=values)
