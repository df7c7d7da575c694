"""How much memory the worker may use, and how much it uses: the inputs of LRU eviction.

A worker evicts its least recently used idle model when the device's memory (GPU:
``torch.cuda.mem_get_info``; CPU: the system's, or the container's cgroup limit when it
has one) passes ``HERON_MEMORY_THRESHOLD_PERCENT``, or when its loaded models' weights
would pass ``HERON_MODEL_MEMORY_BUDGET``. Optionally it also evicts models idle for
``HERON_IDLE_EVICT_S`` seconds. The registry (worker/registry.py) acts on these numbers.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
_CGROUP_MAX = Path("/sys/fs/cgroup/memory.max")
_CGROUP_CURRENT = Path("/sys/fs/cgroup/memory.current")


class InsufficientMemory(RuntimeError):
    """A model cannot load now: memory is over the threshold or budget and no idle model is
    left to evict. Transient: the load is retried later (503 + Retry-After meanwhile)."""


def parse_bytes(text: str) -> int:
    """``"1.5GiB"``, ``"800MB"``, ``"123456"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 800MB, 1.5GiB, 123456)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    threshold_percent: float = 85.0
    budget_bytes: int | None = None  # resident model weights, all models together
    idle_evict_s: float | None = None
    retry_after_s: float = 5.0  # how soon a load refused for memory is tried again

    @classmethod
    def from_env(cls) -> MemoryPolicy:
        threshold = float(os.environ.get("HERON_MEMORY_THRESHOLD_PERCENT", "85"))
        if not 1 <= threshold <= 100:
            raise ValueError("HERON_MEMORY_THRESHOLD_PERCENT must be between 1 and 100")
        budget = os.environ.get("HERON_MODEL_MEMORY_BUDGET")
        idle = float(os.environ.get("HERON_IDLE_EVICT_S", "0"))
        return cls(threshold_percent=threshold,
                   budget_bytes=parse_bytes(budget) if budget else None,
                   idle_evict_s=idle if idle > 0 else None)


def memory_used_percent(device: torch.device | str = "cpu") -> float:
    """Used memory of the device the models live on, in percent."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return 100.0 * (total - free) / total
    used = psutil.virtual_memory().percent
    limit = _cgroup_limit()
    if limit is not None:
        with contextlib.suppress(OSError, ValueError):
            used = max(used, 100.0 * int(_CGROUP_CURRENT.read_text()) / limit)
    return used


def _cgroup_limit() -> int | None:
    try:
        raw = _CGROUP_MAX.read_text().strip()
    except OSError:
        return None
    return None if raw == "max" else int(raw)


def module_bytes(module: torch.nn.Module) -> int:
    """What a loaded model's weights and buffers occupy."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def weights_bytes(path: Path) -> int:
    """A model's size on disk (its weight files): the estimate before it is loaded."""
    files = [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.pt")]
    return sum(f.stat().st_size for f in files if f.is_file())


class HeapTrimmer:
    """Hands freed heap memory back to the OS now and then (glibc's ``malloc_trim``).

    Each forward pass allocates and frees activations of a different size; glibc keeps
    the freed pages in its arenas, fragmented, and a worker's RSS crept up 7-9% over 50k
    requests. Trimming every few seconds between batches returns them (it costs well under
    a millisecond). ``HERON_HEAP_TRIM_S`` sets the period (0: never). Elsewhere than glibc
    it does nothing."""

    def __init__(self, every_s: float | None = None) -> None:
        if every_s is None:
            every_s = float(os.environ.get("HERON_HEAP_TRIM_S", "5"))
        self.every_s = every_s
        self._next = 0.0
        self._trim = _malloc_trim() if every_s > 0 else None

    def maybe_trim(self, now: float) -> bool:
        if self._trim is None or now < self._next:
            return False
        self._next = now + self.every_s
        self._trim(0)
        return True


def _malloc_trim() -> Any:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    return None
