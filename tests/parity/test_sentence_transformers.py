"""sentence-transformers checkpoints (every pooling mode, Dense layers, prompts, a
CrossEncoder, a SparseEncoder, a decoder embedder) served from their own files match what
sentence-transformers computes. Checkpoints: references/st_models.py (ST 6, this venv) and
references/st5_models.py (ST 5's file layout, .venv-parity)."""

from __future__ import annotations

import numpy as np
import pytest

from heron_sdk import Client
from heron_sdk.errors import ErrorCode, RequestError
from tests.parity.compare import (
    assert_encoder_matches,
    assert_scores,
    assert_sparse,
    scores_in_order,
)
from tests.parity.conftest import ParityCase, case_named
from tests.parity.texts import QUERY, parity_texts

TEXTS = parity_texts()
ENCODERS = ["pool-mean", "pool-cls", "pool-max", "pool-lasttoken", "pool-weightedmean",
            "pool-mean_sqrt_len_tokens", "dense-prompts", "prompt-excluded",
            "decoder-lasttoken"]
PREFIXES = ["st-", "st5-"]



@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("name", ENCODERS)
def test_encoder_matches_sentence_transformers(heron: Client, parity_cases: dict[str, ParityCase],
                                               prefix: str, name: str) -> None:
    assert_encoder_matches(heron, case_named(parity_cases, prefix + name))


@pytest.mark.parametrize("prefix", PREFIXES)
def test_cross_encoder_matches(heron: Client, parity_cases: dict[str, ParityCase],
                               prefix: str) -> None:
    case = case_named(parity_cases, prefix + "cross-encoder")
    assert_scores(scores_in_order(heron.score(case.model_id, QUERY, TEXTS), len(TEXTS)),
                  case.expected()["scores"])


def _expected_sparse(want: dict[str, np.ndarray], side: str) -> list[dict[int, float]]:
    count = sum(1 for k in want if k.startswith(f"{side}_terms_"))
    return [dict(zip(want[f"{side}_terms_{i}"].tolist(), want[f"{side}_weights_{i}"].tolist(),
                     strict=True)) for i in range(count)]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("name", ["sparse-splade-max", "sparse-splade-sum",
                                  "sparse-inference-free"])
def test_sparse_encoder_matches(heron: Client, parity_cases: dict[str, ParityCase],
                                prefix: str, name: str) -> None:
    """Documents through the MLM head; queries too, or (inference-free) by static lookup."""
    case = case_named(parity_cases, prefix + name)
    want = case.expected()
    for side, is_query in (("documents", False), ("queries", True)):
        expected = _expected_sparse(want, side)
        got = heron.encode(case.model_id, TEXTS[: len(expected)], output_types=["sparse"],
                           is_query=is_query)
        assert_sparse([{"indices": r.sparse.indices, "values": r.sparse.values}
                       for r in got.items], expected)


def test_models_route_shows_what_was_detected(parity_servers: dict[str, str]) -> None:
    """GET /v1/models/{id}: the pooling, dimensions, prompts and similarity read from the
    files, for a config that named none of them."""
    with Client(parity_servers["serve"]) as client:
        model = client.get_model("parity/st-dense-prompts")
        assert model["adapter"] == "dense"
        assert model["pooling"] == "cls" and model["normalize"] is False
        assert model["dimensions"] == 16
        assert model["prompts"] == {"query": "query: ", "document": "passage: "}
        assert model["detected"]["similarity"] == "dot"
        assert model["max_sequence_length"] == 200
        decoder = client.get_model("parity/st-decoder-lasttoken")
        assert decoder["pooling"] == "lasttoken" and decoder["packed"] is False
        assert "packing_refused" in decoder
        assert client.get_model("parity/st-cross-encoder")["task"] == "score"
        assert client.get_model("parity/st-sparse-splade-max")["output_types"] == ["sparse"]
        assert client.get_model("parity/st-sparse-inference-free")["inference_free_query"]


def test_gateway_learns_the_family_an_auto_model_loaded_as(parity_servers: dict[str, str]
                                                           ) -> None:
    """A config with no adapter: the gateway routes every call until a worker's heartbeat
    says what the checkpoint is, then describes it as that family and refuses the calls it
    does not answer itself."""
    with Client(parity_servers["gateway"]) as client:
        model = client.get_model("parity/st-cross-encoder")
        assert model["adapter"] == "cross_encoder" and model["tasks"] == ["score"]
        assert "output_types" not in model
        assert client.get_model("parity/st-pool-cls")["output_types"] == ["dense"]
        with pytest.raises(RequestError) as err:
            client.encode("parity/st-cross-encoder", ["a text"])
        assert err.value.code == ErrorCode.UNSUPPORTED_TASK
        assert "it serves score" in err.value.message
