"""Faults of a 3-node JetStream cluster under load, with every stream at three replicas
(HERON_STREAM_REPLICAS=3, as deploy/k8s runs it) and the gateway and worker given all
three URLs: kill -9 the node leading the pool's work stream, then a follower, then the
node the gateway is connected to. A JetStream election is latency, not errors: clients
with a 30 s timeout see no non-200 answer, and every 200 is right."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from heron.runtime.nats_names import work_consumer, work_stream
from tests.faults.harness import Rig, run_with_fault, show, start_rig
from tests.faults.traffic import (
    at,
    closed_loop,
    lost,
    non_200,
    rates_around,
    summary,
    wrong,
)
from tests.support.nats_server import NatsCluster, NatsServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CLIENTS = 100  # concurrent single-text clients, each with a 30 s timeout
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsCluster, Rig]]:
    log_dir = tmp_path_factory.mktemp("faults-cluster3")
    nats = NatsCluster(log_dir / "nats").start()
    try:
        rig = start_rig(nats.url, log_dir, env={"HERON_STREAM_REPLICAS": "3"},
                        gateway_id=f"g{uuid.uuid4().hex[:6]}", tag="cluster3")
    except BaseException:
        nats.stop()
        raise
    yield nats, rig
    rig.stop()
    nats.stop()


def restore(nats: NatsCluster, rig: Rig) -> float:
    """Every node up again and every replica of the pool's stream and consumer current,
    so the next kill leaves a quorum; seconds it took."""
    for node in nats.nodes:
        if not node.running:
            nats.restart(node)
    return nats.wait_replicas_current(work_stream(rig.pool), (work_consumer(rig.pool),))


@pytest.fixture()
def whole_cluster(cluster3: tuple[NatsCluster, Rig]) -> tuple[NatsCluster, Rig]:
    restore(*cluster3)
    return cluster3


def kill_under_load(nats: NatsCluster, rig: Rig, node: NatsServer, *, duration_s: float,
                    kill_at_s: float) -> tuple[list, dict]:
    """Load the gateway, kill -9 ``node`` ``kill_at_s`` in; the answers and the figures."""
    stream = work_stream(rig.pool)
    roles = {"killed": node.name,
             "led_stream": nats.stream_leader(stream) is node,
             "led_consumer": nats.consumer_leader(stream, work_consumer(rig.pool)) is node,
             "had_gateway": nats.node_of_connection(rig.gateway.nats_connection_name) is node,
             "had_workers": sum(nats.node_of_connection(w.worker_id) is node
                                for w in rig.live_workers())}
    answers, struck = run_with_fault(
        closed_loop(rig.gateway.url, rig.texts, CLIENTS, duration_s, timeout_s=TIMEOUT_S),
        at(kill_at_s, node.kill))
    figures = {**summary(answers, rig.ref), **roles, "kill_at_s": round(struck, 2),
               "non_200": len(non_200(answers)),
               **rates_around(answers, struck, duration_s,
                              window_s=min(5.0, (duration_s - struck) / 2)),
               "stream_leader_after": nats.stream_leader(stream).name}
    return answers, figures


def test_stream_leader_kill_9_under_load(whole_cluster: tuple[NatsCluster, Rig]) -> None:
    nats, rig = whole_cluster
    leader = nats.stream_leader(work_stream(rig.pool))
    answers, figures = kill_under_load(nats, rig, leader, duration_s=12.0, kill_at_s=3.0)
    figures["rejoined_current_after_s"] = round(restore(nats, rig), 2)
    show("stream_leader_kill_9", figures)
    assert not lost(answers), (figures, rig.logs())
    assert not non_200(answers), figures
    assert not wrong(answers, rig.ref), figures


def test_follower_kill_9_under_load(whole_cluster: tuple[NatsCluster, Rig]) -> None:
    """First a node that neither leads the stream nor holds the gateway's connection;
    then the node the gateway is connected to (its stream leadership moved away first, so
    this is a follower too): the gateway reconnects to another node meanwhile."""
    nats, rig = whole_cluster
    stream = work_stream(rig.pool)
    leader = nats.stream_leader(stream)
    gateway_node = nats.node_of_connection(rig.gateway.nats_connection_name)
    follower = next(n for n in nats.nodes if n is not leader and n is not gateway_node)
    quiet, quiet_figures = kill_under_load(nats, rig, follower, duration_s=7.0,
                                           kill_at_s=2.0)
    restore(nats, rig)

    gateway_node = nats.node_of_connection(rig.gateway.nats_connection_name)
    assert gateway_node is not None, "the gateway is connected to no node"
    for _ in range(5):  # a step-down elects one of the other two at random
        if nats.stream_leader(stream) is not gateway_node:
            break
        nats.step_down(stream)
        restore(nats, rig)
    assert nats.stream_leader(stream) is not gateway_node
    busy, busy_figures = kill_under_load(nats, rig, gateway_node, duration_s=7.0,
                                         kill_at_s=2.0)
    show("follower_kill_9", {"quiet_follower": quiet_figures,
                             "gateway_node": busy_figures})
    for answers, figures in ((quiet, quiet_figures), (busy, busy_figures)):
        assert not lost(answers), (figures, rig.logs())
        assert not non_200(answers), figures
        assert not wrong(answers, rig.ref), figures
