"""PyLate ColBERT checkpoints served from their own files match PyLate: the token vectors of
documents and queries (prefix tokens, query expansion, skiplist, truncation, the Dense
projection), and ``score`` equals PyLate's MaxSim. Checkpoints: references/pylate_colbert.py
and references/stanford_colbert.py (.venv-parity). ``muvera`` is worker/muvera.py's
encoding of the returned token vectors."""

from __future__ import annotations

import numpy as np
import pytest

from heron.worker.muvera import Muvera
from heron_sdk import Client
from tests.parity.compare import assert_multi_vector, assert_scores, listed, scores_in_order
from tests.parity.conftest import ParityCase, case_named
from tests.parity.texts import QUERY, parity_texts

TEXTS = parity_texts()
# PyLate's own format, and Stanford's (references/stanford_colbert.py) as PyLate loads it.
CASES = ["pylate-colbert", "pylate-colbert-attend", "pylate-colbert-noexp",
         "stanford-colbert", "stanford-colbert-attend"]
# The profile's defaults (heron/runtime/modelconfig.py): the parity configs set none.
MUVERA = {"k_sim": 5, "dim_proj": 16, "repetitions": 20, "seed": 42}



@pytest.mark.parametrize("name", CASES)
def test_token_vectors_match_pylate(heron: Client, parity_cases: dict[str, ParityCase],
                                    name: str) -> None:
    case = case_named(parity_cases, name)
    want = case.expected()
    docs = heron.encode(case.model_id, TEXTS, output_types=["multi_vector"])
    assert_multi_vector([r.multi_vector for r in docs.items], listed(want, "documents"))
    assert any(r.truncated for r in docs.items), "the texts must exercise truncation"
    queries = listed(want, "queries")
    got = heron.encode(case.model_id, TEXTS[: len(queries)], output_types=["multi_vector"],
                       is_query=True)
    assert_multi_vector([r.multi_vector for r in got.items], queries)


@pytest.mark.parametrize("name", CASES)
def test_score_is_pylate_maxsim(heron: Client, parity_cases: dict[str, ParityCase],
                                name: str) -> None:
    case = case_named(parity_cases, name)
    assert_scores(scores_in_order(heron.score(case.model_id, QUERY, TEXTS), len(TEXTS)),
                  case.expected()["scores"])


def test_muvera_encodes_the_token_vectors(heron: Client,
                                          parity_cases: dict[str, ParityCase]) -> None:
    case = case_named(parity_cases, "pylate-colbert")
    dim = case.expected()["documents_0"].shape[1]
    fde = Muvera(dim, **MUVERA)
    for is_query in (False, True):
        got = heron.encode(case.model_id, TEXTS[:6], output_types=["multi_vector", "muvera"],
                           is_query=is_query)
        for item in got.items:
            assert item.muvera is not None and item.muvera.shape == (fde.dimensions,)
            assert fde.dimensions == 2 ** 5 * 16 * 20
            np.testing.assert_allclose(item.muvera, fde.encode(item.multi_vector, is_query),
                                       rtol=1e-5, atol=1e-5)


def test_models_route_shows_colbert_settings(parity_servers: dict[str, str]) -> None:
    with Client(parity_servers["serve"]) as client:
        model = client.get_model("parity/pylate-colbert")
    assert model["adapter"] == "multi_vector" and model["similarity"] == "maxsim"
    assert model["dimensions"] == 16
    assert model["colbert"]["query_length"] == 32 and model["colbert"]["document_length"] == 180
    assert model["colbert"]["query_prefix"] == "[Q] "
    assert model["muvera"] == {**MUVERA, "dimensions": 2 ** 5 * 16 * 20}
    assert "prompts" not in model  # sides are marked by prefix tokens, not text
