"""A null model: real tokenization, no compute, fixed unit vectors.

For measuring Heron's own overhead (HTTP, batching, NATS, reassembly) with the model taken
out of the picture: ``bundles/null.yaml``, used by bench/.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from heron.worker.adapters.base import Adapter, Batch

DIMENSIONS = 384


class NullAdapter(Adapter):
    name = "null"
    # It computes nothing: a cache lookup would cost more than the answer (200k texts
    # through the SDK took 22-28 s with the cache against 15 s without).
    cacheable = False

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = torch.nn.Identity()
        self.device = device
        self.max_length = self.profile.max_sequence_length or 512
        self.hidden_size = DIMENSIONS
        vector = np.ones(DIMENSIONS, dtype=np.float32)
        self._vector = vector / np.linalg.norm(vector)

    def load_model(self, path: Path) -> torch.nn.Module:
        return torch.nn.Identity()

    def forward(self, batch: Batch) -> int:
        return len(batch.items)

    def postprocess(self, batch: Batch, output: int) -> list[dict[str, np.ndarray]]:
        return [{"dense": self._vector} for _ in range(output)]
