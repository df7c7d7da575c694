"""The default precision: `auto` is bf16 (autocast) on CPUs that compute bf16 natively, and
its embeddings stay within cosine 0.9999 of fp32 sentence-transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from heron.worker.registry import cpu_has_native_bf16, select_precision, use_cudnn_attention
from tests.support import local_http
from tests.support.servers import start_serve
from tests.support.tiny_models import minilm_dir

TEXTS = ["hello world", "A man is eating food.", "Paris is the capital of France.",
         " ".join(["the quick brown fox jumps over the lazy dog"] * 25),
         *(f"mixed batch item {n} " * (n % 7 + 1) for n in range(28))]


def test_auto_precision_is_bf16_only_where_the_cpu_has_it() -> None:
    import torch

    weights, autocast = select_precision("auto", torch.device("cpu"))
    assert weights == torch.float32
    assert autocast == (torch.bfloat16 if cpu_has_native_bf16() else None)
    assert select_precision("fp32", torch.device("cpu")) == (torch.float32, None)


def test_cudnn_attention_is_off_unless_asked_for() -> None:
    # On CUDA a worker keeps torch's attention off cuDNN's kernel, whose plan for each new
    # batch shape cost 68 ms a pass on an H200 (use_cudnn_attention says more); the switch
    # is torch's own process-wide flag, set here as the worker sets it.
    import torch

    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for env, want in [({}, False), ({"HERON_CUDNN_ATTENTION": "0"}, False),
                          ({"HERON_CUDNN_ATTENTION": "1"}, True), ({}, False)]:
            assert use_cudnn_attention(env) is want
            assert torch.backends.cuda.cudnn_sdp_enabled() is want
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.slow
def test_default_precision_serves_within_cosine_0_9999_of_fp32(tmp_path: Path) -> None:
    # --precision profile: the bundle's own setting (auto), not the suite's fp32 override.
    server = start_serve("default", tmp_path, extra_args=["--precision", "profile"])
    try:
        model = local_http.get(server.url + "/v1/models/minilm").json()
        assert model["dtype"] == ("bfloat16" if cpu_has_native_bf16() else "float32")
        r = local_http.post(server.url + "/v1/encode/minilm", json={"items": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        ours = np.array([i["dense"] for i in r.json()["items"]], dtype=np.float32)
    finally:
        server.stop()
    theirs = SentenceTransformer(str(minilm_dir()), device="cpu").encode(
        TEXTS, normalize_embeddings=True)
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1)
    assert cosine.min() >= 0.9999, cosine.min()
