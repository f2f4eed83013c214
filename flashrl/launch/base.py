"""The launcher interface: what every launcher (local, Ray, SLURM) gives the run.

    launch.processes.local_cluster(cfg, ...)
      launcher = make_launcher(cfg, run_dir)      local | ray | slurm, by cfg.cluster.launcher
      launcher.preflight()                        LaunchError before anything starts
      await launcher.start()
      ep = await launcher.endpoint(role, i)       where (role, i)'s socket binds / is reached
      proc = await launcher.spawn(role, i, argv, env, log)   -> Proc (restart: spawn again)
      MASTER_ADDR = launcher.trainer_master(); ports from await launcher.trainer_port()
      ... run ...
      await launcher.close()                      nothing it started is left, on any node

A launcher places processes and reports addresses; it knows nothing of scheduling. The controller
never sees it: it gets engine clients and the trainer group, the same whichever launcher made them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from flashrl.wire.transport import is_loopback

if TYPE_CHECKING:
    from flashrl.wire.keys import CurveKeys


class LaunchError(RuntimeError):
    """What a launcher cannot do, raised BEFORE anything starts; names the resource/key and the numbers
    (e.g. 'cluster: 4 GPUs requested (engine.count=2 x 1 + trainer.ranks=2 x 1), the Ray cluster has 2')."""


Role = Literal["engine", "trainer", "env", "judge"]


def served_engines(cfg: Any) -> int:
    """Engines of the "judge" role the run starts: the judge's (judge.engines when judge.model is set), then each
    distillation teacher's (distill.teachers' engines, in order): fixed models served beside the policy."""
    return (cfg.judge.engines if cfg.judge.model else 0) + sum(t.engines for t in cfg.distill.teachers)


def proc_name(role: Role, index: int) -> str:
    """The name a process goes by in logs and error messages: "engine engine0", "trainer rank 1", "env worker 2",
    "judge engine judge0"."""
    if role == "engine":
        return f"engine engine{index}"
    if role == "judge":
        return f"judge engine judge{index}"
    if role == "trainer":
        return f"trainer rank {index}"
    return f"env worker {index}"


class CachedExit:
    """``Proc.alive`` / ``returncode`` of a remote process (Ray, SLURM): its exit code as a watcher or poll
    last saw it, in ``_code`` (None: running)."""

    _code: int | None = None

    @property
    def alive(self) -> bool:
        return self._code is None

    @property
    def returncode(self) -> int | None:
        return self._code


@runtime_checkable
class Proc(Protocol):
    """A started process, wherever it runs. ``procs.Child`` (local) satisfies it."""

    name: str
    log_path: Path | None
    spawned_at: float  # time.monotonic() on the controller when spawn() returned

    @property
    def alive(self) -> bool: ...  # sync and cheap (remote launchers keep it cached)

    @property
    def returncode(self) -> int | None: ...

    async def exited(self) -> int: ...  # waits until the process exits; its code

    async def stop(self, grace_s: float = 10.0, shutdown: Callable[[], Awaitable[Any]] | None = None) -> int | None:
        """Optional orderly ``shutdown`` coroutine, then SIGTERM, then SIGKILL to the whole process tree."""
        ...

    def kill(self) -> None: ...  # SIGKILL the process tree now (remote: fire and forget)

    async def reap_group(self, timeout: float = 5.0) -> bool: ...

    def log_tail(self, lines: int = 40) -> str: ...

    def describe(self, lines: int = 30) -> str: ...  # "engine engine1 exited with code -9; log X: <tail>"


@dataclass(frozen=True)
class Endpoint:
    """Where a served socket binds, and how the controller reaches it."""

    bind: str  # what the served socket binds, e.g. "ipc:///tmp/..", "tcp://0.0.0.0:41234"
    connect: str  # what the controller connects to, e.g. "tcp://10.0.0.7:41234"
    host: str  # the node's address as other nodes reach it ("127.0.0.1" locally)


class Launcher(Protocol):
    name: str  # "local" | "ray" | "slurm"
    curve: CurveKeys | None  # per-run keys when any socket is off loopback (flashrl/wire/keys.py)

    def preflight(self) -> None: ...  # LaunchError before anything starts

    async def start(self) -> None: ...  # ray: connect + placement groups; local: keys only

    async def endpoint(self, role: Role, index: int) -> Endpoint:
        """A free address on the node where (role, index) runs / will run."""
        ...

    async def spawn(self, role: Role, index: int, argv: list[str], env: dict[str, str], log_path: Path) -> Proc:
        """Start argv (argv[0] "python" = the node's flashrl python) with ``env`` (extra variables only,
        merged over the node's environment). Restart = spawn again with the same (role, index)."""
        ...

    def trainer_master(self) -> str: ...  # host of trainer rank 0 (MASTER_ADDR, weight-sync store master)

    async def trainer_port(self) -> int: ...  # a TCP port free now on trainer rank 0's node

    async def close(self) -> None: ...  # everything this launcher started is gone (also PGs/actors)

    def leftovers(self) -> dict[str, int]: ...  # for tests: what is still alive (processes, actors, PGs, steps)


# --------------------------------------------------------------------------- addresses
def primary_address() -> str:
    """This node's primary (non-loopback) address: the source address of its default route, else the first
    non-loopback address its hostname resolves to. LaunchError when it has none."""
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent; the kernel picks the route's source address
        addr = s.getsockname()[0]
        if addr and not is_loopback(addr) and addr != "0.0.0.0":
            return str(addr)
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addr = str(info[4][0])
            if not is_loopback(addr):
                return addr
    raise LaunchError("cluster.interface = \"auto\": this node has no non-loopback IPv4 address; "
                      "set cluster.interface to an address of this node, or \"loopback\"")


def interface_host(interface: str) -> str:
    """cluster.interface -> the host address sockets bind to: "loopback" -> 127.0.0.1, "auto" -> this node's
    primary address, an IP -> itself (checked: it must be an address of this node)."""
    import socket

    if interface == "loopback":
        return "127.0.0.1"
    host = primary_address() if interface == "auto" else interface
    if host in ("0.0.0.0", "::"):
        raise LaunchError(f"cluster.interface = {interface!r} is every interface, not one address; name this "
                          "node's address (e.g. from `hostname -I`), \"auto\", or \"loopback\"")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        raise LaunchError(f"cluster.interface = {interface!r}: cannot bind {host} on this node ({e.strerror}); "
                          "use one of its addresses (`hostname -I`), \"auto\", or \"loopback\"") from None
    return host


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
