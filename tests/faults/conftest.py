"""The fault suite's shared pool: one nats-server of its own, one gateway and one MiniLM
worker (laid out as `heron up` lays out its default worker), started once for the package
(a worker takes about 8 s to load on the CI machine); each test adds the processes it
breaks. The NATS restart test restarts this server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from heron.cli import up
from tests.faults.harness import Rig, start_rig, wait_healthy
from tests.support.nats_server import NatsServer


@pytest.fixture(scope="package")
def nats_of_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("faults-nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="package")
def rig(nats_of_rig: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    # Workers as `heron up --workers auto` runs them on CPU: one worker computing a
    # single-thread forward pass per usable CPU at once.
    passes = up.worker_passes("auto")
    threads = up.worker_threads(1, passes)  # 0: HERON_THREADS is set, and inherited
    layout = {"HERON_INFERENCE_THREADS": str(passes),
              **({"HERON_THREADS": str(threads)} if threads else {})}
    started = start_rig(nats_of_rig.url, tmp_path_factory.mktemp("faults-logs"), env=layout)
    yield started
    started.stop()


@pytest.fixture()
def healthy_rig(rig: Rig, nats_of_rig: NatsServer) -> Rig:
    """The shared pool as a test must find it: NATS up (an earlier test may have failed
    while it was down), the gateway up, the first worker alone in the pool and healthy."""
    if not nats_of_rig.running:
        nats_of_rig.start()
    if rig.gateway.proc.poll() is not None:
        rig.gateway.restart()
        rig.gateway.wait_ready()
    for extra in rig.live_workers()[1:]:
        extra.stop()
    wait_healthy(rig.gateway, rig.pool, 1)
    return rig
