"""`heron up --workers`: a number or auto, and each worker's share of the cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from heron.cli import up
from heron.cli.main import build_parser, usable_cpus
from heron.runtime.modelconfig import ConfigError


def test_a_number_is_taken_as_it_is_and_zero_waits_for_the_first_request() -> None:
    assert up.workers_to_start("3") == 3
    assert up.workers_to_start("0") == 0


@pytest.mark.parametrize("value", ["-1", "two", "1.5", ""])
def test_anything_else_is_refused_naming_the_flag(value: str) -> None:
    with pytest.raises(SystemExit, match=r"heron up: --workers .*a number >= 0, or auto"):
        up.workers_to_start(value)


def test_auto_is_one_worker_running_a_pass_per_cpu_on_cpu_and_one_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERON_INFERENCE_THREADS", raising=False)
    monkeypatch.setenv("HERON_DEVICE", "cpu")
    assert up.workers_to_start("auto") == 1
    # As many passes at once as heron serve runs processes.
    assert up.worker_inference_threads("auto") == min(usable_cpus(), 4)
    assert up.worker_inference_threads("2") == 0  # a number: the worker's own setting
    monkeypatch.setenv("HERON_DEVICE", "cuda")
    assert up.workers_to_start("auto") == 1
    assert up.worker_inference_threads("auto") == 0  # one inference thread a model there
    monkeypatch.setenv("HERON_DEVICE", "cpu")
    monkeypatch.setenv("HERON_INFERENCE_THREADS", "3")
    assert up.worker_inference_threads("auto") == 0  # the operator's own setting


def test_each_workers_passes_are_heron_ups_or_the_operators(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERON_DEVICE", "cpu")
    monkeypatch.delenv("HERON_INFERENCE_THREADS", raising=False)
    assert up.worker_passes("auto") == min(usable_cpus(), 4)
    assert up.worker_passes("2") == 1
    monkeypatch.setenv("HERON_INFERENCE_THREADS", "3")
    assert up.worker_passes("auto") == up.worker_passes("2") == 3
    monkeypatch.setenv("HERON_INFERENCE_THREADS", "0")  # refused before any worker starts
    with pytest.raises(ConfigError, match="--inference-threads: 0: expected a number >= 1"):
        up.worker_passes("2")


def test_the_cores_are_split_unless_heron_threads_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERON_THREADS", raising=False)
    assert up.worker_threads(1) == usable_cpus()
    assert up.worker_threads(0) == usable_cpus()  # the first worker, on demand, alone
    assert up.worker_threads(usable_cpus() * 2) == 1  # never under one thread
    # Between the forward passes one worker runs at once, as between workers.
    assert up.worker_threads(1, usable_cpus()) == 1
    assert up.worker_threads(1, 2) == max(1, usable_cpus() // 2)
    monkeypatch.setenv("HERON_THREADS", "3")
    assert up.worker_threads(2) == 0  # the workers read the operator's own setting


def test_the_flag_defaults_to_heron_workers_then_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERON_WORKERS", raising=False)
    assert build_parser().parse_args(["up"]).workers == "auto"
    monkeypatch.setenv("HERON_WORKERS", "2")
    assert build_parser().parse_args(["up"]).workers == "2"


def test_the_sole_worker_of_several_passes_fetches_during_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """heron up's one worker of its static pool, on its own NATS, holds the lookahead while
    its passes run (no other worker to leave the items to); a pool of several workers, a
    NATS shared with others, one pass, or the operator's own setting keep the worker's
    default (nothing set)."""
    monkeypatch.delenv("HERON_FETCH_LOOKAHEAD_BUSY", raising=False)
    monkeypatch.delenv("HERON_FETCH_LOOKAHEAD", raising=False)
    assert up.sole_worker_lookahead_busy(2, 1, 4, None) == 16
    assert up.sole_worker_lookahead_busy(2, 0, 4, None) == 16  # scaled from zero: one
    assert up.sole_worker_lookahead_busy(2, 2, 4, None) is None
    assert up.sole_worker_lookahead_busy(2, 1, 4, "nats://10.0.0.5:4222") is None
    assert up.sole_worker_lookahead_busy(1, 1, 4, None) is None
    monkeypatch.setenv("HERON_FETCH_LOOKAHEAD", "8")
    assert up.sole_worker_lookahead_busy(2, 1, 4, None) == 8
    monkeypatch.setenv("HERON_FETCH_LOOKAHEAD_BUSY", "0")
    assert up.sole_worker_lookahead_busy(2, 1, 4, None) is None


def test_only_the_static_pools_workers_get_heron_ups_fetching_choice(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from heron.cli.local_cluster import LocalCluster

    monkeypatch.delenv("HERON_FETCH_LOOKAHEAD_BUSY", raising=False)
    cluster = LocalCluster(up.UpOptions(pool="default", data_dir=tmp_path,
                                        worker_fetch_lookahead_busy=16), [])
    assert cluster.worker_env("default")["HERON_FETCH_LOOKAHEAD_BUSY"] == "16"
    # A leased pool may hold several workers (POST /v1/pools): theirs stays the default.
    assert "HERON_FETCH_LOOKAHEAD_BUSY" not in cluster.worker_env("leased")
    plain = LocalCluster(up.UpOptions(pool="default", data_dir=tmp_path), [])
    assert "HERON_FETCH_LOOKAHEAD_BUSY" not in plain.worker_env("default")
