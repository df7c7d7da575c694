"""Packed batches: no padding at all.

A batch's items are concatenated into one sequence of T real tokens, each with its own
position ids; attention runs per item (registered with transformers as the attention
implementation ``heron_packed``), everything else (embeddings, projections, feed-forward,
the MLM head) runs once over the T tokens. Padding costs nothing and arrival order does not
matter: on MiniLM with mixed 8-128 token texts, random batches of 32 packed ran at 406
sentences/s against 367/s for length-sorted padded batches and 98/s for random padded ones
(this project's CI machine, fp32, 2 threads).

Used where the model family takes ``position_ids`` and routes attention through
transformers' attention interface (BERT-style absolute positions), on CPU. Elsewhere the
adapter pads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION_NAME = "heron_packed"


def bucketed_length(total: int) -> int:
    """``total`` rounded up to one of a few sizes (at most 12.5% more; 8 steps per octave).

    Every distinct sequence shape makes oneDNN build and cache its kernels (bf16 matmuls go
    through it): packed batches of any length made a worker's RSS climb from 0.7 to 1.75
    GB before the cache filled. Rounded lengths keep the shapes to about a hundred, and the
    RSS flat. The extra tokens attend to nothing and are never pooled."""
    step = max(8, 1 << max(0, total.bit_length() - 4))
    return -(-total // step) * step
# Families whose position ids are plain 0..n-1 per sequence and whose attention goes
# through the interface. (RoBERTa/XLM-R offset positions by padding_idx: not listed.)
PACKABLE_MODEL_TYPES = frozenset({"bert"})


# Items in one attention call may differ in length by at most this factor; the shorter
# ones are padded to the group's longest and masked. One call per item costs ~50 us of
# fixed overhead per item and layer; one call per group of similar lengths saved 3-5% of
# MiniLM's forward time on mixed 8-256-token batches (and most of the Python-level ops, so
# the inference thread needs the GIL less often while the event loop serves HTTP).
GROUP_LENGTH_RATIO = 0.7


@dataclass(slots=True)
class AttentionGroup:
    """Items of similar length, attended together as a padded [g, heads, length, dim]."""

    items: int
    length: int
    gather: torch.Tensor  # [items * length]: rows of the packed sequence, padding repeats
    mask: torch.Tensor | None  # [items, 1, 1, length] key mask; None when all are full
    valid: torch.Tensor | None  # rows of the padded output that are real tokens
    rows: torch.Tensor  # [real tokens of the group]: where they go in the packed output


def attention_groups(segments: list[tuple[int, int]],
                     device: torch.device) -> list[AttentionGroup]:
    """Group the segments by length (longest first) so that a group's shortest item is
    at least GROUP_LENGTH_RATIO of its longest."""
    order = sorted(range(len(segments)), key=lambda i: segments[i][0] - segments[i][1])
    runs: list[list[int]] = []
    for i in order:
        n = segments[i][1] - segments[i][0]
        if not runs or n < GROUP_LENGTH_RATIO * (segments[runs[-1][0]][1]
                                                  - segments[runs[-1][0]][0]):
            runs.append([])
        runs[-1].append(i)
    bounds = np.asarray(segments, dtype=np.int64).reshape(-1, 2)
    groups = []
    for run in runs:
        # Whole-array numpy, no arrays per item: 53 against 87 us for 12 items (this
        # function held 12 of an inference thread's 114 GIL samples in py-spy).
        starts, ends = bounds[run, 0], bounds[run, 1]
        lengths = ends - starts
        length = int(lengths[0])
        offsets = np.arange(length)[None, :]
        keep = offsets < lengths[:, None]  # [items, length]: real tokens
        gather = np.where(keep, starts[:, None] + offsets, starts[:, None]).reshape(-1)
        mask = valid = None
        if keep.all():
            rows = gather
        else:
            flat = np.flatnonzero(keep)
            rows = gather[flat]
            mask = torch.from_numpy(keep).view(len(run), 1, 1, length).to(device)
            valid = torch.from_numpy(flat).to(device)
        groups.append(AttentionGroup(items=len(run), length=length,
                                     gather=torch.from_numpy(gather).to(device),
                                     mask=mask, valid=valid,
                                     rows=torch.from_numpy(rows).to(device)))
    return groups


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention within each item of a packed [1, heads, T, dim] batch; returns the
    [1, T, heads, dim] layout transformers expects. Rows no item owns (the padding up to
    a bucketed length) come out as zeros."""
    _, heads, total, dim = query.shape
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [T, heads, dim]
    out = attend(q, k, v, kwargs["heron_attention_groups"], scaling)
    return out.view(1, total, heads, dim), None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           groups: list[AttentionGroup], scaling: float | None) -> torch.Tensor:
    """Attention within each item: [T, heads, dim] queries, keys and values of a packed
    sequence -> [T, heads * dim]."""
    total, heads, dim = q.shape
    out = q.new_zeros(total, heads * dim)
    for g in groups:
        qg, kg, vg = (x.index_select(0, g.gather).view(g.items, g.length, heads, dim)
                      .transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scaling)
        o = o.transpose(1, 2).reshape(g.items * g.length, heads * dim)
        if g.valid is not None:
            o = o.index_select(0, g.valid)
        out.index_copy_(0, g.rows, o)
    return out


def refusal(model: torch.nn.Module, device: torch.device, setting: str) -> str | None:
    """Why this model's batches cannot be packed; None when they can. HERON_PACKING=off
    turns packing off for every model (the parity suite runs both ways)."""
    if setting == "off" or os.environ.get("HERON_PACKING", "auto") == "off":
        return "packing is off in its profile or HERON_PACKING"
    if device.type != "cpu":
        return f"packing runs on CPU only (the model is on {device.type})"
    model_type = getattr(model.config, "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        return (f"model type {model_type!r} has no plain per-item position ids or does not "
                "route attention through transformers' interface")
    return None


def enable(model: torch.nn.Module) -> None:
    # Registered here, not at import: importing AttentionInterface imports transformers'
    # modeling stack (1.3-2 s of CPU), which a worker serving only the null model never needs.
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    model.config._attn_implementation = ATTENTION_NAME


@dataclass(slots=True)
class Packing:
    """Where each item lies in the packed sequence (its real tokens come first, then the
    padding up to ``bucketed_length``, which attends to nothing)."""

    segments: list[tuple[int, int]]  # the items'
    starts: torch.Tensor  # [B]
    segment_ids: torch.Tensor  # [T real]: which item each real token belongs to
    attention: list[AttentionGroup]  # computed once per batch, used by every layer

    def mean(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Per-item mean of [T, H] token states -> [B, H]."""
        out = hidden.new_zeros(len(self.segments), hidden.shape[-1])
        out.index_add_(0, self.segment_ids, hidden[: len(self.segment_ids)])
        return out / lengths.unsqueeze(-1).to(hidden.dtype)

    def sum(self, hidden: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Per-item sum of [T, H] token states (each row times ``weights`` [T real])."""
        real = hidden[: len(self.segment_ids)]
        if weights is not None:
            real = real * weights.unsqueeze(-1)
        out = hidden.new_zeros(len(self.segments), hidden.shape[-1])
        return out.index_add_(0, self.segment_ids, real)

    def max(self, hidden: torch.Tensor) -> torch.Tensor:
        real = hidden[: len(self.segment_ids)]
        out = hidden.new_full((len(self.segments), hidden.shape[-1]), float("-inf"))
        index = self.segment_ids.unsqueeze(-1).expand_as(real)
        return out.scatter_reduce_(0, index, real, reduce="amax")

    def first(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.index_select(0, self.starts)

    def last(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return hidden.index_select(0, self.starts + lengths - 1)
