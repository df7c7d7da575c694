"""The ``heron`` command: ``serve``, ``up`` (the local cluster and its autoscaler), ``gateway``,
``worker``, ``config`` and the client commands. The top of the import graph: it starts the
services; nothing imports it back."""

from heron.cli.main import main

__all__ = ["main"]
