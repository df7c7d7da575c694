"""GLiNER zero-shot extraction: Heron's own implementation against gliner's predict_entities.

``references/gliner_span.py`` (in ``.venv-gliner``) builds a tiny random GLiNER span model,
saves it with gliner's save_pretrained and writes what predict_entities answers for 30 texts
under 5 label sets and thresholds. One ``heron serve`` loads that directory from a config
with only its id and path (the family is detected), and answers the same texts: the five
label sets arrive as concurrent requests, so their rows share padded batches. Then the
request errors: bad labels are 422s naming the field, and never hurt requests beside them.

gliner's save_pretrained writes ``pytorch_model.bin`` (what most GLiNER repositories on the
Hub ship); the script saves the same model with safetensors too. Both give the same spans,
from a local path and through the weight tiers (the Hub, on a loopback stand-in, then the S3
cluster cache on moto's S3 server), which fetch the ``.bin`` only where a repository has no
safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.parity import reference_build
from tests.parity.conftest import SERVER_ARGS
from tests.support import local_http
from tests.support.servers import ServerProcess, start_serve

MODEL = "parity/gliner"


@pytest.fixture(scope="module")
def expected() -> tuple[Path, list[dict[str, Any]]]:
    """gliner_span.py's checkpoint and answers (from the parity suite's reference build)."""
    case = reference_build.wait("gliner_span") / "gliner_span" / "gliner_span"
    return case / "model", json.loads((case / "expected.json").read_text())["cases"]


@pytest.fixture(scope="module")
def server(expected: tuple[Path, list[dict[str, Any]]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("gliner-bundle")
    (root / "models").mkdir()
    config = {"id": MODEL, "source": {"path": str(expected[0])}}
    (root / "models" / "gliner.yaml").write_text(yaml.safe_dump(config))
    (root / "gliner.yaml").write_text(yaml.safe_dump({"name": "gliner",
                                                      "models": ["gliner.yaml"]}))
    # One torch thread: GLiNER's LSTM runs a small step per word, and on a shared 2-core
    # machine two threads wait on each other at every step (docs/benchmarks.md).
    served = start_serve(root / "gliner.yaml", root, extra_args=[*SERVER_ARGS, "--threads", "1"])
    yield served
    served.stop()


def _extract(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return local_http.post(f"{server.url}/v1/extract/{MODEL}", json=body, timeout=60)


def test_entities_match_gliner_predict_entities(
        server: ServerProcess, expected: tuple[Path, list[dict[str, Any]]]) -> None:
    cases = expected[1]
    groups: dict[tuple[tuple[str, ...], float], list[dict[str, Any]]] = {}
    for case in cases:
        groups.setdefault((tuple(case["labels"]), case["threshold"]), []).append(case)
    bodies = [{"items": [c["text"] for c in group], "labels": list(labels),
               "threshold": threshold} for (labels, threshold), group in groups.items()]
    with ThreadPoolExecutor(len(bodies)) as pool:  # one batch holds several label sets
        answers = list(pool.map(lambda b: _extract(server, b), bodies))
    compared = 0
    for answer, group in zip(answers, groups.values(), strict=True):
        assert answer.status_code == 200, answer.text
        items = answer.json()["items"]
        for case, item in zip(group, items, strict=True):
            want, got = case["entities"], item["entities"]
            where = f"{case['labels']} @ {case['threshold']}: {case['text'][:50]!r}"
            assert [(e["label"], e["text"], e["start"], e["end"]) for e in got] == [
                (e["label"], e["text"], e["start"], e["end"]) for e in want], where
            for g, w in zip(got, want, strict=True):
                assert abs(g["score"] - w["score"]) <= 1e-4, where
                assert case["text"][g["start"]:g["end"]] == g["text"]
            compared += len(want)
    assert compared > 100  # thresholds let spans through: a broken model would fail here
    long_words = [item for a in answers for item in a.json()["items"] if item["truncated"]]
    assert long_words  # texts past the model's 64 words are cut as gliner cuts them


def test_model_is_detected_as_gliner(server: ServerProcess) -> None:
    info = local_http.get(f"{server.url}/v1/models/{MODEL}", timeout=10).json()
    assert info["adapter"] == "gliner" and info["task"] == "extract", info
    assert info["detected"]["format"] == "gliner"


@pytest.mark.parametrize(("body", "field"), [
    ({"items": ["Ada met Charles."]}, "labels"),  # a zero-shot model needs labels
    ({"items": ["Ada"], "labels": []}, "labels"),
    ({"items": ["Ada"], "labels": [f"type {i}" for i in range(51)]}, "labels"),
    ({"items": ["Ada"], "labels": ["person", ""]}, "labels[1]"),
    ({"items": ["Ada"], "labels": ["x" * 101]}, "labels[0]"),
    ({"items": ["Ada"], "labels": "person"}, "labels"),
    # 50 labels the model's 512 tokens cannot hold with any text
    ({"items": ["Ada"], "labels": [f"{i} " + "y" * 90 for i in range(50)]}, "labels"),
])
def test_bad_labels_are_422_and_harm_nobody(server: ServerProcess, body: dict[str, Any],
                                            field: str) -> None:
    good = {"items": ["Ada Lovelace met Charles Babbage in London."],
            "labels": ["person", "location"], "threshold": 0.3}
    with ThreadPoolExecutor(3) as pool:
        before, bad, after = pool.map(lambda b: _extract(server, b), [good, body, good])
    assert bad.status_code == 422, bad.text
    error = bad.json()["error"]
    assert error["code"] == "INVALID_FIELD" and error["field"] == field, error
    assert before.status_code == after.status_code == 200
    assert before.json()["items"] == after.json()["items"]


def test_fifty_labels_and_no_truncation(server: ServerProcess) -> None:
    labels = [f"type {i}" for i in range(50)]
    answer = _extract(server, {"items": ["Ada Lovelace met Charles Babbage."],
                               "labels": labels, "threshold": 0.0})
    assert answer.status_code == 200, answer.text
    assert {e["label"] for e in answer.json()["items"][0]["entities"]} <= set(labels)
    too_long = _extract(server, {"items": ["word " * 80], "labels": ["person"],
                                 "truncate": False})
    assert too_long.status_code == 422
    assert too_long.json()["error"]["code"] == "INPUT_TOO_LONG"


def extract_in_process(config: dict[str, Any], cases: list[dict[str, Any]],
                       order: list[int]) -> list[list[Any]]:
    """Resolve ``config``'s weights through the tiers, load the adapter it detects, and
    answer ``cases`` (in ``order``) in one padded batch; the answers in ``order``."""
    import torch

    from heron.runtime.checkpoint import detect_family, read_checkpoint
    from heron.runtime.modelconfig import parse_model_config
    from heron.worker.adapters import adapter_class
    from heron.worker.weights import resolve_weights

    parsed = parse_model_config(config)
    path = resolve_weights(parsed)
    checkpoint = read_checkpoint(path)
    adapter = adapter_class(detect_family(checkpoint))(parsed, parsed.profile, checkpoint)
    adapter.load(path, torch.device("cpu"), torch.float32)
    inputs = [adapter.extract_inputs([cases[i]["text"]], cases[i]["labels"],
                                     cases[i]["threshold"])[0] for i in order]
    with torch.inference_mode():
        batch = adapter.collate(adapter.tokenize(inputs))
        return adapter.postprocess(batch, adapter.forward(batch))


def assert_answers(answers: list[list[Any]], cases: list[dict[str, Any]],
                   order: list[int]) -> None:
    for i, got in zip(order, answers, strict=True):
        want = cases[i]["entities"]
        assert [(e.label, e.start, e.end) for e in got] == [
            (e["label"], e["start"], e["end"]) for e in want], cases[i]["text"][:50]
        assert all(abs(g.score - w["score"]) <= 1e-4 for g, w in zip(got, want, strict=True))


def test_one_forward_pass_mixes_label_sets(expected: tuple[Path, list[dict[str, Any]]]) -> None:
    """All 150 (text, labels, threshold) rows, shuffled, in one padded batch: rows with
    different label sets and thresholds give what each gives alone."""
    import random

    path, cases = expected
    order = list(range(len(cases)))
    random.Random(3).shuffle(order)
    answers = extract_in_process({"id": MODEL, "source": {"path": str(path)}}, cases, order)
    assert_answers(answers, cases, order)


def test_pytorch_model_bin_and_safetensors_give_the_same_spans(
        expected: tuple[Path, list[dict[str, Any]]]) -> None:
    """The local-path tier: the checkpoint as gliner saves it by default (pytorch_model.bin,
    read with torch.load(weights_only=True)) and as safetensors answer alike."""
    path, cases = expected
    safetensors = path.parent / "model_safetensors"
    assert sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".safetensors")) == [
        "pytorch_model.bin"]
    assert (safetensors / "model.safetensors").is_file()
    assert not (safetensors / "pytorch_model.bin").exists()
    order = list(range(len(cases)))
    from_bin = extract_in_process({"id": MODEL, "source": {"path": str(path)}}, cases, order)
    from_safetensors = extract_in_process(
        {"id": f"{MODEL}-st", "source": {"path": str(safetensors)}}, cases, order)
    assert_answers(from_bin, cases, order)
    assert sum(map(len, from_bin)) > 100
    assert from_bin == from_safetensors  # the same weights: the same spans and scores


HUB_RESOLVE = """
import json, sys
from heron.runtime.modelconfig import parse_model_config
from heron.worker.weights import resolve_weights, wait_for_uploads
path = resolve_weights(parse_model_config(json.loads(sys.argv[1])))
assert wait_for_uploads(60)
print(json.dumps({"path": str(path)}))
"""


def test_a_bin_only_hub_repository_through_the_hub_and_s3_tiers(
        expected: tuple[Path, list[dict[str, Any]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub repository with gliner_config.json and pytorch_model.bin only (as
    urchade/gliner_small-v2.1), and a training_args.bin that must stay behind: a worker
    downloads it from the Hub (a loopback stand-in) and uploads it to the S3 cluster cache
    (moto's S3 server); a second worker, with an empty cache and the Hub offline, reads it
    from S3 and answers as gliner does."""
    import os
    import shutil
    import subprocess
    import sys

    from tests.support.config_procs import MotoS3
    from tests.support.fake_hub import FakeHub
    from tests.support.servers import REPO

    path, cases = expected
    repo_dir = tmp_path / "repo"
    shutil.copytree(path, repo_dir)
    (repo_dir / "training_args.bin").write_bytes(b"a pickle that is never downloaded")
    (repo_dir / "README.md").write_text("# gliner")
    config = {"id": "org/gliner-bin", "source": {"hub": "org/gliner-bin"}}
    moto = MotoS3(tmp_path)
    hub = FakeHub({"org/gliner-bin": repo_dir}).start()
    try:
        env = moto.weights_env("gliner-cache")
        # A process of its own: huggingface-hub reads HF_HUB_OFFLINE at import, and this
        # one imported it offline.
        clean = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        done = subprocess.run(
            [sys.executable, "-c", HUB_RESOLVE, json.dumps(config)], cwd=REPO, text=True,
            capture_output=True, timeout=120,
            env={**clean, **env, "HERON_CACHE_DIR": str(tmp_path / "c1"),
                 "HF_ENDPOINT": hub.url})
        assert done.returncode == 0, done.stderr
        first = Path(json.loads(done.stdout.splitlines()[-1])["path"])
        want = ["gliner_config.json", "pytorch_model.bin", "tokenizer.json",
                "tokenizer_config.json"]
        assert sorted(p.name for p in first.iterdir() if not p.name.startswith(".")) == want
        assert not any("training_args" in r for r in hub.requests)
        asked = len(hub.requests)

        for name, value in {**env, "HERON_CACHE_DIR": str(tmp_path / "c2"),
                            "HF_HUB_OFFLINE": "1"}.items():
            monkeypatch.setenv(name, value)
        order = list(range(len(cases)))
        answers = extract_in_process(config, cases, order)  # from S3 alone
        second = tmp_path / "c2" / "org--gliner-bin" / "main"
        assert sorted(p.name for p in second.iterdir() if not p.name.startswith(".")) == want
        assert_answers(answers, cases, order)
        assert len(hub.requests) == asked
    finally:
        hub.stop()
        moto.stop()


def test_through_the_gateway_and_a_worker(cluster_url: str) -> None:
    """The cluster path (the session's gateway, NATS and a real worker, with tests/support's
    tiny GLiNER): different label sets at once, and refusals from the gateway's parser and
    from the worker alike are 422s."""
    def post(body: dict[str, Any]) -> httpx.Response:
        return local_http.post(f"{cluster_url}/v1/extract/tiny-gliner", json=body, timeout=60)

    text = "Ada Lovelace met Charles Babbage in London."
    bodies = [{"items": [text, "Paris"], "labels": labels, "threshold": 0.0}
              for labels in (["person"], ["city", "person"], ["date", "money", "event"])]
    bad = [{"items": [text], "labels": [f"t{i}" for i in range(51)]},  # the gateway's parser
           {"items": [text]}]  # the worker: a zero-shot model needs labels
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(post, bodies + bad))
    for body, answer in zip(bodies, answers, strict=False):
        assert answer.status_code == 200, answer.text
        entities = answer.json()["items"][0]["entities"]
        assert entities and {e["label"] for e in entities} <= set(body["labels"])
    for answer in answers[3:]:
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["code"] == "INVALID_FIELD"
        assert answer.json()["error"]["field"] == "labels"
