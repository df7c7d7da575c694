"""Which files a Hub fill downloads, from a repository's listing (no network): safetensors
where a folder has them, else its ``pytorch_model.bin`` (or shards), and never other
pickles (``training_args.bin``)."""

from __future__ import annotations

from heron.worker.weights import hub_files

GLINER_BIN_ONLY = [  # urchade/gliner_small-v2.1's files
    ".gitattributes", "README.md", "gliner_config.json", "pytorch_model.bin"]


def test_a_gliner_repo_with_only_pytorch_model_bin_gets_it() -> None:
    assert sorted(hub_files(GLINER_BIN_ONLY)) == ["gliner_config.json", "pytorch_model.bin"]


def test_safetensors_win_over_bin_folder_by_folder() -> None:
    listing = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
               "modules.json", "1_Pooling/config.json", "2_Dense/config.json",
               "2_Dense/pytorch_model.bin", "3_Dense/config.json", "3_Dense/model.safetensors",
               "3_Dense/pytorch_model.bin", "onnx/model.onnx", "flax_model.msgpack"]
    assert sorted(hub_files(listing)) == [
        "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/pytorch_model.bin",
        "3_Dense/config.json", "3_Dense/model.safetensors", "config.json", "model.safetensors",
        "modules.json", "tokenizer.json"]


def test_sharded_bin_and_no_other_pickles() -> None:
    listing = ["config.json", "pytorch_model-00001-of-00002.bin",
               "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
               "training_args.bin", "optimizer.bin", "rng_state.bin", "scheduler.bin",
               "checkpoint-500/pytorch_model.bin.bak", "adapter_model.bin"]
    assert sorted(hub_files(listing)) == [
        "config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json"]
