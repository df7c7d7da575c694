"""BGE-M3 checkpoints (FlagEmbedding's format: a backbone with colbert_linear.pt and
sparse_linear.pt) served from their own files match FlagEmbedding's BGEM3FlagModel: dense,
lexical (sparse) and ColBERT vectors, each asked for alone and all three in one request (one
forward pass gives the same answers), and the dense score. Checkpoints:
references/flag_bge_m3.py (an XLM-R and a BERT backbone, 128-token limit)."""

from __future__ import annotations

import numpy as np
import pytest

from heron_sdk import Client
from tests.parity.compare import (
    assert_dense,
    assert_multi_vector,
    assert_scores,
    assert_sparse,
    scores_in_order,
)
from tests.parity.conftest import ParityCase, case_named
from tests.parity.texts import QUERY, parity_texts

TEXTS = parity_texts()
CASES = ["bge-m3-xlmr", "bge-m3-bert"]
ALL = ["dense", "sparse", "multi_vector"]



def _wire_sparse(items: list) -> list[dict]:
    return [{"indices": r.sparse.indices, "values": r.sparse.values} for r in items]


def _lexical(want: dict[str, np.ndarray], count: int) -> list[dict[int, float]]:
    return [dict(zip(want[f"terms_{i}"].tolist(), want[f"weights_{i}"].tolist(), strict=True))
            for i in range(count)]


@pytest.mark.parametrize("name", CASES)
def test_each_output_alone_matches_flagembedding(heron: Client,
                                                 parity_cases: dict[str, ParityCase],
                                                 name: str) -> None:
    case = case_named(parity_cases, name)
    want = case.expected()
    dense = heron.encode(case.model_id, TEXTS, output_types=["dense"])
    assert_dense([r.dense for r in dense.items], want["documents"])
    assert any(r.truncated for r in dense.items), "the texts must exercise truncation"
    assert max(r.tokens for r in dense.items) == 128
    sparse = heron.encode(case.model_id, TEXTS, output_types=["sparse"])
    assert_sparse(_wire_sparse(sparse.items), _lexical(want, len(TEXTS)))
    colbert = heron.encode(case.model_id, TEXTS, output_types=["multi_vector"])
    assert_multi_vector([r.multi_vector for r in colbert.items],
                        [want[f"colbert_{i}"] for i in range(len(TEXTS))])


@pytest.mark.parametrize("name", CASES)
def test_three_outputs_in_one_request(heron: Client, parity_cases: dict[str, ParityCase],
                                      name: str) -> None:
    """One request for all three: the reference's answers, and the same as asking for each
    alone (they come from one forward pass)."""
    case = case_named(parity_cases, name)
    want = case.expected()
    both = heron.encode(case.model_id, TEXTS, output_types=ALL)
    assert_dense([r.dense for r in both.items], want["documents"])
    assert_sparse(_wire_sparse(both.items), _lexical(want, len(TEXTS)))
    assert_multi_vector([r.multi_vector for r in both.items],
                        [want[f"colbert_{i}"] for i in range(len(TEXTS))])
    alone = {kind: heron.encode(case.model_id, TEXTS, output_types=[kind]).items
             for kind in ALL}
    for i, item in enumerate(both.items):
        np.testing.assert_allclose(item.dense, alone["dense"][i].dense, atol=1e-6)
        np.testing.assert_allclose(item.multi_vector, alone["multi_vector"][i].multi_vector,
                                   atol=1e-6)
        np.testing.assert_array_equal(item.sparse.indices, alone["sparse"][i].sparse.indices)
        np.testing.assert_allclose(item.sparse.values, alone["sparse"][i].sparse.values,
                                   atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_queries_and_score_match(heron: Client, parity_cases: dict[str, ParityCase],
                                 name: str) -> None:
    """encode_queries (no instruction, the same length limit) and the dense score."""
    case = case_named(parity_cases, name)
    want = case.expected()
    count = len(want["queries"])
    queries = heron.encode(case.model_id, TEXTS[:count], output_types=["dense", "multi_vector"],
                           is_query=True)
    assert_dense([r.dense for r in queries.items], want["queries"])
    assert_multi_vector([r.multi_vector for r in queries.items],
                        [want[f"query_colbert_{i}"] for i in range(count)])
    assert_scores(scores_in_order(heron.score(case.model_id, QUERY, TEXTS), len(TEXTS)),
                  want["scores"])


def test_detected_as_bge_m3(parity_servers: dict[str, str]) -> None:
    """A config naming no adapter: the two head files make it BGE-M3. The limit is 128, as
    the reference truncated: the BERT's tokenizer says so; the XLM-R's tokenizer names no
    limit and its 130 positions hold 128 tokens after the padding offset."""
    with Client(parity_servers["serve"]) as client:
        for name in CASES:
            model = client.get_model(f"parity/{name}")
            assert model["adapter"] == "bge_m3"
            assert model["detected"]["format"] == "bge-m3"
            assert model["output_types"] == ["dense", "multi_vector", "sparse"]
            assert model["max_sequence_length"] == 128
            assert model["dimensions"] == 32 and model["pooling"] == "cls"
