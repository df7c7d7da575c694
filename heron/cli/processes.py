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
uvicorn's: only where the sockets come from changes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket

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


class ReusePortMultiprocess(Multiprocess):
    """uvicorn's supervisor, where every process it starts (at start-up, or to replace
    one that died) gets a new socket of its own."""

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


def run_processes(config: uvicorn.Config) -> None:
    """What ``uvicorn.run`` does for ``workers > 1``, with a socket per process. Port 0
    (any free port) cannot be shared that way: uvicorn's shared socket then."""
    shared = config.port == 0 or config.uds or config.fd is not None
    if not shared:
        check_port_free(config.host, config.port)
        log.info("listening on http://%s:%d, a socket per process (press CTRL+C to quit)",
                 config.host, config.port)
    supervisor = (Multiprocess(config, sockets=[config.bind_socket()]) if shared
                  else ReusePortMultiprocess(config))
    with contextlib.suppress(KeyboardInterrupt):
        supervisor.run()
