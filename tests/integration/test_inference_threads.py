"""`--inference-threads 2`: one `heron serve` process running two forward passes of a
model at once, each on its own thread. Its answers under a burst that mixes LoRA adapters
(installed while other passes run) match PEFT's merged models; both threads computed; a
bad value is refused at start. (The runner's scheduling itself: tests/unit/
test_inference_threads.py.)"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.integration.test_lora import (  # noqa: F401  (fixtures)
    ADAPTERS,
    Reference,
    assert_matches,
    encode_with,
    lora_models,
    model_config,
    reference,
    texts,
)
from tests.support.servers import REPO, ServerProcess, start_serve

TWO_PASSES = ["--workers", "1", "--threads", "1", "--inference-threads", "2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           lora_models: dict[str, Path]) -> Iterator[ServerProcess]:  # noqa: F811
    root = tmp_path_factory.mktemp("two-passes")
    (root / "models").mkdir()
    config = model_config("test/lora-base", lora_models, list(ADAPTERS), max_loras=3,
                          aliases=["lora-base"])
    (root / "models" / "lora.yaml").write_text(yaml.safe_dump(config))
    (root / "b.yaml").write_text(yaml.safe_dump({"name": "two", "models": ["lora.yaml"]}))
    proc = start_serve(root / "b.yaml", root, extra_args=TWO_PASSES)
    yield proc
    proc.stop()


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid``, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def test_a_burst_mixing_adapters_on_two_passes_answers_each_with_its_own(
        server: ServerProcess, reference: Reference) -> None:  # noqa: F811
    rng = random.Random(3)
    # Adapters load on first use, while the other thread's passes run: the gate holds the
    # install until no pass of the model runs.
    plan = [(rng.choice([None, "alpha", "beta", "gamma"]), texts(rng.randint(1, 3), seed=i))
            for i in range(400)]
    before = thread_cpu_s(server.proc.pid)

    async def burst() -> list[np.ndarray]:
        limit = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def one(adapter: str | None, items: list[str]) -> np.ndarray:
                async with limit:
                    return await encode_with(client, adapter, items)
            return await asyncio.gather(*(one(a, t) for a, t in plan))

    answers = asyncio.run(burst())
    for (adapter, items), got in zip(plan, answers, strict=True):
        assert_matches(got, reference.encode(items, adapter))
    # Both inference threads computed: apart from the event loop (the main thread), two
    # threads of the process spent CPU on the burst. (With one, a single thread does.)
    after = thread_cpu_s(server.proc.pid)
    spent = sorted((after[t] - before.get(t, 0.0) for t in after if t != server.proc.pid),
                   reverse=True)
    assert spent[1] >= 0.2 * spent[0] and spent[1] >= 0.05, spent[:4]


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_value_is_refused_at_start(value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "heron.cli", "serve", "--inference-threads",
                           value, "--port", "0"], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert done.returncode == 2
    assert f"--inference-threads: {value}: expected a number >= 1" in done.stderr
