"""The worker's memory of gone gateways (heron.worker.gateway_inboxes): a gateway inbox is
remembered for a while and within a bound, asked again now and then, and each gateway
process has an inbox of its own. How deliveries and items use it runs against a real
nats-server in tests/integration/test_consumer_fetch.py."""

from __future__ import annotations

from heron.runtime.nats_names import inbox_of, inbox_prefix, reply_subject
from heron.worker.gateway_inboxes import GoneInboxes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_gone_inbox_is_remembered_for_a_while() -> None:
    clock = Clock()
    gone = GoneInboxes(remember_s=60.0, clock=clock)
    assert not gone.is_gone("_INBOX.heron.g.a")
    gone.mark_gone("_INBOX.heron.g.a")
    clock.now += 59.9
    assert gone.is_gone("_INBOX.heron.g.a") and not gone.is_gone("_INBOX.heron.g.b")
    clock.now += 0.2
    assert not gone.is_gone("_INBOX.heron.g.a") and len(gone) == 0


def test_the_memory_is_bounded_and_forgets_a_gateway_that_answers() -> None:
    clock = Clock()
    gone = GoneInboxes(remember_s=60.0, max_entries=3, clock=clock)
    for name in "abcd":
        gone.mark_gone(name)
        clock.now += 1
    assert len(gone) == 3 and not gone.is_gone("a")  # the oldest made room
    gone.forget("c")
    assert [p for p in "abcd" if gone.is_gone(p)] == ["b", "d"]


def test_each_gateway_process_has_its_own_inbox() -> None:
    reply = reply_subject("gw-1", "key7")
    assert inbox_of(reply) == inbox_prefix("gw-1") != inbox_prefix("gw-2")
    # _INBOX.heron.<gateway id>.<this process>: a restart with the same id gets a new one.
    root, gateway, process = inbox_prefix("gw-1").rsplit(".", 2)
    assert (root, gateway) == ("_INBOX.heron", "gw-1") and len(process) == 8


def test_a_gone_inbox_is_asked_again_every_few_seconds() -> None:
    clock = Clock()
    gone = GoneInboxes(remember_s=60.0, probe_every_s=2.0, clock=clock)
    assert not gone.probe_due("p")  # not gone: nothing to ask
    gone.mark_gone("p")
    assert not gone.probe_due("p")  # just found gone
    clock.now += 2.0
    assert gone.probe_due("p") and not gone.probe_due("p")  # once per interval
    clock.now += 1.9
    assert not gone.probe_due("p")
    clock.now += 0.1
    assert gone.probe_due("p")
