"""Session fixtures: one tiny-model set, one `heron serve` child with MiniLM and friends."""

from __future__ import annotations

import os

# No test may reach a model hub; the hub test sets its own loopback endpoint.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every server and worker the suite starts computes in fp32 (`heron --precision` reads this),
# so tests can compare answers across batch compositions and processes at 1e-5: a mix-up
# of items shows. The default precision (bf16 on CPUs with native bf16) has its own test,
# tests/integration/test_precision.py, against fp32 at cosine >= 0.9999.
os.environ.setdefault("HERON_PRECISION", "fp32")
# The shared servers must not evict their models because the machine is busy with other
# tests' processes; eviction has its own tests with explicit budgets.
os.environ.setdefault("HERON_MEMORY_THRESHOLD_PERCENT", "99")
# One process per `heron serve` (the default on CPU is one per core): tests look at one
# process's state; tests/integration/test_serve_workers.py covers several.
os.environ.setdefault("HERON_WORKERS", "1")

import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from hypothesis import settings

from heron.gateway.settings import GatewaySettings
from tests.parity import reference_build
from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess
from tests.support.gateway_harness import GatewayThread, start_worker, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, ServerProcess, start_serve
from tests.support.tiny_models import build_tiny_models
from tests.support.tiny_vision import build_tiny_clip

# Property tests check logic, not speed: no per-example deadline on a busy CI machine. In CI
# (CI set) the examples are derandomized: a run on a submission explores the same cases as
# the runs before it, so a new finding shows up in a developer's run, never as a red CI on an
# unrelated change; locally each run draws new ones (that is how schemathesis found an answer
# too large for NATS).
settings.register_profile("heron", deadline=None, derandomize=bool(os.environ.get("CI")))
settings.load_profile("heron")

# name -> (adapter, profile overrides)
TINY_CONFIGS = {
    "tiny-multi-vector": ("multi_vector", {}),
    "tiny-cross-encoder": ("cross_encoder", {}),
    "tiny-ner": ("token_classifier", {}),
    "tiny-sparse": ("sparse", {}),
    "tiny-dense-cls": ("dense", {"pooling": "cls", "query_instruction": "query: ",
                                 "document_instruction": "passage: "}),
    "tiny-sentencepiece": ("dense", {"pooling": "mean"}),
    "tiny-gliner": ("gliner", {}),
    "tiny-clip": ("clip", {}),
    # tiny-dense-cls's checkpoint again, with a LoRA adapter a request may name
    "tiny-lora": ("dense", {"pooling": "mean"}),
}
# model name -> {adapter name: checkpoint name in ``tiny_models``}
TINY_LORAS = {"tiny-lora": {"legal": "tiny-lora-legal"}}
# model name -> the ``tiny_models`` checkpoint it serves, where the two differ
TINY_SOURCES = {"tiny-lora": "tiny-dense-cls"}


def _in_xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def _is_parity(item: pytest.Item) -> bool:
    return reference_build.PARITY_DIR in Path(item.path).parents


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (`make test`: a file's tests in one process, so its module
    fixtures start once), with the whole parity suite as one file: its servers and
    reference build are session fixtures, which each process would start. xdist queues the
    units with the most tests first, so the parity suite (162 tests, about 7 minutes)
    starts at once instead of being the run's tail."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    parity = reference_build.PARITY_DIR.relative_to(REPO).as_posix()  # as node ids spell it

    class ParityTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return parity if path.startswith(parity + "/") else path

    return ParityTogether(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A parity test will run: its reference scripts start now, in the background (niced),
    not when the first parity test needs them (tests/parity/reference_build.py). Not in an
    xdist process: each collects every test, and the one the parity suite lands in starts
    the build when its first parity test asks (the suite runs first there)."""
    if not _in_xdist_worker() and any(_is_parity(item) for item in session.items):
        reference_build.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reference_build.stop()


def build_tiny_lora(base: Path, path: Path, seed: int = 1) -> Path:
    """A PEFT LoRA adapter on a tiny BertModel, with B drawn large enough (B is zero at
    PEFT's default init) that it moves the embedding well away from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertModel

    torch.manual_seed(seed)
    with warnings.catch_warnings():  # peft calls a deprecated transformers property
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(BertModel.from_pretrained(str(base)), LoraConfig(
            r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False))
    with torch.no_grad():
        for key, weight in model.named_parameters():
            if "lora_B" in key:
                weight.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    models = build_tiny_models(root)
    models["tiny-clip"] = build_tiny_clip(root / "tiny-clip")
    models["tiny-lora-legal"] = build_tiny_lora(models["tiny-dense-cls"],
                                                root / "tiny-lora-legal")
    return models


@pytest.fixture(scope="session")
def test_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Path:
    """bundles/default.yaml's models, splade-tiny, and every tiny model, in one bundle: a
    tiny CLIP (images) and a tiny dense model with a LoRA adapter among them."""
    root = tmp_path_factory.mktemp("bundles")
    (root / "models").mkdir()
    names = []
    for src in ("all-minilm-l6-v2.yaml", "splade-tiny.yaml"):
        shutil.copy(REPO / "bundles" / "models" / src, root / "models" / src)
        names.append(src)
    for name, (adapter, profile) in TINY_CONFIGS.items():
        config = {"id": f"test/{name}", "aliases": [name], "adapter": adapter,
                  "source": {"path": str(tiny_models[TINY_SOURCES.get(name, name)])},
                  "profiles": {"default": {"max_sequence_length": 64, **profile}}}
        if name in TINY_LORAS:
            config["loras"] = {lora: {"path": str(tiny_models[checkpoint])}
                               for lora, checkpoint in TINY_LORAS[name].items()}
        (root / "models" / f"{name}.yaml").write_text(yaml.safe_dump(config))
        names.append(f"{name}.yaml")
    bundle = {"name": "test", "models": names}
    (root / "test.yaml").write_text(yaml.safe_dump(bundle))
    return root / "test.yaml"


@pytest.fixture(scope="session")
def server(test_bundle: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    proc = start_serve(test_bundle, tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture()
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One nats-server for the session; tests isolate themselves by pool name."""
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture()
def config_service(nats_server: NatsServer, tmp_path: Path) -> Iterator[ConfigProcess]:
    """A `heron config` process with a fresh store, on the session's nats-server."""
    service = ConfigProcess(nats_server.url, str(tmp_path / "store"), tmp_path)
    service.wait_ready()
    # Ready means loaded and connected; a write needs the writer lease, which a config
    # service stopped by an earlier test on this session's NATS can hold until its TTL
    # (5 s) runs out (a 503 NOT_LEADER to a test's first write, seen in CI).
    deadline = time.monotonic() + 20
    while not local_http.get(service.url + "/healthz", timeout=5).json().get("leader"):
        if time.monotonic() > deadline:
            service.stop()
            raise TimeoutError("the config service did not take the writer lease in 20 s")
        time.sleep(0.1)
    yield service
    service.stop()


@pytest.fixture(scope="session")
def cluster_job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where ``cluster_url``'s gateway may read and write bulk jobs' files."""
    return tmp_path_factory.mktemp("cluster-jobs")


@pytest.fixture(scope="session")
def cluster_url(nats_server: NatsServer, test_bundle: Path, cluster_job_root: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway routing the test bundle (MiniLM, splade-tiny, the tiny models: the same
    bundle the session's `heron serve` runs) to a pool with one real worker: the cluster
    twin of ``base_url``. Its bulk jobs may use ``cluster_job_root``."""
    pool = unique("e2e")
    worker = start_worker(nats_server.url, pool, test_bundle,
                          tmp_path_factory.mktemp("e2e-logs"))
    gateway = GatewayThread(nats_server.url, {str(test_bundle): pool},
                            settings=GatewaySettings(job_roots=str(cluster_job_root))).start()
    try:
        gateway.wait_for_capacity(pool, 60, worker.log)
        beat = gateway.gateway.health.healthy(pool)[0]
        # gateway and worker read the same configs: their bundle hashes agree
        assert beat.bundle_hash == gateway.gateway.registry.bundle_hash(pool)
        yield gateway.url
    finally:
        gateway.stop()
        worker.stop()
