"""What ``heron up`` does when one of its children dies, without the processes: when to
start it again (``RestartBackoff``) and what to say about it (``SupervisorEvent``).

Sans-IO: the clock is injected, nothing here sleeps, spawns or publishes. The process side
is heron/cli/children.py (nats-server, the config service, the gateway) and
heron/cli/autoscaler.py (workers).

The backoff: 0.5 s after the first death, doubling on each death that follows soon after,
at most 30 s; a child that stayed up ``reset_after_s`` (a minute) starts again from
0.5 s. A child that crashes at once every time therefore costs a start every 30 s, not a
busy loop, and one that dies once a day comes back in half a second.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

Clock = Callable[[], float]

# The event names (``SupervisorEvent.event``).
EXITED = "exited"  # the child died on its own (or never came up again after a restart)
RESTARTED = "restarted"  # it was started again and answers (workers: a replacement started)


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 60.0  # up this long: the next death starts from initial_s

    def delay(self, streak: int) -> float:
        """The wait before start number ``streak`` of a run of quick deaths (1, 2, ...)."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, streak - 1))


class RestartBackoff:
    """The restart schedule of one child (or one pool of workers): ``started()`` when it
    starts, ``exited()`` when it dies (the wait before the next start), ``may_start()``
    to ask whether that wait is over. ``restarts`` counts every restart it ever had."""

    def __init__(self, policy: BackoffPolicy | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.policy = policy or BackoffPolicy()
        self.clock = clock
        self.restarts = 0
        self._streak = 0  # deaths since the child last stayed up reset_after_s
        self._started_at: float | None = None
        self._next_start_at = float("-inf")

    def started(self) -> None:
        self._started_at = self.clock()

    def exited(self) -> float:
        """A death: the seconds to wait before the next start (which counts as a restart)."""
        now = self.clock()
        if self._started_at is not None and now - self._started_at >= self.policy.reset_after_s:
            self._streak = 0
        self._started_at = None
        self._streak += 1
        self.restarts += 1
        delay = self.policy.delay(self._streak)
        self._next_start_at = now + delay
        return delay

    def may_start(self) -> bool:
        return self.clock() >= self._next_start_at

    def wait_s(self) -> float:
        """Seconds left before ``may_start()`` (0 when it may start now)."""
        return max(0.0, self._next_start_at - self.clock())


def exit_status(returncode: int | None) -> str:
    """``status 1``, ``status -9`` (killed by signal 9): the exit as ``heron up`` prints it."""
    return "still running" if returncode is None else f"status {returncode}"


@dataclass(frozen=True, slots=True)
class SupervisorEvent:
    """One death or restart, printed on the console and published on NATS
    (heron.runtime.nats_names.SUPERVISOR_EVENTS) for the gateway's cluster page."""

    child: str  # nats, nats-1, config, gateway, or a worker id
    event: str  # EXITED or RESTARTED
    status: int | None  # the exit status (negative: the signal that killed it)
    restarts: int  # restarts of this child (workers: of its pool) so far, this one included
    at: float  # unix time
    cause: str = ""  # the last lines of its log, or why it did not come up
    restart_in_s: float | None = None  # EXITED: when it starts again (None: not restarted)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    def console_line(self) -> str:
        if self.event == RESTARTED:
            return f"heron up: {self.child} restarted (restart {self.restarts})"
        line = f"heron up: {self.child} exited with {exit_status(self.status)}"
        if self.restart_in_s is not None:
            line += f"; restarting in {self.restart_in_s:.1f} s (restart {self.restarts})"
        return line


# A process killed by one of these crashed (its log may hold a trace); by another signal
# (SIGKILL from the OOM killer or a person, SIGTERM) it was stopped from outside, and its
# last log lines are whatever it was doing before: not the cause.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE,
                           signal.SIGILL})


def death_cause(status: int | None, log_tail: str) -> str:
    """What is shown as the cause of a death: the last lines of the child's log, or for
    a child killed by a signal that is no crash, which signal."""
    if status is None or status >= 0:
        return log_tail
    try:
        sig = signal.Signals(-status)
    except ValueError:
        return f"killed by signal {-status}"
    killed = f"killed by {sig.name}"
    return f"{killed}\n{log_tail}" if sig in CRASH_SIGNALS and log_tail else killed


def tail_lines(text: str, lines: int = 5, width: int = 300) -> str:
    """The last ``lines`` non-blank lines of a log excerpt, each cut to ``width``: the cause
    printed and published with a death (the full log stays in the file). A JSON log line
    (gateway, config service, workers) is shown as ``level: message``."""
    kept = [_readable(line.strip())[:width] for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _readable(line: str) -> str:
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return line
        if isinstance(record, dict) and "message" in record:
            return f"{record.get('level', 'log')}: {record['message']}"
    return line
