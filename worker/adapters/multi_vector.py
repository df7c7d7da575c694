"""Late-interaction (ColBERT) embeddings: one normalized vector per token, scored by MaxSim.

A PyLate checkpoint (``config_sentence_transformers.json`` with its query/document settings,
read into ``Checkpoint.colbert``) is served as PyLate's ``encode(..., is_query=...)``
computes it:
- the texts are stripped (and lowercased where ``sentence_bert_config.json`` says), then
  tokenized with truncation at ``query_length`` or ``document_length`` counting the prefix
  token that is then inserted after the first token ([CLS]);
- queries are padded to ``query_length`` with the [MASK] token (query expansion), and those
  tokens are seen by attention only if ``attend_to_expansion_tokens``; all their vectors are
  returned;
- documents lose the vectors of their ``skiplist_words`` tokens (punctuation by default);
- the Dense projection(s) of ``1_Dense``..., then each token vector is normalized.

A Stanford ColBERT checkpoint (colbert-ai's ``HF_ColBERT``: colbert-ir/colbertv2.0,
answerai-colbert-small-v1) is served as PyLate loads it: the settings of ``artifact.metadata``
in PyLate's names (heron/runtime/checkpoint.py), and the projection is the bias-free
``linear.weight`` stored in the backbone's own weights file(s).

A bare transformers checkpoint keeps the simple form: normalized hidden states of the real
tokens, special tokens dropped, queries and documents alike.

Outputs: ``multi_vector``; ``dense``, the normalized mean of the token vectors; ``muvera``,
the fixed-dimensional encoding of the token vectors (worker/muvera.py), computed only when
asked for. ``score`` ranks by MaxSim: the sum over the query's vectors of the best dot
product with any of the document's.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel

from heron.runtime.checkpoint import CheckpointError, DenseLayer
from heron.worker.adapters.base import (
    Adapter,
    Batch,
    TextInput,
    Tokenized,
    masked_mean,
    to_numpy,
)
from heron.worker.adapters.dense import activation_module, load_dense_layer, read_module_weights
from heron.worker.muvera import Muvera

# PyLate's defaults for settings its config leaves out.
DEFAULT_QUERY_PREFIX = "[Q] "
DEFAULT_DOCUMENT_PREFIX = "[D] "
DEFAULT_QUERY_LENGTH = 32
DEFAULT_DOCUMENT_LENGTH = 180
# Document tokens scored in one matrix product (bounds MaxSim's memory on big requests).
MAXSIM_BLOCK_TOKENS = 65536


class _ResidualDense(torch.nn.Module):
    """PyLate's Dense with ``use_residual``: ``activation(W x + b) + R x`` (R the identity
    where the widths agree)."""

    def __init__(self, layer: DenseLayer) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        self.activation = activation_module(layer)
        self.residual = (torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
                         if layer.in_features != layer.out_features else None)
        try:
            self.load_state_dict(read_module_weights(layer.path))
        except RuntimeError as exc:
            raise CheckpointError(f"{layer.path.name}: weights do not fit the layer: {exc}"
                                  ) from exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.residual is None else self.residual(x)
        return self.activation(self.linear(x)) + skip


def _stanford_projection(root: Path, name: str) -> torch.nn.Module:
    """The bias-free projection colbert-ai's HF_ColBERT keeps beside its ``bert`` weights,
    read alone (safetensors, sharded safetensors, or pytorch_model.bin)."""
    tensor: torch.Tensor | None = None
    files = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    if (root / "model.safetensors.index.json").exists():
        try:
            index = json.loads((root / "model.safetensors.index.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"model.safetensors.index.json: cannot be read: {exc}"
                                  ) from exc
        shard = (index.get("weight_map") or {}).get(name)
        tensor = _safetensors_tensor(root / shard, name) if shard else None
    elif (root / "model.safetensors").exists():
        tensor = _safetensors_tensor(root / "model.safetensors", name)
    elif (root / "pytorch_model.bin").exists():
        state = torch.load(str(root / "pytorch_model.bin"), map_location="cpu",
                           weights_only=True)
        tensor = state.get(name)
    else:
        raise CheckpointError(f"an HF_ColBERT checkpoint needs its weights in one of "
                              f"{', '.join(files)}")
    if tensor is None:
        # Without it PyLate fails to load; a fresh projection would be random vectors.
        raise CheckpointError(f"an HF_ColBERT (Stanford ColBERT) checkpoint keeps its "
                              f"projection as {name!r} in its weights; {root.name} has none")
    if tensor.dim() != 2:
        raise CheckpointError(f"{name}: expected a [dim, hidden] matrix, got shape "
                              f"{tuple(tensor.shape)}")
    linear = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(tensor.float())
    return torch.nn.Sequential(linear, torch.nn.Identity())


def _safetensors_tensor(path: Path, name: str) -> torch.Tensor | None:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt", device="cpu") as f:
        names = f.keys()
        return f.get_tensor(name) if name in names else None


def _projection_layer(layer: DenseLayer) -> torch.nn.Module:
    try:
        config = json.loads((layer.path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("use_residual"):
        return _ResidualDense(layer)
    return load_dense_layer(layer)


def _linear(layer: torch.nn.Module) -> torch.nn.Linear:
    return layer.linear if isinstance(layer, _ResidualDense) else layer[0]


def _input_dtype(layer: torch.nn.Module) -> torch.dtype:
    return _linear(layer).weight.dtype


def maxsim_scores(query: np.ndarray, documents: list[np.ndarray]) -> np.ndarray:
    """MaxSim of one query's token vectors against each document's: the documents' tokens
    concatenated (no padding to mask) and multiplied by the query in one matrix product per
    block, then the max over each document's rows."""
    q = np.asarray(query, dtype=np.float32)
    scores = np.zeros(len(documents), dtype=np.float64)
    if not len(documents) or q.shape[0] == 0:
        return scores
    lengths = np.array([len(d) for d in documents])
    # An empty document matches nothing: it scores 0 (and has no rows to reduce).
    present = np.flatnonzero(lengths)
    start = 0
    while start < len(present):
        # Blocks of up to MAXSIM_BLOCK_TOKENS document tokens bound the [tokens, query]
        # similarity matrix (a single longer document is a block of its own).
        stop = start + 1
        total = lengths[present[start]]
        while stop < len(present) and total + lengths[present[stop]] <= MAXSIM_BLOCK_TOKENS:
            total += lengths[present[stop]]
            stop += 1
        block = present[start:stop]
        tokens = np.concatenate([np.asarray(documents[i], dtype=np.float32) for i in block])
        sims = tokens @ q.T  # [document tokens, query tokens]
        offsets = np.zeros(len(block), dtype=np.int64)
        np.cumsum(lengths[block][:-1], out=offsets[1:])
        best = np.maximum.reduceat(sims, offsets, axis=0)  # [documents, query tokens]
        scores[block] = best.sum(axis=1, dtype=np.float64)
        start = stop
    return scores


class _Outputs(dict):
    """One item's outputs; ``muvera`` is computed when first read (encode asks for it
    rarely, and score never), off the inference thread."""

    __slots__ = ("_muvera", "_query")

    def __init__(self, values: dict[str, Any], muvera: Muvera, query: bool) -> None:
        super().__init__(values)
        self._muvera, self._query = muvera, query

    def __missing__(self, key: str) -> Any:
        if key != "muvera":
            raise KeyError(key)
        value = self._muvera.encode(self["multi_vector"], query=self._query)
        self[key] = value
        return value


class MultiVectorAdapter(Adapter):
    # Its own tokenization (query marks, static query weights) takes texts only.
    accepts_token_ids = False
    name = "multi_vector"
    needs_special_mask = True  # the bare-transformers form drops special tokens

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.colbert: dict[str, Any] | None = self.checkpoint.colbert
        self.muvera: Muvera | None = None
        self.projection = torch.nn.ModuleList()

    def load_model(self, path: Path) -> torch.nn.Module:
        stanford = (self.colbert or {}).get("projection")
        if stanford:
            self.projection = torch.nn.ModuleList(
                [_stanford_projection(self.checkpoint.path, str(stanford))])
            self._check_stanford_dim()
        elif self.colbert is not None:
            self.projection = torch.nn.ModuleList(
                _projection_layer(d) for d in self.checkpoint.dense_layers)
        model = AutoModel.from_pretrained(str(path), **self.remote_code)
        model.heron_colbert_projection = self.projection  # moved and cast with the model
        return model

    def _check_stanford_dim(self) -> None:
        linear = _linear(self.projection[0])
        dim = (self.colbert or {}).get("dim")
        if dim is not None and linear.out_features != dim:
            raise CheckpointError(f"artifact.metadata says dim {dim} but the projection "
                                  f"gives {linear.out_features}")

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().load(path, device, dtype)
        if self.colbert is not None and len(self.projection):
            first, last = (_linear(layer) for layer in (self.projection[0], self.projection[-1]))
            self.dimensions = last.out_features
            if self.hidden_size and first.in_features != self.hidden_size:
                raise CheckpointError(f"the ColBERT projection takes {first.in_features} "
                                      f"features but the backbone gives {self.hidden_size}")
        else:
            self.dimensions = self.hidden_size
        if self.colbert is not None:
            self._read_colbert_settings()
        profile = self.profile
        self.muvera = Muvera(self.dimensions, profile.muvera_k_sim, profile.muvera_dim_proj,
                             profile.muvera_repetitions, profile.muvera_seed)

    def _read_colbert_settings(self) -> None:
        """PyLate's settings as its ColBERT resolves them, with its defaults."""
        settings = self.colbert or {}
        tok = self.tokenizer
        model_limit = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) \
            or 1_000_000
        self.query_length = min(int(settings.get("query_length") or DEFAULT_QUERY_LENGTH),
                                model_limit)
        # A profile's max_sequence_length caps documents, as max_seq_length would.
        self.document_length = min(int(self.profile.max_sequence_length
                                       or settings.get("document_length")
                                       or DEFAULT_DOCUMENT_LENGTH), model_limit)
        self.max_length = self.document_length
        self.query_prefix = settings.get("query_prefix", DEFAULT_QUERY_PREFIX)
        self.document_prefix = settings.get("document_prefix", DEFAULT_DOCUMENT_PREFIX)
        if self.query_prefix is None:
            self.query_prefix = DEFAULT_QUERY_PREFIX
        if self.document_prefix is None:
            self.document_prefix = DEFAULT_DOCUMENT_PREFIX
        self.query_prefix_id = self._prefix_id(self.query_prefix)
        self.document_prefix_id = self._prefix_id(self.document_prefix)
        self.query_expansion = bool(settings.get("do_query_expansion", True))
        self.attend_expansion = self.query_expansion and bool(
            settings.get("attend_to_expansion_tokens", False))
        # PyLate pads queries with [MASK] (an encoder's), else EOS (a decoder's).
        self.expansion_id = next((i for i in (tok.mask_token_id, tok.eos_token_id,
                                              tok.pad_token_id) if i is not None), None)
        if self.query_expansion and self.expansion_id is None:
            raise CheckpointError("ColBERT query expansion needs a [MASK], EOS or pad token; "
                                  "the tokenizer has none")
        words = settings.get("skiplist_words")
        if words is None:
            words = list(string.punctuation)
        # As PyLate looks them up: a word outside the vocabulary becomes the unknown token's
        # id, which is then skipped too.
        ids = tok.convert_tokens_to_ids([str(w) for w in words])
        self.skiplist = sorted({int(i) for i in ids if i is not None})
        self._skiplist_tensor = torch.tensor(self.skiplist, dtype=torch.long,
                                             device=self.device)

    def _prefix_id(self, prefix: str) -> int | None:
        if prefix == "":
            return None
        token_id = self.tokenizer.convert_tokens_to_ids(prefix)
        unknown = self.tokenizer.unk_token_id
        embeddings = self.model.get_input_embeddings()
        rows = embeddings.weight.shape[0] if embeddings is not None else None
        if token_id is None or (token_id == unknown and prefix != self.tokenizer.unk_token) \
                or (rows is not None and token_id >= rows):
            # PyLate would add the token and grow the embeddings with a fresh random row:
            # nothing that could be served as the model's answer.
            raise CheckpointError(f"the ColBERT prefix {prefix!r} is not a token of the "
                                  f"checkpoint's tokenizer and embeddings")
        return int(token_id)

    # ---- prompts and description --------------------------------------------------------
    def checkpoint_prompt(self, query: bool) -> str:
        """ColBERT marks queries and documents with prefix tokens, not text: the checkpoint's
        text prefix is its default prompt (the one PyLate's encode applies to both sides),
        else none."""
        default = self.checkpoint.default_prompt_name
        return self.checkpoint.prompts.get(default, "") if default else ""

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "similarity": "maxsim"}
        if self.muvera is not None:
            out["muvera"] = self.muvera.describe()
        if self.colbert is not None:
            out["colbert"] = {
                "query_length": self.query_length, "document_length": self.document_length,
                "query_prefix": self.query_prefix, "document_prefix": self.document_prefix,
                "do_query_expansion": self.query_expansion,
                "attend_to_expansion_tokens": self.attend_expansion,
                "skiplist_tokens": len(self.skiplist),
                "format": "stanford" if self.colbert.get("projection") else "pylate"}
        return out

    # ---- tokenize -----------------------------------------------------------------------
    def _tokenize_locked(self, inputs: list[TextInput], query: bool) -> list[Tokenized]:
        if self.colbert is None:
            return super()._tokenize_locked(inputs, query)
        texts = [str(x if isinstance(x, str) else x[1]).strip() for x in inputs]
        if self.lowercase:
            texts = [t.lower() for t in texts]
        prefix_id = self.query_prefix_id if query else self.document_prefix_id
        length = self.query_length if query else self.document_length
        # The prefix token is inserted after tokenizing: it counts in the length.
        limit = length - 1 if prefix_id is not None else length
        out = self._tokenize_texts(texts, limit + 1)
        too_long = [i for i, t in enumerate(out) if t.length > limit]
        if too_long:
            again = self._tokenize_texts([texts[i] for i in too_long], limit)
            for i, t in zip(too_long, again, strict=True):
                t.truncated = True
                out[i] = t
        for t in out:
            t.query = query
            if query and self.query_expansion:
                self._expand(t, limit)
            if prefix_id is not None:
                t.input_ids.insert(1, prefix_id)
                if t.token_type_ids is not None:
                    t.token_type_ids.insert(1, 0)
                if t.special_mask is not None:
                    t.special_mask.insert(1, 0)
        return out

    def _tokenize_texts(self, texts: list[str], max_length: int) -> list[Tokenized]:
        enc = self.tokenizer(texts, truncation=True, max_length=max_length,
                             return_attention_mask=False)
        types = enc.get("token_type_ids")
        return [Tokenized(input_ids=list(ids), truncated=False, text=texts[i],
                          token_type_ids=list(types[i]) if types is not None else None)
                for i, ids in enumerate(enc["input_ids"])]

    def _expand(self, t: Tokenized, limit: int) -> None:
        """Query expansion: pad to ``limit`` with the expansion token, on the tokenizer's
        padding side. In this adapter ``special_mask`` marks the tokens attention does not
        see (1), the expansion tokens unless the model attends to them."""
        missing = limit - t.length
        if missing <= 0:
            return
        pad_type = int(getattr(self.tokenizer, "pad_token_type_id", 0) or 0)
        hidden = 0 if self.attend_expansion else 1
        ids, types = [self.expansion_id] * missing, [pad_type] * missing
        mask = [0] * t.length
        if self.tokenizer.padding_side == "left":
            t.input_ids = [*ids, *t.input_ids]
            t.token_type_ids = None if t.token_type_ids is None else [*types, *t.token_type_ids]
            t.special_mask = [hidden] * missing + mask
        else:
            t.input_ids = [*t.input_ids, *ids]
            t.token_type_ids = None if t.token_type_ids is None else [*t.token_type_ids, *types]
            t.special_mask = mask + [hidden] * missing
        if not hidden:
            t.special_mask = None

    # ---- collate, forward, postprocess --------------------------------------------------
    def _collate_padded(self, items: list[Tokenized]) -> Batch:
        batch = super()._collate_padded(items)
        if self.colbert is not None and any(t.special_mask is not None for t in items):
            mask = batch.attention_mask.cpu().numpy()
            for row, t in enumerate(items):
                if t.special_mask is not None:
                    mask[row, : t.length] = 1 - np.asarray(t.special_mask)
            batch.attention_mask = torch.from_numpy(mask).to(self.device)
        return batch

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.hidden_states(batch)
        width = hidden.shape[1]
        real = (torch.arange(width, device=hidden.device)[None, :]
                < batch.lengths[:, None])
        if self.colbert is None:
            hidden = hidden.float()
            keep = real.clone()
            for row, item in enumerate(batch.items):
                if item.special_mask is not None:
                    special = torch.tensor(item.special_mask, device=keep.device, dtype=torch.bool)
                    keep[row, : item.length] &= ~special
            tokens = F.normalize(hidden, p=2, dim=-1)
            pooled = F.normalize(masked_mean(hidden, keep), p=2, dim=-1)
            return tokens, keep, pooled
        x = hidden
        for layer in self.projection:
            x = layer(x.to(_input_dtype(layer)))
        tokens = F.normalize(x.float(), p=2, dim=-1)
        # Queries keep every token (expansion included); documents drop skiplist tokens.
        documents = torch.tensor([not t.query for t in batch.items], device=hidden.device)
        skipped = torch.isin(batch.input_ids, self._skiplist_tensor) & documents[:, None]
        keep = real & ~skipped
        pooled = F.normalize(masked_mean(tokens, keep), p=2, dim=-1)
        return tokens, keep, pooled

    def postprocess(self, batch: Batch, output: tuple) -> list[dict[str, Any]]:
        tokens, keep, pooled = output
        tokens_np, keep_np, pooled_np = to_numpy(tokens), keep.cpu().numpy(), to_numpy(pooled)
        return [_Outputs({"multi_vector": tokens_np[row][keep_np[row]],
                          "dense": pooled_np[row]}, self.muvera, item.query)
                for row, item in enumerate(batch.items)]

    def similarity(self, outputs: list[dict[str, Any]]) -> list[float]:
        """MaxSim of the query (first) against each document."""
        query = outputs[0]["multi_vector"]
        return maxsim_scores(query, [o["multi_vector"] for o in outputs[1:]]).tolist()
