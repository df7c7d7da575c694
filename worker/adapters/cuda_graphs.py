"""CUDA graphs for the padded passes of plain BERT-shaped models (BERT, RoBERTa, XLM-R as
transformers loads them; adapters/plain_bert.py): a pass replays kernels captured once per
batch shape instead of launching each from Python. Measured on BERT models; RoBERTa and
XLM-R run the same layers, with positions from their padding index on (checked on CPU).

Why: on an H200 a BERT-base pass in fp16 took 5.6 ms for 1 row of 16 tokens and 6.1 ms for
32 rows of 64, while its main kernels kept the GPU busy about 1.4 ms (torch profiler, 40
passes): about 245 kernel launches a pass, each reached through Python and torch's
dispatcher. In `heron serve` that host time also holds the GIL that the event loop needs
for HTTP and tokenizing. With graphs, passes of 21 one-text items took 2.8 against 12.3 ms
and `heron serve` answered 1,646 against 681 one-text requests/s at 32 clients
(bench/gpu_check.py ``graphs_ab``, docs/benchmarks.md#on-a-gpu).

A batch of ``rows`` x ``width`` runs in the graph of its bucket: rows rounded up to a power
of two, width to a multiple of WIDTH_STEP. The extra rows attend to their first token only
and the extra columns are masked; the real rows' states are those of the eager path on the
same padded input, cut back to ``[rows, width]``. To bound the graphs' memory (each holds
its bucket's activations in the model's pool), buckets over MAX_GRAPH_TOKENS run eagerly, as
does any pass once MAX_GRAPHS are captured. A bucket's first pass captures it (two eager
passes, then the capture). The graphs are dropped, and captured again, when a weight of the
model is replaced. A capture that fails (an operation this torch build cannot capture) is
logged, and the model runs eagerly.

``HERON_CUDA_GRAPHS=0`` turns them off.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from heron.worker.adapters.plain_bert import PlainBert

log = logging.getLogger("heron.worker.cuda_graphs")

WIDTH_STEP = 32
MAX_GRAPH_TOKENS = 16384  # the default max_batch_tokens
MAX_GRAPHS = 96
# One capture at a time in the process: two models' first passes on their own threads
# never capture at once.
_CAPTURING = threading.Lock()


def cuda_graphs_enabled(env: Mapping[str, str]) -> bool:
    return env.get("HERON_CUDA_GRAPHS", "1").strip() != "0"


def bucket(rows: int, width: int) -> tuple[int, int]:
    """The graph shape a ``rows`` x ``width`` batch runs in."""
    return 1 << max(rows - 1, 0).bit_length(), -(-width // WIDTH_STEP) * WIDTH_STEP


@dataclass(slots=True)
class CapturedPass:
    """One bucket's graph and the tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    output: torch.Tensor


class GraphedBert:
    """A loaded model's captured passes; ``states`` returns None where a batch runs
    eagerly."""

    def __init__(self, plain: PlainBert, device: torch.device,
                 max_tokens: int = MAX_GRAPH_TOKENS, max_graphs: int = MAX_GRAPHS) -> None:
        self.plain = plain
        self.device = device
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.max_width = plain.model.config.max_position_embeddings - plain.position_offset
        self.graphs: dict[tuple[int, int], CapturedPass] = {}
        self.weights: tuple[int, ...] = ()
        self.pool: tuple[int, int] | None = None
        self.failed = False  # a capture failed: this model runs eagerly from then on
        self._lock = threading.Lock()  # the static tensors are shared by every pass

    def states(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
               attention_mask: torch.Tensor) -> torch.Tensor | None:
        """Last hidden states [rows, width, H], or None: run this batch eagerly."""
        rows, width = input_ids.shape
        shape = bucket(rows, width)
        if shape[0] * shape[1] > self.max_tokens or shape[1] > self.max_width:
            return None
        with self._lock:
            weights = self.plain.fuse_all()
            if weights != self.weights:  # a replaced weight: the graphs read the old one
                self.graphs.clear()
                self.pool = None
                self.weights = weights
            captured = self.graphs.get(shape)
            if captured is None:
                if self.failed or len(self.graphs) >= self.max_graphs:
                    return None
                try:
                    captured = self._capture(*shape)
                except Exception:  # an op this torch cannot capture: eager, not an error
                    log.warning("CUDA graph capture failed; %s runs eagerly",
                                type(self.plain.model).__name__, exc_info=True)
                    self.failed = True
                    return None
                self.graphs[shape] = captured
            captured.input_ids[:rows, :width].copy_(input_ids)
            if token_type_ids is None:
                captured.token_type_ids.zero_()
            else:
                captured.token_type_ids[:rows, :width].copy_(token_type_ids)
            mask = captured.attention_mask
            mask.zero_()
            mask[:rows, :width].copy_(attention_mask)
            mask[rows:, 0] = 1  # rows beyond the batch attend to one token: no empty softmax
            captured.graph.replay()
            return captured.output[:rows, :width].clone()

    def _capture(self, rows: int, width: int) -> CapturedPass:
        def zeros() -> torch.Tensor:
            return torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        ids, types, mask = zeros(), zeros(), zeros()
        mask[:, 0] = 1
        with _CAPTURING:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # load the kernels and warm the allocator
                for _ in range(2):
                    self.plain.padded_states(ids, types, mask)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = self.plain.padded_states(ids, types, mask)
        return CapturedPass(graph=graph, input_ids=ids, token_type_ids=types,
                            attention_mask=mask, output=output)
