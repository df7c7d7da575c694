"""`heron serve --workers N`: N server processes behind one port, each with a listening
socket of its own (SO_REUSEPORT), so the kernel spreads new connections evenly.

uvicorn's own multi-process mode hands every process the same listening socket, and
whichever process wakes first accepts the connections waiting there: after an idle
moment, one process took all 64 connections of a burst in 2 bursts of 10 (and 0/64 or
1/63 in others), and the server ran at half speed for as long as those keep-alive
connections lived (bench: 144 against 287-311 requests/s). With a socket per process, the
kernel hashes each connection to one of them. libuv's ``UV_TCP_SINGLE_ACCEPT`` still
let one process take all 64 connections in 1 burst of 10.

The supervision (restarting a process that dies, signals, graceful shutdown) stays
uvicorn's, with one change: a process that dies before it ever served (a config error, a
bad import, killed while loading) stops them all and ``heron serve`` exits 1. uvicorn
stops only on its own start-up failure status and starts any other failing process again,
forever.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys

import uvicorn
from uvicorn.supervisors import Multiprocess

log = logging.getLogger("heron.serve")


def _tcp_socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT (listen() happens in the child)."""
    sock = _tcp_socket(host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def check_port_free(host: str, port: int) -> None:
    """Fail as a plain bind would when something already listens there: with
    SO_REUSEPORT, a second `heron serve` on the same port would otherwise join the first
    one's group silently and take half its connections."""
    with _tcp_socket(host) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise SystemExit(f"heron serve: {host}:{port} is already in use") from None
            raise


class StartWatchingMultiprocess(Multiprocess):
    """uvicorn's supervisor, except that a process that dies before it served (its server
    never reported started) is not started again: everything stops, ``failed_at_start``
    holds its exit status. One that served and died later is replaced, as in uvicorn."""

    READY_PING_TIMEOUT_S = 1.0  # a starting process answers pings from its own thread

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        self._served: set[int] = set()  # pids of processes that reported started
        self.failed_at_start: int | None = None
        super().__init__(config, sockets=sockets)

    def keep_subprocess_alive(self) -> None:
        if self.should_exit.is_set():
            return
        for process in self.processes:
            pid = process.pid
            if pid is None or pid in self._served:
                continue
            if process.is_ready(timeout=self.READY_PING_TIMEOUT_S):
                self._served.add(pid)
            elif not process.process.is_alive():
                process.join()
                self.failed_at_start = process.exitcode or 1
                print(f"heron serve: server process {pid} exited with status "
                      f"{process.exitcode} while starting; stopping (its log is above)",
                      file=sys.stderr, flush=True)
                self.should_exit.set()
                return
        super().keep_subprocess_alive()


class ReusePortMultiprocess(StartWatchingMultiprocess):
    """The supervisor, where every process it starts (at start-up, or to replace one that
    died) gets a new socket of its own."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._host, self._port = config.host, config.port
        self._handed: socket.socket | None = None
        super().__init__(config, sockets=[])

    @property  # type: ignore[override]
    def sockets(self) -> list[socket.socket]:
        # Read once per process started. The previous socket went to its process when
        # that process started (pickled with a duplicate of the descriptor), so the
        # parent's copy can go: a process that dies then takes its socket with it.
        if self._handed is not None:
            self._handed.close()
        self._handed = reuse_port_socket(self._host, self._port)
        return [self._handed]

    @sockets.setter
    def sockets(self, value: list[socket.socket]) -> None:
        pass  # uvicorn's __init__ stores the shared sockets here; there are none


def run_processes(config: uvicorn.Config) -> int:
    """What ``uvicorn.run`` does for ``workers > 1``, with a socket per process (port 0,
    any free port, cannot be shared that way: one shared socket then). The exit status:
    0 after Ctrl-C or SIGTERM, 1 when a process died while starting."""
    shared = config.port == 0 or config.uds or config.fd is not None
    if not shared:
        check_port_free(config.host, config.port)
        log.info("listening on http://%s:%d, a socket per process (press CTRL+C to quit)",
                 config.host, config.port)
    supervisor = (StartWatchingMultiprocess(config, sockets=[config.bind_socket()]) if shared
                  else ReusePortMultiprocess(config))
    with contextlib.suppress(KeyboardInterrupt):
        supervisor.run()
    return 0 if supervisor.failed_at_start is None else 1
