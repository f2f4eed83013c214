"""One process on a Ray node: the actor that holds it (``ProcActor``) and the controller's handle (``RayProc``).

    controller                                   the node
      RayProc ---- spawn(SpawnSpec) ----------->  ProcActor (async actor; its event-loop thread forks)
                                                    procs.Child.spawn: own process group, output to the
                                                    log file, FLASHRL_PARENT_PID = this actor's worker
      RayProc.alive  <-- wait_exit(): ExitReport   exit code + the log's last lines, once it exits
      stop / kill / reap_group ---------------->    SIGTERM / SIGKILL the group, wait until it is empty

When the actor's worker process dies (killed by the launcher, by Ray when the driver dies, with its node),
the child's parent-death signal and watchdog (procs.child_init) SIGKILL the child's whole group.
Payloads between the two are msgspec-encoded bytes (Ray carries them; flashrl pickles nothing of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import ray

from flashrl.launch.base import CachedExit
from flashrl.procs import Child, exit_text, exited_within, group_alive, stop_ladder, tail
from flashrl.wire.transport import free_port

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0  # one control call to an actor (spawn, stop, a free port)


# --------------------------------------------------------------------------- wire (driver <-> actor)
class SpawnSpec(msgspec.Struct, frozen=True):
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: str
    cwd: str
    run_dir: str
    gpu_local_rank: bool = False  # trainer rank: LOCAL_RANK = 0 when Ray assigned this actor GPUs


class Where(msgspec.Struct, frozen=True):
    node_id: str
    ip: str
    actor_pid: int
    gpus: list[str]


class ExitReport(msgspec.Struct, frozen=True):
    code: int
    tail: str


# --------------------------------------------------------------------------- the actor (runs on a node)
class ProcActor:
    """Holds one process on its node. An async actor: every method runs on the actor's one event-loop
    thread, which also forked the child (the parent-death signal follows the forking thread)."""

    def __init__(self) -> None:
        self.child: Child | None = None

    async def where(self) -> bytes:
        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ray.get_gpu_ids()]
        return msgspec.msgpack.encode(Where(ctx.get_node_id(), ray.util.get_node_ip_address(), os.getpid(), gpus))

    async def free_port(self, host: str) -> int:
        return free_port(host)  # outside the node's ephemeral range (flashrl.wire.transport.free_port)

    async def spawn(self, spec_bytes: bytes) -> int:
        spec = msgspec.msgpack.decode(spec_bytes, type=SpawnSpec)
        if self.child is not None:
            raise RuntimeError(f"{spec.name}: this actor already ran {self.child.name}")
        self.child = _start_child(spec, [str(g) for g in ray.get_gpu_ids()])
        return self.child.pid

    async def wait_exit(self) -> bytes:
        assert self.child is not None
        code = await self.child.exited()
        await self.child.reap_group()
        return msgspec.msgpack.encode(ExitReport(code, self.child.log_tail(60)))

    async def stop(self, term_s: float, kill_s: float) -> int | None:
        """SIGTERM the group, then SIGKILL; returns once the group is empty."""
        if self.child is None:
            return None
        return await self.child.stop(0.0, None, term_s, kill_s)

    async def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    async def reap(self, timeout: float) -> bool:
        if self.child is None:
            return True
        return await self.child.reap_group(timeout)

    async def pgid(self) -> int:
        return self.child.pid if self.child is not None else 0


def _start_child(spec: SpawnSpec, gpus: list[str]) -> Child:
    """On the actor's node, from its event-loop thread: the child in its own process group, the actor as
    its parent (FLASHRL_PARENT_PID), env = the node's environment + the run's extras."""
    if not os.path.isdir(spec.run_dir):
        raise RuntimeError(
            f"{spec.name}: the run directory {spec.run_dir} is not visible on node {ray.util.get_node_ip_address()}; "
            "the Ray launcher needs the run directory and the model on a filesystem every node mounts at the same path")
    env = dict(os.environ)
    env.update(spec.env)
    if gpus:  # Ray's assignment wins over whatever the controller guessed
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        if spec.gpu_local_rank:
            env["LOCAL_RANK"] = "0"  # the rank sees only its own GPU(s): its device is cuda:0
    argv = [sys.executable if spec.argv[0] == "python" else spec.argv[0], *spec.argv[1:]]
    cwd = spec.cwd if os.path.isdir(spec.cwd) else None
    return Child.spawn(spec.name, argv, spec.log_path, env=env, cwd=cwd)


RemoteProcActor = ray.remote(ProcActor)


@ray.remote(num_cpus=0)
def groups_alive(pgids: list[int]) -> int:
    """On one node: how many of these process groups still have a process."""
    return sum(1 for g in pgids if g > 0 and group_alive(g))


# --------------------------------------------------------------------------- controller side
class RayProc(CachedExit):
    """A process a ProcActor holds, as the controller sees it (the ``Proc`` interface).

    ``alive`` / ``returncode`` are cached: a watcher task awaits the actor's ``wait_exit``. An actor that
    dies (its node lost, killed) counts as the process killed (-9), with Ray's reason as the log tail.
    """

    def __init__(self, name: str, actor: Any, log_path: Path, where: Where, pid: int) -> None:
        self.name = name
        self.actor = actor
        self.log_path: Path | None = log_path
        self.node_id = where.node_id
        self.node_ip = where.ip
        self.pid = pid
        self.spawned_at = time.monotonic()
        self._code: int | None = None
        self._tail = ""
        self._stopped = False
        self._watch = asyncio.get_running_loop().create_task(self._watch_exit(), name=f"ray exit {name}")

    async def _watch_exit(self) -> None:
        try:
            report = msgspec.msgpack.decode(await self.actor.wait_exit.remote(), type=ExitReport)
            self._tail = report.tail
            self._code = report.code
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as e:
            self._tail = f"(the Ray actor holding it is gone: {type(e).__name__}: {str(e)[:500]})"
            self._code = -signal.SIGKILL

    async def exited(self) -> int:
        await asyncio.shield(self._watch)
        assert self._code is not None
        return self._code

    async def wait(self, timeout: float) -> bool:
        return await exited_within(self, timeout)

    async def stop(self, grace_s: float = 10.0, shutdown: Callable[[], Awaitable[Any]] | None = None,
                   term_s: float = 5.0, kill_s: float = 5.0) -> int | None:
        """Shutdown (orderly, from the controller) -> wait ``grace_s`` -> the actor's SIGTERM -> SIGKILL
        (procs.stop_ladder)."""

        async def escalate() -> None:
            log.warning("%s (pid %d on %s) still running; SIGTERM, then SIGKILL, to its group", self.name,
                        self.pid, self.node_ip)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(term_s + kill_s + CALL_TIMEOUT_S):
                    await self.actor.stop.remote(term_s, kill_s)

        asked_before, self._stopped = self._stopped, True
        await stop_ladder(self, grace_s, None if asked_before else shutdown, escalate)
        await self.reap_group(kill_s)
        await self.wait(kill_s + CALL_TIMEOUT_S)
        return self.returncode

    def kill(self) -> None:
        self.actor.kill.remote()  # fire and forget; the watcher sees the exit

    async def reap_group(self, timeout: float = 5.0) -> bool:
        try:
            async with asyncio.timeout(timeout + CALL_TIMEOUT_S):
                return bool(await self.actor.reap.remote(timeout))
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError):
            return True  # the actor is gone; its child group went with it (parent-death signal)
        except TimeoutError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is not None and self.log_path.exists():
            return tail(self.log_path, lines)
        if self._tail:
            return "\n".join(self._tail.splitlines()[-lines:])
        return f"(log {self.log_path} is on node {self.node_ip}; not readable from the controller)"

    def describe(self, lines: int = 30) -> str:
        return (f"{self.name} {exit_text(self.returncode)} (pid {self.pid} on node {self.node_ip}); "
                f"last lines of {self.log_path}:\n{self.log_tail(lines)}")
