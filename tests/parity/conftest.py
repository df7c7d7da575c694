"""The parity suite: each model family against its reference library.

Every script in ``references/`` builds tiny random-weight checkpoints in its library's own
format, one folder per case: ``<out>/<case>/model`` and ``<out>/<case>/expected.npz``, what
that library computes for ``texts.py``'s texts (case names are unique across scripts; an
optional ``<out>/<case>/heron.json`` adds fields to the case's model config, such as
``trust_remote_code``). A script's second line names the venv it runs in:
``# reference venv: main`` (this one: sentence-transformers) or ``# reference venv: parity``
(``.venv-parity``, built by the Makefile: PyLate and FlagEmbedding pin versions of
sentence-transformers and transformers that ours are newer than) or ``# reference venv:
gliner`` (``.venv-gliner``: gliner pins an older transformers). The scripts run in the
background from the end of collection (reference_build.py).

Heron serves every checkpoint from a config that names only its id (``parity/<case>``) and
path, three ways: ``heron serve`` (packing where the family allows it), ``heron serve`` with
``HERON_PACKING=off``, and a gateway in front of a ``heron worker`` over NATS. All run fp32
(``--precision fp32``): the references compute in fp32, and bf16 is a precision choice, not
the model's answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from heron_sdk import Client
from tests.parity import reference_build
from tests.support.gateway_harness import GatewayThread, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, ServerProcess, free_port, start_serve, wait_until

SERVER_ARGS = ["--precision", "fp32", "--workers", "1"]


@dataclass(frozen=True)
class ParityCase:
    name: str  # its folder under the script's output
    out: Path

    @property
    def model_id(self) -> str:
        return f"parity/{self.name}"

    def expected(self) -> dict[str, np.ndarray]:
        with np.load(self.out / "expected.npz", allow_pickle=False) as data:
            return {k: data[k] for k in data.files}


def case_named(cases: dict[str, ParityCase], name: str) -> ParityCase:
    """The case a reference script made, or a failure naming the ones it did make."""
    assert name in cases, f"no reference case {name}: {sorted(cases)}"
    return cases[name]


@pytest.fixture(scope="session")
def parity_cases() -> dict[str, ParityCase]:
    """Every reference script run once (reference_build: started in the background when
    collection ended): case name -> its case."""
    root = reference_build.wait()
    cases: dict[str, ParityCase] = {}
    for script in reference_build.selected_scripts():
        for folder in sorted(p for p in (root / script.stem).iterdir() if p.is_dir()):
            assert folder.name not in cases, f"case {folder.name} made by two scripts"
            assert (folder / "model").is_dir() and (folder / "expected.npz").exists(), folder
            cases[folder.name] = ParityCase(folder.name, folder)
    return cases


@pytest.fixture(scope="session")
def parity_bundle(parity_cases: dict[str, ParityCase],
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One bundle serving every case from a config with only its id and path (and the
    remote-code opt-in where the case's ``config.json`` of Heron options asks for it)."""
    root = tmp_path_factory.mktemp("parity-bundle")
    (root / "models").mkdir()
    files = []
    for case in parity_cases.values():
        config = {"id": case.model_id, "source": {"path": str(case.out / "model")}}
        extra = case.out / "heron.json"
        if extra.exists():
            config.update(json.loads(extra.read_text()))
        (root / "models" / f"{case.name}.yaml").write_text(yaml.safe_dump(config))
        files.append(f"{case.name}.yaml")
    bundle = root / "parity.yaml"
    bundle.write_text(yaml.safe_dump({"name": "parity", "models": files}))
    return bundle


def _serve(bundle: Path, log_dir: Path, env: dict[str, str] | None = None) -> ServerProcess:
    return start_serve(bundle, log_dir, extra_args=SERVER_ARGS, env=env, wait_ready=False)


@pytest.fixture(scope="session")
def parity_servers(parity_bundle: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[dict[str, str]]:
    """``serve`` (packed where allowed), ``unpacked`` (HERON_PACKING=off) and ``gateway``
    (NATS, a real ``heron worker``): name -> base URL."""
    logs = tmp_path_factory.mktemp("parity-logs")
    # Requests of 50 texts: a multi-vector answer (a vector a token) can pass NATS's 1 MB
    # default message size.
    nats = NatsServer(tmp_path_factory.mktemp("parity-nats"), max_payload=64 << 20).start()
    started: list[ServerProcess] = []
    gateway: GatewayThread | None = None
    try:
        # All three load their models at once: one after another took minutes.
        started.append(_serve(parity_bundle, logs))
        started.append(_serve(parity_bundle, logs, {"HERON_PACKING": "off"}))
        pool = unique("parity")
        worker = _start_worker(nats.url, pool, parity_bundle, logs)
        started.append(worker)
        for server in started:
            wait_until(server, "/readyz", 600)
        gateway = GatewayThread(nats.url, {str(parity_bundle): pool}).start()
        gateway.wait_for_capacity(pool, 60, worker.log)
        yield {"serve": started[0].url, "unpacked": started[1].url, "gateway": gateway.url}
    finally:
        if gateway is not None:
            gateway.stop()
        for server in started:
            server.stop()
        nats.stop()


def _start_worker(nats_url: str, pool: str, bundle: Path, log_dir: Path) -> ServerProcess:

    port = free_port()
    log_path = log_dir / f"worker-{port}.log"
    cmd = [sys.executable, "-m", "heron.cli", "worker", "--nats", nats_url, "--pool", pool,
           "--bundle", str(bundle), "--host", "127.0.0.1", "--port", str(port),
           "--worker-id", f"w-{port}", "--log-level", "warning", "--precision", "fp32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="session", params=["serve", "unpacked", "gateway"])
def heron(request: pytest.FixtureRequest, parity_servers: dict[str, str]) -> Iterator[Client]:
    """An SDK client on each way of serving in turn."""
    with Client(parity_servers[request.param], timeout=120) as client:
        yield client
