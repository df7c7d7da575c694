"""MUVERA: one fixed-size vector from a multi-vector embedding, whose dot product with
another approximates their MaxSim (Dhulipala et al. 2024, "MUVERA: Multi-Vector Retrieval
via Fixed Dimensional Encodings"). Plain numpy, no I/O.

Per repetition, ``k_sim`` Gaussian hyperplanes split the space into ``2**k_sim`` SimHash
buckets (a vector's bucket is the sign pattern of its projections onto them). Each bucket
holds the sum of a query's vectors in it, or the mean of a document's; a document's empty
bucket takes the document vector whose sign pattern is nearest to the bucket's (Hamming
distance), so that every query bucket meets some document vector. Each bucket's vector goes
through a random +-1 projection to ``dim_proj`` dimensions (scaled by 1/sqrt(dim_proj)), and
the repetitions are concatenated: ``2**k_sim * dim_proj * repetitions`` dimensions in all.

All randomness comes from one numpy Generator seeded with ``seed``, drawn in a fixed order,
so every worker (and every client that recomputes it) gets the same encoding.
"""

from __future__ import annotations

import numpy as np


class Muvera:
    """The fixed-dimensional encoding for token vectors of ``dim`` dimensions."""

    def __init__(self, dim: int, k_sim: int = 5, dim_proj: int = 16, repetitions: int = 20,
                 seed: int = 42) -> None:
        if min(dim, dim_proj, repetitions) < 1 or k_sim < 0:
            raise ValueError("muvera: dim, dim_proj and repetitions must be positive, "
                             "k_sim not negative")
        if k_sim > 16:
            # 65536 buckets per repetition: the encoding would be mostly empty buckets.
            raise ValueError(f"muvera: k_sim {k_sim} is over 16")
        self.dim, self.k_sim, self.dim_proj = dim, k_sim, dim_proj
        self.repetitions, self.seed = repetitions, seed
        self.buckets = 2**k_sim
        rng = np.random.default_rng(seed)
        # Drawn in this order, and only these: the encoding is part of the API.
        self.hyperplanes = rng.standard_normal((repetitions, dim, k_sim))
        signs = rng.integers(0, 2, size=(repetitions, dim, dim_proj)) * 2 - 1
        self.projections = signs / np.sqrt(dim_proj)
        self._bit_values = 1 << np.arange(k_sim)
        ids = np.arange(self.buckets)
        # Bits that differ between every pair of bucket ids: the Hamming distance.
        self._hamming = np.array([bin(i).count("1") for i in range(self.buckets)])[
            ids[:, None] ^ ids[None, :]]

    @property
    def dimensions(self) -> int:
        return self.buckets * self.dim_proj * self.repetitions

    def describe(self) -> dict[str, int]:
        return {"k_sim": self.k_sim, "dim_proj": self.dim_proj,
                "repetitions": self.repetitions, "seed": self.seed,
                "dimensions": self.dimensions}

    def encode(self, vectors: np.ndarray, query: bool) -> np.ndarray:
        """A query's encoding (bucket sums) or a document's (bucket means, empty buckets
        filled), float32 of ``dimensions``."""
        x = np.asarray(vectors, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"muvera: expected [tokens, {self.dim}] vectors, got {x.shape}")
        reps, buckets, proj = self.repetitions, self.buckets, self.dim_proj
        if x.shape[0] == 0:
            return np.zeros(self.dimensions, dtype=np.float32)
        # [reps, tokens]: each token's bucket in each repetition.
        bits = np.einsum("nd,rdk->rnk", x, self.hyperplanes) > 0
        codes = bits.astype(np.int64) @ self._bit_values
        # Projecting first is the same as projecting each bucket's sum or mean (linear).
        projected = np.einsum("nd,rdp->rnp", x, self.projections)  # [reps, tokens, proj]
        member = (codes[:, None, :] == np.arange(buckets)[None, :, None]).astype(np.float64)
        out = member @ projected  # [reps, buckets, proj]: per-bucket sums
        if not query:
            counts = member.sum(-1)
            filled = counts > 0
            out[filled] /= counts[filled][:, None]
            if not filled.all():
                # An empty bucket takes the token nearest to it in Hamming distance (the
                # first such token on a tie).
                distance = self._hamming[np.arange(buckets)[None, :, None], codes[:, None, :]]
                nearest = distance.argmin(-1)  # [reps, buckets]
                rep, bucket = np.nonzero(~filled)
                out[rep, bucket] = projected[rep, nearest[rep, bucket]]
        return out.reshape(reps * buckets * proj).astype(np.float32)


__all__ = ["Muvera"]
