"""`heron config` and `heron gateway` run, and route, where torch cannot be imported.

The control image installs `heron` without its worker extra (deploy/docker/
Dockerfile.control). Here both services start with the model stack made unimportable
(a sitecustomize on PYTHONPATH puts None in sys.modules, so ``import torch`` raises
ModuleNotFoundError as it would with no torch installed), the gateway loads its routes from
the config service, lists the default bundle's model and answers an encode for it with 202
(no worker in the pool yet), as it does with torch installed. A model command there
(`heron worker`) exits 2 naming the extra to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess, GatewayProcess
from tests.support.model_stack import without_model_stack
from tests.support.nats_server import NatsServer


def test_gateway_and_config_service_serve_without_torch(nats_server: NatsServer,
                                                        tmp_path: Path) -> None:
    env = without_model_stack(tmp_path)
    service = ConfigProcess(nats_server.url, str(tmp_path / "store"), tmp_path, extra_env=env)
    gateway = None
    try:
        service.wait_ready()
        pool = f"nt{uuid.uuid4().hex[:8]}"
        gateway = GatewayProcess(nats_server.url, {"default": pool}, tmp_path,
                                 extra_args=["--config", service.url], extra_env=env)
        gateway.wait_ready()
        models = local_http.get(gateway.url + "/v1/models", timeout=10).json()
        assert "sentence-transformers/all-MiniLM-L6-v2" in str(models)
        r = local_http.post(gateway.url + "/v1/encode/minilm", json={"items": ["hello"]},
                            timeout=10)
        assert r.status_code == 202 and "retry-after" in r.headers, r.text
        exported = local_http.get(service.url + "/v1/configs/epoch", timeout=10)
        assert exported.status_code == 200
    finally:
        if gateway is not None:
            gateway.stop()
        service.stop()
    for log in (service.log_path, gateway.log_path if gateway else None):
        if log is not None:
            text = log.read_text(errors="replace")
            assert "ModuleNotFoundError" not in text and "Traceback" not in text, text


def test_the_blocker_really_blocks(tmp_path: Path) -> None:
    """The premise of the test above: with the helper on PYTHONPATH torch does not import."""
    env = {**os.environ, **without_model_stack(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_model_commands_name_the_worker_extra_without_torch(tmp_path: Path) -> None:
    """`heron worker` in the control image: a clear exit 2 saying what to install."""
    env = {**os.environ, **without_model_stack(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "heron.cli", "worker", "--port", "1"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "torch is not installed" in proc.stderr and "'.[worker]'" in proc.stderr
    assert "Traceback" not in proc.stderr
