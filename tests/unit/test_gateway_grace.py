"""How long a gateway waits for a worker's beat before answering 202, around a NATS
reconnect: a pool that was warm when NATS went away waits reconnect_grace_s for its worker,
a cold one the heartbeat timeout, and a request that comes in the window between the NATS
client saying it is connected and the gateway's reconnect hook gets the same grace, not the
spent grace of the connection before (CI: 7 of 64 requests answered 202 for a warm pool)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from heron.gateway.registry import BundleDirSource, RouteTable
from heron.gateway.routes import GatewayApp
from heron.gateway.settings import GatewaySettings
from tests.support.beats import Clock, beat
from tests.support.gateway_harness import write_bundles

RECONNECT_GRACE_S = 10.0
HEARTBEAT_TIMEOUT_S = 3.0


@pytest.fixture
def gateway(tmp_path: Path) -> GatewayApp:
    """A gateway app that never connects (its NATS link is not started): pool ``warm``
    serves bundle b, pool ``cold`` bundle c."""
    root = write_bundles(tmp_path, {"b": ["dense"], "c": ["dense"]})
    registry = RouteTable(BundleDirSource({"b": "warm", "c": "cold"}, root))
    registry.load()
    settings = GatewaySettings(reconnect_grace_s=RECONNECT_GRACE_S,
                               heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    return GatewayApp("nats://127.0.0.1:1", registry, settings=settings)


def lost_nats(gateway: GatewayApp, *, connected_s_ago: float, beat_before_loss_s: float,
              lost_s_ago: float) -> None:
    """Connected ``connected_s_ago``; pool warm's worker beat ready ``beat_before_loss_s``
    before NATS went away ``lost_s_ago`` (and has been silent since)."""
    now = time.monotonic()
    gateway._status_since = now - connected_s_ago
    clock = Clock()
    clock.now = now - lost_s_ago - beat_before_loss_s
    gateway.health.clock = clock
    gateway.health.observe(beat("w1", pool="warm"))
    clock.now = now
    gateway.link.disconnected_at = now - lost_s_ago


def test_before_the_reconnect_hook_a_warm_pool_waits_the_reconnect_grace(
        gateway: GatewayApp) -> None:
    lost_nats(gateway, connected_s_ago=60, beat_before_loss_s=0.5, lost_s_ago=4)
    assert not gateway.health.has_capacity("warm")  # its beat is 4.5 s old
    assert RECONNECT_GRACE_S - 0.5 < gateway._grace_left_s("warm") <= RECONNECT_GRACE_S
    cold = gateway._grace_left_s("cold")  # no worker: the heartbeat timeout, from now
    assert HEARTBEAT_TIMEOUT_S - 0.5 < cold <= HEARTBEAT_TIMEOUT_S


def test_after_the_reconnect_hook_the_grace_runs_from_the_reconnect(
        gateway: GatewayApp) -> None:
    lost_nats(gateway, connected_s_ago=60, beat_before_loss_s=0.5, lost_s_ago=8)
    gateway._status_since = time.monotonic() - 4  # the hook ran 4 s after the loss
    assert RECONNECT_GRACE_S - 4.5 < gateway._grace_left_s("warm") <= RECONNECT_GRACE_S - 4
    assert gateway._grace_left_s("cold") < 0  # 3 s from the reconnect: spent, 202 at once


def test_a_pool_silent_before_the_loss_was_not_warm(gateway: GatewayApp) -> None:
    lost_nats(gateway, connected_s_ago=60, beat_before_loss_s=HEARTBEAT_TIMEOUT_S + 1,
              lost_s_ago=1)
    assert not gateway.health.was_healthy_at("warm", gateway.link.disconnected_at or 0)
    assert gateway._grace_left_s("warm") <= HEARTBEAT_TIMEOUT_S


def test_before_any_loss_the_startup_grace_runs_from_the_first_connect(
        gateway: GatewayApp) -> None:
    gateway._status_since = time.monotonic() - 1.0
    startup = GatewaySettings().startup_grace_s
    assert startup - 1.5 < gateway._grace_left_s("warm") <= startup - 1.0
