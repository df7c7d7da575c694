"""input_type picks the checkpoint's own prompts, as sentence-transformers applies them, on
/v1/encode, the OpenAI route (the official client's extra_body) and the SDK; token ids in
place of a text give the text's vector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from transformers import AutoTokenizer

from heron_sdk import Client
from tests.support.servers import ServerProcess, start_serve
from tests.support.tiny_models import one_model_bundle

PROMPTS = {"query": "query: ", "document": "passage: ", "classification": "classify: ",
           "clustering": "cluster: "}
TEXTS = ["Herons nest in colonies.", "A short one"]


@pytest.fixture(scope="module")
def prompted(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[SentenceTransformer, Path]:
    """A sentence-transformers checkpoint with query, document, classification and
    clustering prompts, saved in its own format."""
    root = tmp_path_factory.mktemp("prompted")
    body = Transformer(str(tiny_models["tiny-dense-cls"]), max_seq_length=64)
    pooling = Pooling(body.get_embedding_dimension(), pooling_mode="mean")
    st = SentenceTransformer(modules=[body, pooling], prompts=PROMPTS, device="cpu")
    st.save(str(root / "model"))
    return SentenceTransformer(str(root / "model"), device="cpu"), root


@pytest.fixture(scope="module")
def prompted_server(prompted: tuple[SentenceTransformer, Path]) -> Iterator[ServerProcess]:
    _, root = prompted
    bundle = one_model_bundle(root / "bundle", "prompted", root / "model")
    proc = start_serve(bundle, root)
    yield proc
    proc.stop()


@pytest.mark.parametrize(("input_type", "prompt_name"), [
    ("query", "query"), ("search_query", "query"), ("document", "document"),
    ("search_document", "document"), ("classification", "classification"),
    ("clustering", "clustering")])
def test_input_type_encodes_with_the_checkpoints_prompt(
        prompted: tuple[SentenceTransformer, Path], prompted_server: ServerProcess, input_type: str,
        prompt_name: str) -> None:
    st, _ = prompted
    expected = st.encode(TEXTS, prompt_name=prompt_name)
    with Client(prompted_server.url) as client:
        got = client.encode("prompted", TEXTS, input_type=input_type).dense
    np.testing.assert_allclose(got, expected, atol=1e-5)
    oai = OpenAI(base_url=f"{prompted_server.url}/v1", api_key="unused", max_retries=0)
    res = oai.embeddings.create(model="prompted", input=TEXTS,
                                extra_body={"input_type": input_type})
    np.testing.assert_allclose([d.embedding for d in res.data], expected, atol=1e-5)


def test_without_a_named_prompt_classification_is_the_document_side(
        base_url: str) -> None:
    """tiny-dense-cls has profile instructions and no checkpoint prompts."""
    with Client(base_url) as client:
        cls = client.encode("tiny-dense-cls", TEXTS, input_type="classification").dense
        doc = client.encode("tiny-dense-cls", TEXTS, is_query=False).dense
        query = client.encode("tiny-dense-cls", TEXTS, input_type="query").dense
    np.testing.assert_allclose(cls, doc, atol=1e-6)
    assert np.abs(query - doc).max() > 1e-4  # the profile gives queries another prefix


def test_token_ids_give_the_texts_vector_with_a_prompt_too(
        prompted: tuple[SentenceTransformer, Path], prompted_server: ServerProcess) -> None:
    st, root = prompted
    tokenizer = AutoTokenizer.from_pretrained(str(root / "model"))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    oai = OpenAI(base_url=f"{prompted_server.url}/v1", api_key="unused", max_retries=0)
    for input_type, prompt_name in (("document", "document"), ("query", "query")):
        res = oai.embeddings.create(model="prompted", input=ids,
                                    extra_body={"input_type": input_type})
        np.testing.assert_allclose([d.embedding for d in res.data],
                                   st.encode(TEXTS, prompt_name=prompt_name), atol=1e-5)
        # one text as one list of ids
        one = oai.embeddings.create(model="prompted", input=ids[0],
                                    extra_body={"input_type": input_type})
        np.testing.assert_allclose(one.data[0].embedding, res.data[0].embedding, atol=1e-6)
