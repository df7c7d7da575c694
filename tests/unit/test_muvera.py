"""MUVERA's fixed-dimensional encoding (worker/muvera.py): deterministic from its seed, the
documented size, empty document buckets filled, and dot products that rank documents as
MaxSim does."""

from __future__ import annotations

import numpy as np
import pytest

from heron.worker.adapters import multi_vector
from heron.worker.adapters.multi_vector import maxsim_scores
from heron.worker.muvera import Muvera


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ranks = [np.argsort(np.argsort(v)) for v in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def _topics(seed: int, dim: int = 128) -> tuple[np.ndarray, list[np.ndarray]]:
    """Token vectors around 64 topic centres, as a trained ColBERT's cluster: the query
    draws from 8 topics, each of 50 documents from 8 that share 0 to 8 of the query's, with
    20 to 150 tokens."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((64, dim)))
    mine = rng.choice(64, 8, replace=False)
    others = np.setdiff1d(np.arange(64), mine)

    def tokens(topics: np.ndarray, n: int) -> np.ndarray:
        return _unit(centres[rng.choice(topics, n)] + 1.2 * rng.standard_normal((n, dim))
                     / np.sqrt(dim))

    query = tokens(mine, 32)
    docs = []
    for _ in range(50):
        shared = rng.choice(mine, int(rng.integers(0, 9)), replace=False)
        topics = np.concatenate([shared, rng.choice(others, 8 - len(shared), replace=False)])
        docs.append(tokens(topics, int(rng.integers(20, 150))))
    return query, docs


def test_dimensions_and_determinism() -> None:
    rng = np.random.default_rng(0)
    doc = _unit(rng.standard_normal((40, 16)))
    a, b = Muvera(16, k_sim=3, dim_proj=8, repetitions=4, seed=7), Muvera(16, 3, 8, 4, 7)
    assert a.dimensions == 2**3 * 8 * 4
    first = a.encode(doc, query=False)
    assert first.shape == (a.dimensions,) and first.dtype == np.float32
    # The same seed: the same encoding, from the same or another instance (another worker).
    np.testing.assert_array_equal(first, a.encode(doc, query=False))
    np.testing.assert_array_equal(first, b.encode(doc, query=False))
    assert not np.allclose(first, Muvera(16, 3, 8, 4, seed=8).encode(doc, query=False))
    defaults = Muvera(128)
    assert defaults.dimensions == 2**5 * 16 * 20


def test_query_sums_and_document_means() -> None:
    rng = np.random.default_rng(1)
    token = _unit(rng.standard_normal((1, 16)))
    fde = Muvera(16, k_sim=4, dim_proj=8, repetitions=3, seed=0)
    twice = np.repeat(token, 2, axis=0)
    np.testing.assert_allclose(fde.encode(twice, query=True), 2 * fde.encode(token, query=True),
                               rtol=1e-6)
    np.testing.assert_allclose(fde.encode(twice, query=False), fde.encode(token, query=False),
                               rtol=1e-6)


def test_empty_document_buckets_are_filled() -> None:
    """A one-token document fills every bucket with its token; a one-token query has one
    non-empty bucket per repetition."""
    rng = np.random.default_rng(2)
    token = _unit(rng.standard_normal((1, 16)))
    fde = Muvera(16, k_sim=3, dim_proj=8, repetitions=5, seed=3)
    doc = fde.encode(token, query=False).reshape(5, 8, 8)
    projected = np.einsum("d,rdp->rp", token[0], fde.projections)
    np.testing.assert_allclose(doc, np.broadcast_to(projected[:, None, :], doc.shape),
                               rtol=1e-5, atol=1e-6)
    query = fde.encode(token, query=True).reshape(5, 8, 8)
    assert ((np.abs(query).sum(-1) > 0).sum(-1) == 1).all()


def test_empty_bucket_takes_the_nearest_token() -> None:
    """Two tokens in opposite buckets: every other bucket takes the one fewer sign bits
    away (the first on a tie)."""
    fde = Muvera(4, k_sim=2, dim_proj=4, repetitions=1, seed=0)
    fde.hyperplanes = np.eye(4)[None, :, :2]  # bucket bits: signs of the first two coordinates
    tokens = np.array([[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, 0.5, 0.0]])
    out = fde.encode(tokens, query=False).reshape(4, 4)
    projected = tokens @ fde.projections[0]
    np.testing.assert_allclose(out[0b11], projected[0])
    np.testing.assert_allclose(out[0b00], projected[1])
    # Buckets 01 and 10 are one bit from each token: the first token wins the tie.
    np.testing.assert_allclose(out[0b01], projected[0])
    np.testing.assert_allclose(out[0b10], projected[0])


def test_dot_product_ranks_like_maxsim() -> None:
    """Measured over 10 seeds with the defaults (128-dim tokens): Spearman 0.92 to 0.97
    between FDE dot products and MaxSim over 50 documents; bounds leave room for that."""
    fde = Muvera(128)
    correlations = []
    for seed in range(10):
        query, docs = _topics(seed)
        exact = maxsim_scores(query, docs)
        q = fde.encode(query, query=True)
        approx = np.array([q @ fde.encode(d, query=False) for d in docs])
        correlations.append(_spearman(exact, approx))
    assert min(correlations) > 0.85, correlations
    assert float(np.mean(correlations)) > 0.9, correlations


def test_maxsim_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact MaxSim: negative best matches stay negative (nothing padded wins the max),
    an empty document scores 0, and blocks of documents give what one block gives."""
    query = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    docs = [np.array([[-1.0, 0.0]], dtype=np.float32), np.zeros((0, 2), dtype=np.float32),
            np.array([[0.5, 0.5], [-1.0, -1.0], [0.0, 2.0]], dtype=np.float32)]
    np.testing.assert_allclose(maxsim_scores(query, docs), [-1.0 + 0.0, 0.0, 0.5 + 2.0])
    rng = np.random.default_rng(3)
    query = rng.standard_normal((5, 8)).astype(np.float32)
    many = [rng.standard_normal((int(n), 8)).astype(np.float32)
            for n in rng.integers(1, 40, size=30)]
    want = [float((query @ d.T).max(axis=1).sum()) for d in many]
    np.testing.assert_allclose(maxsim_scores(query, many), want, rtol=1e-5)
    monkeypatch.setattr(multi_vector, "MAXSIM_BLOCK_TOKENS", 50)
    np.testing.assert_allclose(maxsim_scores(query, many), want, rtol=1e-5)


@pytest.mark.parametrize("shape", [(0, 16), (3, 8)])
def test_bad_or_empty_inputs(shape: tuple[int, int]) -> None:
    fde = Muvera(16, k_sim=2, dim_proj=4, repetitions=2)
    if shape[0] == 0:
        assert not fde.encode(np.zeros(shape), query=False).any()
    else:
        with pytest.raises(ValueError):
            fde.encode(np.zeros(shape), query=False)
