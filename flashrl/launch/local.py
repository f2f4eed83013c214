"""The local launcher: every process on this machine, each a ``procs.Child`` (own process group, log in
the run directory, dies with the controller).

    cluster.interface = "loopback" (default): ipc:// sockets in a private folder, no keys needed
    cluster.interface = an IP of this machine / "auto": tcp://IP:port sockets, every one CURVE-secured with
        this run's keys (flashrl/wire/keys.py), torch.distributed and weight-sync stores listening on that IP
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from flashrl.launch.base import (
    Endpoint,
    LaunchError,
    Proc,
    Role,
    interface_host,
    is_loopback,
    proc_name,
    tcp_url,
)
from flashrl.procs import Child, group_alive
from flashrl.wire.keys import CurveKeys
from flashrl.wire.transport import free_port, local_address

log = logging.getLogger(__name__)

KEYS_FILE = "secrets/curve-keys.json"  # under the run directory


class LocalLauncher:
    """All processes on this machine (what `flashrl run` does without a cluster)."""

    name = "local"

    def __init__(self, run_dir: str | Path, interface: str = "loopback", *, python: str = sys.executable) -> None:
        self.run_dir = Path(run_dir)
        self.interface = interface
        self.python = python
        self.curve: CurveKeys | None = None
        self._host: str | None = None
        self._children: list[Child] = []
        self._closed = False

    @property
    def host(self) -> str:
        if self._host is None:
            self._host = interface_host(self.interface)
        return self._host

    @property
    def ipc(self) -> bool:
        """Sockets on ipc:// (cluster.interface = "loopback")."""
        return self.interface == "loopback"

    def preflight(self) -> None:
        try:
            self.host  # noqa: B018 - resolves and checks cluster.interface
        except LaunchError:
            raise
        if sys.platform != "linux":
            raise LaunchError("cluster.launcher = \"local\": needs Linux (process groups, parent-death signal)")

    async def start(self) -> None:
        if not is_loopback(self.host) and self.curve is None:
            self.curve = CurveKeys.generate(self.run_dir / KEYS_FILE)
            log.info("cluster: sockets on %s (tcp, CURVE; per-run keys in a 0600 file)", self.host)

    async def endpoint(self, role: Role, index: int) -> Endpoint:
        if self.ipc:
            addr = local_address(f"{role}{index}")  # a new socket per start: no stale replies
            return Endpoint(bind=addr, connect=addr, host="127.0.0.1")
        # the child binds this port a moment later (free_port: outside the kernel's ephemeral range, so no
        # outgoing connection takes it); another program may still take it in between: an engine then exits
        # EXIT_ADDRESS_IN_USE and is started again on a new address, a trainer rank fails loudly
        url = tcp_url(self.host, free_port(self.host))
        return Endpoint(bind=url, connect=url, host=self.host)

    def child_env(self) -> dict[str, str]:
        """Variables every child gets from the launcher: the CURVE key file's path, when there are keys."""
        return self.curve.env() if self.curve is not None else {}

    async def spawn(self, role: Role, index: int, argv: list[str], env: dict[str, str], log_path: Path | None) -> Proc:
        if self._closed:
            raise LaunchError(f"cluster: the local launcher is closed; cannot start {proc_name(role, index)}")
        cmd = [self.python if argv[0] == "python" else argv[0], *argv[1:]]
        full = dict(os.environ)
        full.update(env)
        full.update(self.child_env())
        child = Child.spawn(proc_name(role, index), cmd, log_path, env=full)
        self._children = [c for c in self._children if c.alive or group_alive(c.pid)]
        self._children.append(child)
        return child

    def trainer_master(self) -> str:
        return self.host

    async def trainer_port(self) -> int:
        return free_port(self.host)

    async def close(self) -> None:
        """Stop whatever is still running (owners stop theirs first, orderly); remove the key file."""
        self._closed = True
        await asyncio.gather(*(c.stop(5.0) for c in self._children), return_exceptions=True)
        self._children = [c for c in self._children if group_alive(c.pid)]
        if self.curve is not None:
            self.curve.remove()

    def leftovers(self) -> dict[str, int]:
        return {"processes": sum(1 for c in self._children if c.alive or group_alive(c.pid))}
