"""Parity checks: Heron's answers against the reference library's, with the issue's bounds
(dense cosine >= 0.9999; sparse: the same terms, weights within 1e-4 relative; multi-vector:
the same token count, per-token cosine >= 0.9999; scores within 1e-4, the same ranking)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tests.parity.texts import QUERY, parity_texts

if TYPE_CHECKING:
    from heron_sdk import Client
    from heron_sdk.results import ScoreResult
    from tests.parity.conftest import ParityCase

MIN_COSINE = 0.9999
SCORE_TOLERANCE = 1e-4


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1),
                                        1e-12)


def assert_dense(got: list[np.ndarray], want: np.ndarray, *, norm: bool = True) -> None:
    """Each text's vector: cosine >= MIN_COSINE, and the same length (the same norm: a
    checkpoint without Normalize must not come back normalized)."""
    got_arr = np.stack([np.asarray(g, dtype=np.float64) for g in got])
    assert got_arr.shape == want.shape, (got_arr.shape, want.shape)
    cos = cosine_rows(got_arr, want)
    worst = int(np.argmin(cos))
    assert cos.min() >= MIN_COSINE, f"text {worst}: cosine {cos[worst]:.6f}"
    if norm:
        np.testing.assert_allclose(np.linalg.norm(got_arr, axis=-1),
                                   np.linalg.norm(want, axis=-1), rtol=1e-3)


def assert_sparse(got: list[dict[str, Any]], want: list[dict[int, float]]) -> None:
    """``got``: wire sparse vectors ({"indices", "values"}); ``want``: term -> weight."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        got_terms = dict(zip((int(x) for x in g["indices"]), (float(v) for v in g["values"]),
                             strict=True))
        # Terms whose weight rounds to zero in fp32 are noise on either side.
        got_set = {t for t, v in got_terms.items() if abs(v) > 1e-6}
        want_set = {t for t, v in w.items() if abs(v) > 1e-6}
        assert got_set == want_set, (
            f"text {i}: terms only Heron has {sorted(got_set - want_set)[:5]}, only the "
            f"reference {sorted(want_set - got_set)[:5]}")
        for term in want_set:
            assert abs(got_terms[term] - w[term]) <= 1e-4 * max(abs(w[term]), 1e-3), (
                f"text {i} term {term}: {got_terms[term]} vs {w[term]}")


def assert_multi_vector(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        assert g.shape == w.shape, f"text {i}: {g.shape} tokens x dims vs {w.shape}"
        cos = cosine_rows(g, w)
        assert cos.min() >= MIN_COSINE, f"text {i}: token {int(np.argmin(cos))} cos {cos.min()}"


def assert_scores(got: list[float], want: np.ndarray) -> None:
    """Scores in document order: within SCORE_TOLERANCE, and the same ranking where the
    reference's scores are apart by more than the tolerance."""
    got_arr = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    np.testing.assert_allclose(got_arr, want, atol=SCORE_TOLERANCE,
                               rtol=SCORE_TOLERANCE)
    order_got, order_want = np.argsort(-got_arr, kind="stable"), np.argsort(-want, kind="stable")
    gaps = np.abs(np.diff(want[order_want]))
    if (gaps > 2 * SCORE_TOLERANCE).all():
        assert (order_got == order_want).all()


# ---- reading answers and references ------------------------------------------------------
def scores_in_order(ranked: ScoreResult, count: int) -> list[float]:
    """A score call's results put back in document order."""
    got = np.empty(count)
    for r in ranked.results:
        got[r.index] = r.score
    return got.tolist()


def listed(want: dict[str, np.ndarray], prefix: str) -> list[np.ndarray]:
    """Per-text arrays a reference saved as ``<prefix>_0``, ``<prefix>_1``, ..."""
    count = sum(1 for k in want if k.startswith(prefix + "_"))
    return [want[f"{prefix}_{i}"] for i in range(count)]


def assert_encoder_matches(heron: Client, case: ParityCase) -> None:
    """A dense encoder's documents, queries and bi-encoder scores against the reference's
    ``documents``, ``queries`` and ``scores`` (sentence-transformers' encode_document,
    encode_query and similarity)."""
    texts = parity_texts()
    want = case.expected()
    docs = heron.encode(case.model_id, texts)
    assert_dense([r.dense for r in docs.items], want["documents"])
    assert any(r.truncated for r in docs.items), "the texts must exercise truncation"
    queries = heron.encode(case.model_id, texts[: len(want["queries"])], is_query=True)
    assert_dense([r.dense for r in queries.items], want["queries"])
    assert_scores(scores_in_order(heron.score(case.model_id, QUERY, texts), len(texts)),
                  want["scores"])
