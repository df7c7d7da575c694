"""Per-request output shaping: Matryoshka ``dims`` and output dtypes.

These run after the model, per item, because requests batched together may ask for
different dims and dtypes.
"""

from __future__ import annotations

import numpy as np

from heron_sdk.errors import ErrorCode, HeronError


def truncate_dims(vectors: np.ndarray, dims: int | None, renormalize: bool) -> np.ndarray:
    """Keep the first ``dims`` components (Matryoshka), then renormalize."""
    if dims is None or dims == vectors.shape[-1]:
        return vectors
    if dims > vectors.shape[-1]:
        raise HeronError(ErrorCode.INVALID_FIELD,
                         f"dims: {dims} is more than the model's {vectors.shape[-1]} dimensions",
                         field="dims")
    cut = vectors[..., :dims]
    if renormalize:
        norms = np.linalg.norm(cut, axis=-1, keepdims=True)
        cut = cut / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(cut, dtype=np.float32)


def quantize(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """float32 | float16 | int8 (symmetric, per vector) | uint8 (int8 shifted by 128) |
    binary (sign bits packed 8 per byte, big-endian bit order)."""
    if dtype == "float32":
        return vectors.astype(np.float32, copy=False)
    if dtype == "float16":
        return vectors.astype(np.float16)
    if dtype == "binary":
        return np.packbits(vectors > 0, axis=-1)
    scale = np.abs(vectors).max(axis=-1, keepdims=True) / 127.0
    q = np.rint(vectors / np.maximum(scale, 1e-12)).clip(-127, 127)
    if dtype == "int8":
        return q.astype(np.int8)
    if dtype == "uint8":
        return (q + 128).astype(np.uint8)
    raise HeronError(ErrorCode.UNSUPPORTED_OUTPUT, f"output_dtype {dtype!r} is not supported",
                     field="output_dtype")
