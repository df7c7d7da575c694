"""When a work item's first in_progress() is due: counted from its store time in the stream,
never later than a full interval from now (a worker clock behind the server's)."""

from __future__ import annotations

from nats.aio.msg import Msg

from heron.worker.consumer import first_beat_s

STORED_NS = 1_800_000_000 * 10**9  # the stream's store time (unix ns)


def delivery(reply: str = f"$JS.ACK.HERON_WORK_p.workers_p.1.7.7.{STORED_NS}.0") -> Msg:
    return Msg(_client=None, subject="heron.work.p", reply=reply)  # type: ignore[arg-type]


def test_the_first_beat_counts_from_the_store_time() -> None:
    stored = STORED_NS / 1e9
    assert first_beat_s(delivery(), 2.5, now=stored) == 2.5  # delivered at once
    assert abs(first_beat_s(delivery(), 2.5, now=stored + 1.0) - 1.5) < 1e-6
    assert first_beat_s(delivery(), 2.5, now=stored + 4.0) == 0.0  # waited: beat at once


def test_a_clock_behind_the_servers_never_delays_the_first_beat() -> None:
    assert first_beat_s(delivery(), 2.5, now=STORED_NS / 1e9 - 30.0) == 2.5


def test_a_message_without_jetstream_metadata_beats_after_the_interval() -> None:
    assert first_beat_s(delivery(reply="_INBOX.plain"), 2.5) == 2.5
