"""The unit-suite rule, enforced: a unit test starts no process and opens no network socket.

`forbid(mp, report)` patches, through the given MonkeyPatch, every way this code base starts a
process or opens a socket so that the call reports itself and raises `UnitRuleError`:

- processes: `subprocess.Popen` (so `subprocess.run`, `check_output` and asyncio's
  `create_subprocess_exec`, which all build a Popen), `os.fork`, `os.forkpty`, `os.posix_spawn`,
  `os.posix_spawnp`, `os.system`, and `multiprocessing`'s `Process.start` (so process pools);
- sockets: `socket.socket` for a new AF_INET, AF_INET6 or AF_UNIX socket, ZeroMQ sockets
  (`zmq.Context.socket`, and `bind`/`connect` of one built otherwise), and torch.distributed
  process groups and TCP stores.

Allowed, on purpose: `socket.socketpair` (asyncio's event loop builds one for its self-pipe; it
wraps the pair's descriptors with `socket.socket(..., fileno=...)`, which opens nothing new), and
threads. `report` is called before raising so that a test that swallows the error is still caught.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

MESSAGE = "unit tests start no processes and open no sockets: move this test to tests/integration"


class UnitRuleError(RuntimeError):
    """A unit test tried to start a process or open a socket."""


def forbid(mp: pytest.MonkeyPatch, report: Callable[[str], None]) -> None:
    """Make every process start and socket open through `mp` call `report(what)` and raise."""

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            report(what)
            raise UnitRuleError(f"{MESSAGE} (it called {what})")

        return refused

    import multiprocessing.process
    import os
    import subprocess

    mp.setattr(subprocess.Popen, "__init__", refuse("subprocess.Popen"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            mp.setattr(os, name, refuse(f"os.{name}"))
    mp.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing Process.start"))

    real_init = socket.socket.__init__
    network = {socket.AF_INET, socket.AF_INET6, socket.AF_UNIX}

    def socket_init(self: socket.socket, family: Any = -1, type: Any = -1, proto: Any = -1,
                    fileno: Any = None) -> None:
        # fileno given: wrapping a descriptor that already exists (socketpair, fromfd), not a new socket.
        if fileno is None and (socket.AF_INET if family == -1 else family) in network:
            report(f"socket.socket({socket.AddressFamily(family if family != -1 else socket.AF_INET).name})")
            raise UnitRuleError(f"{MESSAGE} (it opened a {family!r} socket)")
        real_init(self, family, type, proto, fileno)

    mp.setattr(socket.socket, "__init__", socket_init)

    try:
        import zmq.sugar.context
        import zmq.sugar.socket
    except ImportError:  # pragma: no cover - zmq is a dependency; guard anyway
        pass
    else:
        mp.setattr(zmq.sugar.context.Context, "socket", refuse("zmq.Context.socket"))
        mp.setattr(zmq.sugar.socket.Socket, "bind", refuse("zmq Socket.bind"))
        mp.setattr(zmq.sugar.socket.Socket, "connect", refuse("zmq Socket.connect"))

    import torch.distributed as dist

    if dist.is_available():
        mp.setattr(dist, "init_process_group", refuse("torch.distributed.init_process_group"))
        mp.setattr(dist, "TCPStore", refuse("torch.distributed.TCPStore"))
