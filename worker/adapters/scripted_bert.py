"""BERT's encoder layers over a packed batch as one TorchScript function: a forward pass that
does not hold the GIL between its kernels.

Why: a CPU worker with ``--inference-threads 2`` (``heron up``'s default on 2 cores) runs two
passes and its event loop in one process, under one GIL. Each of the ~200 torch calls of an
eager pass gives the GIL up for its kernel and takes it back after; when the other pass or
the event loop holds it then, the thread sleeps until it is handed over. Measured (MiniLM,
32 clients through ``heron up``, /proc schedstat): each inference thread slept 584-663
times a second, against 50-58 in ``heron serve``'s one-pass processes. TorchScript's
interpreter runs the whole function with the GIL released. Two threads of MiniLM passes
(batches of 11 mixed 8-110-word texts, bf16 autocast) beside a thread that runs Python 15%
of the time: 24.0-24.9 passes/s eager, 27.1-27.2 scripted.

The arithmetic is ``PlainBert._encode``'s with ``packing.attend``, op for op, so the answers
are bit-identical (tests/unit/test_plain_bert.py). It runs with the JIT's optimisations off
(its no-op pipeline, per call: the setting is the calling thread's): the optimised plan
profiles shapes and re-specialises for new ones, which packed batches always are.

``torch.jit.script`` is deprecated in torch 2.13 but works; where it fails (a torch without
it), ``scripted_packed_layers`` is None and PlainBert keeps its eager loop.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("heron.worker.adapters.scripted_bert")

Tensor = torch.Tensor
# Per layer, in this order: the fused query/key/value projection, the attention output's
# dense and LayerNorm, the intermediate dense, the output's dense and LayerNorm.
TENSORS_PER_LAYER = 6


def packed_layers(x: torch.Tensor, weights: list[torch.Tensor],
                  biases: list[torch.Tensor | None], eps: list[float], heads: int, dim: int,
                  scaling: float, gathers: list[torch.Tensor],
                  masks: list[torch.Tensor | None], valids: list[torch.Tensor | None],
                  rows: list[torch.Tensor], items: list[int],
                  lengths: list[int]) -> torch.Tensor:
    """The encoder layers over packed [T, H] states; attention per group of similar-length
    items (packing.AttentionGroup's fields, one list each). Exact GELU."""
    total = x.shape[0]
    width = [x.shape[-1]]
    per = 6  # TENSORS_PER_LAYER (TorchScript reads no module-level names)
    for i in range(len(weights) // per):
        w = weights[per * i: per * (i + 1)]
        b = biases[per * i: per * (i + 1)]
        q, k, v = F.linear(x, w[0], b[0]).view(total, 3, heads, dim).unbind(1)
        attended = q.new_zeros(total, heads * dim)
        for g in range(len(gathers)):
            n, length = items[g], lengths[g]
            qg = q.index_select(0, gathers[g]).view(n, length, heads, dim).transpose(1, 2)
            kg = k.index_select(0, gathers[g]).view(n, length, heads, dim).transpose(1, 2)
            vg = v.index_select(0, gathers[g]).view(n, length, heads, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=masks[g], scale=scaling)
            o = o.transpose(1, 2).reshape(n * length, heads * dim)
            valid = valids[g]
            if valid is not None:
                o = o.index_select(0, valid)
            attended.index_copy_(0, rows[g], o)
        x = F.layer_norm(F.linear(attended, w[1], b[1]) + x, width, w[2], b[2], eps[2 * i])
        h = F.gelu(F.linear(x, w[3], b[3]))
        x = F.layer_norm(F.linear(h, w[4], b[4]) + x, width, w[5], b[5], eps[2 * i + 1])
    return x


@functools.cache
def scripted_packed_layers() -> Any | None:
    """``packed_layers`` compiled by TorchScript (once a process, about 0.1 s), or None
    where TorchScript cannot compile it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(packed_layers)
    except Exception as exc:  # any failure leaves the eager path
        log.warning("packed BERT layers run eagerly: TorchScript could not compile them "
                    "(%s)", exc)
        return None


def run_without_gil(scripted: Any, *args: Any) -> Tensor:
    """Call ``scripted`` with the JIT's optimisations off for this call (module docstring)."""
    optimize = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(False)
    try:
        return scripted(*args)
    finally:
        torch._C._set_graph_executor_optimize(optimize)
