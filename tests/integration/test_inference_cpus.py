"""`heron serve --inference-cpus`: the inference thread on CPUs of its own, the rest of the
worker (event loop, tokenizer threads) on the others, and bad values refused at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from heron.worker.cpus import parse_cpu_list
from tests.support import local_http
from tests.support.model_stack import without_model_stack
from tests.support.servers import REPO, start_serve


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Every thread of ``pid`` and the CPUs it may run on (from /proc)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return found


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 usable CPUs")
def test_auto_puts_the_inference_thread_alone_on_the_first_cpu(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    model_cpu, rest = frozenset(allowed[:1]), frozenset(allowed[1:])
    server = start_serve(REPO / "bundles" / "null.yaml", tmp_path, extra_args=[
        "--workers", "1", "--threads", "1", "--inference-cpus", "auto"])
    try:
        for i in range(5):
            r = local_http.post(f"{server.url}/v1/encode/null-model", json={"items": [f"t {i}"]},
                                timeout=30)
            assert r.status_code == 200
        threads = thread_cpus(server.proc.pid)
        assert threads[server.proc.pid] == rest  # the event loop: off the model's CPU
        on_model_cpu = [tid for tid, cpus in threads.items() if cpus == model_cpu]
        assert len(on_model_cpu) == 1  # the inference thread, alone there
        # Threads started after the event loop moved (tokenizer pool, ...) follow it.
        assert all(cpus in (rest, model_cpu) for cpus in threads.values()), threads
    finally:
        server.stop()


@pytest.mark.parametrize(("value", "message"), [
    ("0-x", "--inference-cpus: 0-x: expected off, auto, or a CPU list such as 0-3,6"),
    ("100000", "--inference-cpus: 100000: CPUs 100000 are not usable by this process"),
])
@pytest.mark.parametrize("command", [
    ["serve", "--workers", "1"], ["serve", "--workers", "2"],
    ["worker", "--nats", "nats://127.0.0.1:1"]])  # refused before it tries NATS
def test_a_bad_value_fails_start_up_with_a_config_error(value: str, message: str,
                                                        command: list[str],
                                                        tmp_path: Path) -> None:
    """Refused before torch and the model stack are imported (5-6 s of CPU here): the
    command runs with them unimportable and still names the bad value, not the missing
    torch."""
    proc = subprocess.run(
        [sys.executable, "-m", "heron.cli", *command, "--bundle", "null", "--port", "0",
         "--inference-cpus", value],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **without_model_stack(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
