"""A checkpoint that ships its own modelling code (references/custom_code.py): served with
``trust_remote_code: true`` in its config it matches sentence-transformers loaded with
``trust_remote_code=True``; served without the opt-in it fails to load, saying so, and
never falls back to a model transformers knows."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import yaml

from heron_sdk import Client
from tests.parity.compare import assert_encoder_matches
from tests.parity.conftest import SERVER_ARGS, ParityCase, case_named
from tests.parity.texts import parity_texts
from tests.support import local_http
from tests.support.servers import start_serve

TEXTS = parity_texts()
CASE = "custom-code"


def test_custom_code_matches_sentence_transformers(heron: Client,
                                                   parity_cases: dict[str, ParityCase]) -> None:
    assert_encoder_matches(heron, case_named(parity_cases, CASE))


def test_custom_code_without_the_opt_in_fails_to_load(parity_cases: dict[str, ParityCase],
                                                      tmp_path: Path) -> None:
    case = case_named(parity_cases, CASE)
    model_id = "parity/custom-code-untrusted"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "untrusted.yaml").write_text(yaml.safe_dump(
        {"id": model_id, "source": {"path": str(case.out / "model")}}))
    bundle = tmp_path / "untrusted.yaml"
    bundle.write_text(yaml.safe_dump({"name": "untrusted", "models": ["untrusted.yaml"]}))
    server = start_serve(bundle, tmp_path, extra_args=SERVER_ARGS, wait_ready=False)
    try:
        described: dict = {}
        deadline = time.monotonic() + 180
        while described.get("state") != "failed":
            assert server.proc.poll() is None, server.log()
            assert time.monotonic() < deadline, f"{described}\n{server.log()}"
            with contextlib.suppress(httpx.HTTPError):
                described = local_http.get(f"{server.url}/v1/models/{model_id}", timeout=5).json()
            assert described.get("state") != "ready", "loaded without trust_remote_code"
            time.sleep(0.2)
        assert "trust_remote_code" in described["error"], described
        assert "CheckpointError" in described["error"], described
        r = local_http.post(f"{server.url}/v1/encode/{model_id}", json={"items": ["a text"]},
                            timeout=30)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "MODEL_LOAD_FAILED"
        assert "trust_remote_code" in error["message"], error
        assert local_http.get(f"{server.url}/readyz", timeout=5).json()["status"] == "failed"
    finally:
        server.stop()

