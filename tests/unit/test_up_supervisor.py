"""What `heron up` does when a child dies, without processes: the restart backoff (an
injected clock), the events it prints and publishes, and the gateway's keeping of them for
the cluster page."""

from __future__ import annotations

import json
import signal

import pytest

from heron.cli.supervisor import (
    EXITED,
    RESTARTED,
    BackoffPolicy,
    RestartBackoff,
    SupervisorEvent,
    death_cause,
    tail_lines,
)
from heron.gateway.status_page import SUPERVISOR_EVENTS_KEPT, SupervisorEventLog
from tests.support.beats import Clock


def test_quick_deaths_double_the_wait_up_to_the_cap() -> None:
    clock = Clock()
    backoff = RestartBackoff(BackoffPolicy(initial_s=0.5, max_s=30, reset_after_s=60), clock)
    backoff.started()
    waits = []
    for _ in range(9):
        clock.now += 1.0  # dies a second after each start
        waits.append(backoff.exited())
        assert not backoff.may_start()
        clock.now += waits[-1]
        assert backoff.may_start() and backoff.wait_s() == 0
        backoff.started()
    assert waits == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.restarts == 9


def test_a_child_that_stayed_up_a_minute_starts_again_from_the_first_wait() -> None:
    clock = Clock()
    backoff = RestartBackoff(BackoffPolicy(), clock)
    backoff.started()
    for _ in range(4):
        backoff.exited()
        backoff.started()
    assert backoff.exited() == 8.0
    backoff.started()
    clock.now += 59.0
    assert backoff.exited() == 16.0  # up 59 s: still the same run of deaths
    backoff.started()
    clock.now += 60.0
    assert backoff.exited() == 0.5  # up a minute: forgiven
    assert backoff.restarts == 7
    clock.now += 0.2
    assert not backoff.may_start() and backoff.wait_s() == pytest.approx(0.3)


def test_events_print_as_heron_up_says_them_and_travel_as_json() -> None:
    exited = SupervisorEvent("gateway", EXITED, -9, 1, 1700000000.0, "killed by SIGKILL",
                             restart_in_s=1.0)
    assert exited.console_line() == \
        "heron up: gateway exited with status -9; restarting in 1.0 s (restart 1)"
    assert json.loads(exited.to_json()) == {
        "child": "gateway", "event": "exited", "status": -9, "restarts": 1,
        "at": 1700000000.0, "cause": "killed by SIGKILL", "restart_in_s": 1.0}
    gone = SupervisorEvent("worker default-1", EXITED, 1, 1, 1700000000.0)
    assert gone.console_line() == "heron up: worker default-1 exited with status 1"
    back = SupervisorEvent("gateway", RESTARTED, None, 1, 1700000001.0)
    assert back.console_line() == "heron up: gateway restarted (restart 1)"


def test_the_cause_is_the_log_unless_the_child_was_killed_from_outside() -> None:
    log = 'noise\n{"level": "error", "message": "address already in use"}\n\n'
    assert tail_lines(log) == "noise\nerror: address already in use"
    assert tail_lines("\n".join(str(i) for i in range(20)), lines=3) == "17\n18\n19"
    assert death_cause(1, "error: bad") == "error: bad"
    assert death_cause(-signal.SIGKILL, "started fine") == "killed by SIGKILL"
    assert death_cause(-signal.SIGSEGV, "Fatal Python error") == \
        "killed by SIGSEGV\nFatal Python error"
    assert death_cause(-77, "") == "killed by signal 77"


def test_the_gateway_keeps_the_last_events_once_each_newest_first() -> None:
    events = SupervisorEventLog()
    for i in range(SUPERVISOR_EVENTS_KEPT + 5):
        event = SupervisorEvent(f"worker w-{i}", EXITED, -9, i, 1000.0 + i, "x" * 5000, 0.5)
        assert events.add(event.to_json())
    assert not events.add(event.to_json())  # published again after a restart: kept once
    recent = events.recent()
    assert len(recent) == SUPERVISOR_EVENTS_KEPT
    assert recent[0]["child"] == f"worker w-{SUPERVISOR_EVENTS_KEPT + 4}"
    assert [e["at"] for e in recent] == sorted((e["at"] for e in recent), reverse=True)
    assert len(recent[0]["cause"]) == 1000  # the end of a long cause


@pytest.mark.parametrize("data", [
    b"not json", b"[]", b'{"child": "", "event": "exited", "at": 1}',
    b'{"child": "gateway", "event": "exited", "at": "noon"}',
    b'{"child": "gateway", "event": "exited", "at": 1, "status": 1.5}',
    b'{"child": "gateway", "event": "exited", "at": 1, "restarts": true}',
    b'{"child": "gateway", "event": "exited", "at": 1, "restart_in_s": NaN}',
    b'{"child": "gateway", "event": "exited", "at": Infinity}',
    b"\xff\xfe",
])
def test_a_malformed_event_is_not_shown(data: bytes) -> None:
    events = SupervisorEventLog()
    assert not events.add(data)
    assert events.recent() == []
