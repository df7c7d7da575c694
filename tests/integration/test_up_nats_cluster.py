"""`heron up --nats-nodes 3`: a local 3-node JetStream cluster under the whole cluster,
streams with three replicas, each node supervised like any child."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import nats
import pytest

from heron.runtime.nats_names import POOLS_BUCKET, work_stream
from tests.integration.test_up import UpProcess
from tests.support import local_http
from tests.support.servers import free_ports


def encode_status(up: UpProcess) -> int:
    r = local_http.post(up.url + "/v1/encode/minilm", json={"items": ["three nodes"]}, timeout=30)
    assert r.status_code != 200 or len(r.json()["items"][0]["dense"]) == 384
    return r.status_code


@pytest.mark.slow
async def test_three_nats_nodes_three_replicas(tmp_path: Path) -> None:
    base = free_ports(3)
    urls = [f"nats://127.0.0.1:{base + i}" for i in range(3)]
    up = UpProcess(tmp_path, "--nats-nodes", "3", "--workers", "1", nats_port=base)
    try:
        up.wait_for(lambda: local_http.get(up.url + "/readyz", timeout=1).status_code == 200
                    and up.healthy_workers() == 1, timeout_s=180)
        assert encode_status(up) == 200
        commands = up.child_commands()
        nodes = [c for c in commands if "nats-server" in c]
        assert len(nodes) == 3 and all("--cluster_name heron-local" in c for c in nodes)
        assert all(f"-sd {up.data_dir}/nats-{i}" in nodes[i] for i in range(3))
        others = [c for c in commands if "nats-server" not in c]
        assert len(others) == 3 and all(f"--nats {','.join(urls)}" in c for c in others)
        assert all(p.environ().get("HERON_STREAM_REPLICAS") == "3"
                   for p in up.children_with("heron.cli"))

        nc = await nats.connect(servers=urls)
        try:
            js = nc.jetstream()
            for stream in (work_stream("default"), f"KV_{POOLS_BUCKET}"):
                info = await js.stream_info(stream)
                assert info.config.num_replicas == 3, stream
                assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        finally:
            await nc.close()

        # A node dies: it is restarted like any child, and the cluster keeps answering.
        [node] = up.children_with(f"-p {base + 1} ")
        node.send_signal(signal.SIGKILL)
        up.wait_for(lambda: "heron up: nats-1 restarted (restart 1)" in up.log.read_text(),
                    timeout_s=60)
        assert "heron up: nats-1 exited with status -9; restarting in 0.5 s (restart 1)" \
            in up.log.read_text()
        deadline = time.monotonic() + 60
        while encode_status(up) != 200:  # a leader election is latency, not an error
            assert time.monotonic() < deadline, up.log.read_text()
            time.sleep(0.5)
    finally:
        assert up.stop() == 0
