"""The adapter contract: load, tokenize, forward, postprocess.

An adapter knows one model family. It never sees requests, queues or HTTP: the runner
tokenizes through it, batches by token count, calls ``forward`` on its inference thread and
hands each item's ``postprocess`` output back to the request that owns it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from heron.runtime.adapters import adapter_family
from heron.runtime.modelconfig import ModelConfig, Profile
from heron.worker.adapters import packing
from heron.worker.adapters.packing import Packing

# A text, or a (query, document) pair for cross-encoders.
TextInput = str | tuple[str, str]


@dataclass(slots=True)
class Tokenized:
    """One item after tokenization: what the batcher counts and the model consumes."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    truncated: bool
    text: str = ""
    offsets: list[tuple[int, int]] | None = None
    special_mask: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class Batch:
    items: list[Tokenized]
    input_ids: torch.Tensor  # [B, L], right-padded
    attention_mask: torch.Tensor  # [B, L]
    token_type_ids: torch.Tensor | None
    lengths: torch.Tensor  # [B]
    # Packed batches ([1, T], no padding, attention_mask None) carry where items lie.
    packing: Packing | None = None
    position_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, Any]:
        inputs: dict[str, Any] = {"input_ids": self.input_ids}
        if self.packing is not None:
            inputs["position_ids"] = self.position_ids
            inputs["heron_attention_groups"] = self.packing.attention
        else:
            inputs["attention_mask"] = self.attention_mask
        if self.token_type_ids is not None:
            inputs["token_type_ids"] = self.token_type_ids
        return inputs


class Adapter(ABC):
    """Base of every model family. Subclasses set ``name`` (their entry in the adapter
    table, heron/runtime/adapters.py, which gives ``tasks``, ``task`` and ``output_types``),
    the optional flags below, and implement ``load_model``, ``forward`` and ``postprocess``."""

    name: ClassVar[str]
    tasks: ClassVar[tuple[str, ...]]  # from the table: the calls its models answer
    task: ClassVar[str]  # from the table: "encode" | "score" | "extract", what forward computes
    output_types: ClassVar[frozenset[str]]  # from the table: what encode produces
    needs_offsets: ClassVar[bool] = False
    needs_special_mask: ClassVar[bool] = False
    supports_packing: ClassVar[bool] = False  # forward/postprocess handle Batch.packing

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # One source of truth: the torch-free gateway routes by the same table entry.
        super().__init_subclass__(**kwargs)
        family = adapter_family(cls.name)
        cls.tasks, cls.task, cls.output_types = family.tasks, family.task, family.output_types

    def __init__(self, config: ModelConfig, profile: Profile) -> None:
        self.config = config
        self.profile = profile
        self.tokenizer: PreTrainedTokenizerBase
        self.model: torch.nn.Module
        self.device = torch.device("cpu")
        self.max_length = 512
        self.hidden_size = 0
        self.packed = False
        self._tokenize_lock = threading.Lock()

    # ---- load ------------------------------------------------------------------------
    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = self.load_model(path)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device = device
        self.packed = self.supports_packing and packing.can_pack(model, device,
                                                                 self.profile.packing)
        if self.packed:
            packing.enable(model)
        model_limit = getattr(model.config, "max_position_embeddings", None) or 512
        tokenizer_limit = self.tokenizer.model_max_length
        if not tokenizer_limit or tokenizer_limit > 1_000_000:
            tokenizer_limit = model_limit
        limit = min(model_limit, tokenizer_limit)
        self.max_length = min(self.profile.max_sequence_length or limit, limit)
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0)

    def store_matmul_weights(self, dtype: torch.dtype) -> None:
        """Keep Linear layers' weights in ``dtype``, the autocast dtype they compute in.

        Autocast casts fp32 weights to bf16 on every forward pass (12% of MiniLM's bf16
        forward time on the CI machine); stored in bf16 they cast once, and the results are
        bit-identical because autocast would have made the same values. Norms and
        embeddings stay fp32, as autocast runs them."""
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(dtype)

    def release(self) -> None:
        """Drop the weights (eviction); the tokenizer stays for requests already past it."""
        if hasattr(self, "model"):
            del self.model

    @abstractmethod
    def load_model(self, path: Path) -> torch.nn.Module: ...

    # ---- tokenize (runs on the tokenizer thread pool) --------------------------------
    def tokenize(self, inputs: list[TextInput]) -> list[Tokenized]:
        """Tokenize with truncation at max_length; items that did not fit are flagged."""
        # A fast tokenizer keeps truncation settings as mutable state that every call
        # rewrites, so two threads with different max_length corrupt each other's results
        # (or fail with "Already borrowed"). One call at a time per model.
        with self._tokenize_lock:
            return self._tokenize_locked(inputs)

    def _tokenize_locked(self, inputs: list[TextInput]) -> list[Tokenized]:
        out = self._encode(inputs, self.max_length + 1)
        too_long = [i for i, t in enumerate(out) if t.length > self.max_length]
        if too_long:
            again = self._encode([inputs[i] for i in too_long], self.max_length)
            for i, t in zip(too_long, again, strict=True):
                t.truncated = True
                out[i] = t
        return out

    def tokenize_now(self, inputs: list[TextInput]) -> list[Tokenized] | None:
        """Tokenize on the calling thread if nobody else is tokenizing for this model (a
        short request costs ~40 us to tokenize, less than the hop to a pool thread and
        back); None if another thread holds the tokenizer."""
        if not self._tokenize_lock.acquire(blocking=False):
            return None
        try:
            return self._tokenize_locked(inputs)
        finally:
            self._tokenize_lock.release()

    def _encode(self, inputs: list[TextInput], max_length: int) -> list[Tokenized]:
        pairs = bool(inputs) and isinstance(inputs[0], tuple)
        kwargs: dict[str, Any] = {
            "truncation": "only_second" if pairs else True,
            "max_length": max_length,
            "return_offsets_mapping": self.needs_offsets,
            "return_special_tokens_mask": self.needs_special_mask,
            "return_attention_mask": False,
        }
        if pairs:
            queries, docs = [p[0] for p in inputs], [p[1] for p in inputs]
            try:
                enc = self.tokenizer(queries, docs, **kwargs)
            except Exception:
                # The query alone is over the limit: cut both sides rather than fail.
                enc = self.tokenizer(queries, docs, **{**kwargs, "truncation": "longest_first"})
        else:
            enc = self.tokenizer(list(inputs), **kwargs)
        type_ids = enc.get("token_type_ids")
        offsets = enc.get("offset_mapping")
        special = enc.get("special_tokens_mask")
        return [
            Tokenized(
                input_ids=ids,
                token_type_ids=type_ids[i] if type_ids is not None else None,
                truncated=False,
                text=inputs[i] if isinstance(inputs[i], str) else inputs[i][1],
                offsets=[tuple(o) for o in offsets[i]] if offsets is not None else None,
                special_mask=special[i] if special is not None else None,
            )
            for i, ids in enumerate(enc["input_ids"])
        ]

    # ---- collate, forward, postprocess (inference thread) -----------------------------
    def collate(self, items: list[Tokenized]) -> Batch:
        return self._collate_packed(items) if self.packed else self._collate_padded(items)

    def _collate_packed(self, items: list[Tokenized]) -> Batch:
        lengths = np.fromiter((t.length for t in items), dtype=np.int64, count=len(items))
        starts = np.zeros(len(items), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        real = int(lengths.sum())
        total = packing.bucketed_length(real)
        pad_id = self.tokenizer.pad_token_id or 0
        ids = np.full(total, pad_id, dtype=np.int64)
        ids[:real] = np.fromiter((i for t in items for i in t.input_ids), dtype=np.int64,
                                 count=real)
        positions = np.arange(total, dtype=np.int64)
        positions[:real] -= np.repeat(starts, lengths)
        # The padding may be longer than the model has positions: all position 0.
        positions[real:] = 0
        types = None
        if items[0].token_type_ids is not None:
            types = np.zeros(total, dtype=np.int64)
            types[:real] = np.fromiter(
                (i for t in items for i in (t.token_type_ids or [0] * t.length)),
                dtype=np.int64, count=real)
        to = self.device
        segment_ids = torch.from_numpy(np.repeat(np.arange(len(items)), lengths)).to(to)
        segments = [(int(s), int(s + n)) for s, n in zip(starts, lengths, strict=True)]
        layout = Packing(segments=segments, starts=torch.from_numpy(starts).to(to),
                         segment_ids=segment_ids,
                         attention=packing.attention_groups(segments, to))
        return Batch(items=items, input_ids=torch.from_numpy(ids).to(to).unsqueeze(0),
                     attention_mask=torch.ones(1, total, dtype=torch.int64, device=to),
                     token_type_ids=None if types is None else
                     torch.from_numpy(types).to(to).unsqueeze(0),
                     lengths=torch.from_numpy(lengths).to(to), packing=layout,
                     position_ids=torch.from_numpy(positions).to(to).unsqueeze(0))

    def _collate_padded(self, items: list[Tokenized]) -> Batch:
        lengths = np.fromiter((t.length for t in items), dtype=np.int64, count=len(items))
        width = int(lengths.max())
        pad_id = self.tokenizer.pad_token_id or 0
        ids = np.full((len(items), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(items), width), dtype=np.int64)
        types = None if items[0].token_type_ids is None else np.zeros_like(ids)
        for row, t in enumerate(items):
            ids[row, : t.length] = t.input_ids
            mask[row, : t.length] = 1
            if types is not None and t.token_type_ids is not None:
                types[row, : t.length] = t.token_type_ids
        to = self.device
        return Batch(
            items=items,
            input_ids=torch.from_numpy(ids).to(to),
            attention_mask=torch.from_numpy(mask).to(to),
            token_type_ids=None if types is None else torch.from_numpy(types).to(to),
            lengths=torch.from_numpy(lengths).to(to),
        )

    @abstractmethod
    def forward(self, batch: Batch) -> Any:
        """Run the model on a padded batch; called under torch.inference_mode()."""

    @abstractmethod
    def postprocess(self, batch: Batch, output: Any) -> list[Any]:
        """Per-item results (numpy/Python values), in batch order."""


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).numpy()
