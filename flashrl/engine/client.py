"""Controller side of an engine process: spawn it, wait for it, talk to it, stop it.

    launch.processes.EnginePool: launcher.spawn("engine", i, ENGINE_ARGV, engine_extra_env(opts)) -> EngineProcess
                       (the EngineSpec travels in the environment: FLASHRL_SPEC, flashrl/wire/spec.py)
    spawn_engine(opts) -> EngineProcess ------ procs.Child (python -m flashrl.engine.server, own process group;
                                               the standalone local helper of tests and benches)
        wait_ready(): one Ping in flight, raced against the process's exit, until Pong, exit, or deadline
        terminate():  procs.Child.stop: Shutdown -> wait -> SIGTERM to the group -> wait -> SIGKILL

    EngineProcessClient (interfaces.EngineClient) ---- RpcClient (DEALER) ----> engine's RpcServer
        generate/abort/update_weights/load/...: one request each, multiplexed on one socket
        heartbeat loop (RpcClient): Ping every heartbeat_s; no Pong in time -> PeerDead for all

The process group matters: vLLM runs in the engine process itself (engine/inproc.py), but anything it
or a plugin starts is a child, and killing only the parent would orphan it on a shared machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from flashrl.engine.server import EngineSpec
from flashrl.launch.base import Proc
from flashrl.procs import Child
from flashrl.wire.protocol import (
    ENGINE_REPLIES,
    Abort,
    Generate,
    Generated,
    GetLoad,
    InitWeightSync,
    LoadReport,
    Msg,
    Ok,
    Pause,
    Ping,
    Pong,
    Resume,
    Score,
    Scored,
    Shutdown,
    UpdateWeights,
    WeightManifest,
    WeightsUpdated,
)
from flashrl.wire.spec import spec_env
from flashrl.wire.transport import PeerDead, RpcClient, TransportError

log = logging.getLogger(__name__)


def _expect(reply: Msg, kind: type[Msg], name: str) -> None:
    if not isinstance(reply, kind):
        raise TransportError(f"{name} answered {type(reply).__name__} where {kind.__name__} was expected")


class EngineProcessClient:
    """One engine process as the controller sees it (implements interfaces.EngineClient)."""

    def __init__(
        self,
        name: str,
        address: str,
        *,
        heartbeat_s: float = 5.0,
        heartbeat_timeout_s: float = 30.0,
        curve: dict[str, bytes] | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self._rpc = RpcClient(address, ENGINE_REPLIES, name=name, curve=curve)
        self._heartbeat = (heartbeat_s, heartbeat_timeout_s)
        self._started = False
        self._inflight = 0

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def dead(self) -> PeerDead | None:
        return self._rpc.dead

    def fail(self, err: PeerDead) -> None:
        """The engine process is gone: fail every pending and later request with ``err`` now."""
        self._rpc.fail(err)

    async def _request(self, msg: Msg, timeout: float | None = None) -> Msg:
        if not self._started:
            self._rpc.start(*self._heartbeat)
            self._started = True
        return await self._rpc.request(msg, timeout=timeout)

    async def generate(self, req: Generate) -> Generated:
        self._inflight += 1
        try:
            reply = await self._request(req)
        finally:
            self._inflight -= 1
        _expect(reply, Generated, self.name)
        assert isinstance(reply, Generated)
        return reply

    async def score(self, req: Score) -> Scored:
        """A distillation teacher's scores of one token sequence (flashrl/distill)."""
        self._inflight += 1
        try:
            reply = await self._request(req)
        finally:
            self._inflight -= 1
        _expect(reply, Scored, self.name)
        assert isinstance(reply, Scored)
        return reply

    async def abort(self, request_ids: list[str]) -> None:
        _expect(await self._request(Abort(request_ids=list(request_ids))), Ok, self.name)

    async def pause(self, mode: str = "keep") -> None:
        _expect(await self._request(Pause(mode=mode)), Ok, self.name)  # type: ignore[arg-type]

    async def resume(self) -> None:
        _expect(await self._request(Resume()), Ok, self.name)

    async def init_weight_sync(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        """Join the weight-sync group as ``rank`` (1 + engine index); returns once every member joined."""
        msg = InitWeightSync(master_addr=master_addr, master_port=master_port, rank=rank, world_size=world_size,
                             backend=backend, timeout_s=timeout_s)  # type: ignore[arg-type]
        _expect(await self._request(msg), Ok, self.name)

    async def update_weights(self, manifest: WeightManifest) -> WeightsUpdated:
        reply = await self._request(UpdateWeights(manifest=manifest))
        _expect(reply, WeightsUpdated, self.name)
        assert isinstance(reply, WeightsUpdated)
        return reply

    async def load(self) -> LoadReport:
        reply = await self._request(GetLoad())
        _expect(reply, LoadReport, self.name)
        assert isinstance(reply, LoadReport)
        return reply

    async def ping(self, timeout: float | None = None) -> int:
        """The engine's weight version; raises TimeoutError, PeerDead."""
        reply = await self._request(Ping(), timeout=timeout)
        _expect(reply, Pong, self.name)
        assert isinstance(reply, Pong)
        return reply.version

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine process to exit (it answers first)."""
        _expect(await self._request(Shutdown(), timeout=timeout), Ok, self.name)

    async def close(self) -> None:
        await self._rpc.close()


class EngineProcess:
    """A spawned engine process: a launcher's ``Proc`` (locally a ``procs.Child``: its own process group, so
    vLLM's children go with it). ``connect``: the address the controller dials (default: ``opts.address``,
    the one the engine binds); ``curve``: the controller's CURVE keys (wire.keys.CurveKeys.client())."""

    def __init__(self, opts: EngineSpec, child: Proc, heartbeat_s: float = 5.0, *, connect: str | None = None,
                 curve: dict[str, bytes] | None = None) -> None:
        self.opts = opts
        self.child = child
        self.heartbeat_s = heartbeat_s
        self.connect = connect or opts.address
        self.curve = curve
        self.ready_s: float | None = None
        self._client: EngineProcessClient | None = None

    @property
    def name(self) -> str:
        return self.opts.name

    @property
    def address(self) -> str:
        """Where the controller reaches this engine."""
        return self.connect

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The local process (local launcher only: tests signal it)."""
        if not isinstance(self.child, Child):
            raise AttributeError(f"{self.name} runs under a remote launcher: no local process")
        return self.child.proc

    @property
    def log_path(self) -> Path:
        assert self.child.log_path is not None
        return self.child.log_path

    @property
    def alive(self) -> bool:
        return self.child.alive

    def log_tail(self, lines: int = 40) -> str:
        return self.child.log_tail(lines)

    @property
    def client(self) -> EngineProcessClient:
        """The controller's client for this engine (one, with the heartbeat on); closed by terminate()."""
        if self._client is None:
            self._client = self.new_client(self.heartbeat_s, heartbeat_timeout_s=max(30.0, 6 * self.heartbeat_s))
        return self._client

    def new_client(self, heartbeat_s: float = 0.0, heartbeat_timeout_s: float = 30.0) -> EngineProcessClient:
        """A separate client (its own socket); the caller closes it."""
        return EngineProcessClient(self.name, self.address, heartbeat_s=heartbeat_s, heartbeat_timeout_s=heartbeat_timeout_s,
                                   curve=self.curve)

    async def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait until the engine answers Ping; return the seconds since spawn.

        Fails fast, with the log's tail, if the process exits first; raises TimeoutError after
        ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        probe = self.new_client()
        # One Ping, queued in the engine's socket until it serves (it binds at once, serves only once vLLM is up).
        ping = loop.create_task(probe.ping())
        exited = loop.create_task(self.child.exited())
        try:
            done, _ = await asyncio.wait({ping, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if ping in done:
                ping.result()
            elif exited in done:
                raise RuntimeError(f"{self.child.describe()}\n(engine {self.name} stopped before it was ready)")
            else:
                raise TimeoutError(
                    f"engine {self.name} not ready after {timeout:.0f}s (raise engine.startup_timeout_s "
                    f"if the machine is slow); log {self.log_path}:\n{self.log_tail()}"
                )
        finally:
            for t in (ping, exited):
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
            await probe.close()
        self.ready_s = time.monotonic() - self.child.spawned_at
        return self.ready_s

    async def terminate(self, timeout: float = 10.0) -> int | None:
        """Stop the engine: Shutdown, then SIGTERM, then SIGKILL to its process group; no orphans."""
        if self._client is not None:
            await self._client.close()

        async def shutdown() -> None:
            probe = self.new_client()
            try:
                await probe.shutdown(timeout=min(timeout, 5.0))
            finally:
                await probe.close()

        return await self.child.stop(timeout, shutdown=shutdown)

    def kill(self) -> None:
        """SIGKILL the engine's whole process group now."""
        self.child.kill()

    async def discard(self) -> None:
        """A dead or hung engine: close its client, SIGKILL its group, wait until the group is empty."""
        if self._client is not None:
            await self._client.close()
        self.child.kill()
        await self.child.stop()


def engine_env(opts: EngineSpec, env_extra: dict[str, str] | None = None) -> dict[str, str]:
    """This machine's environment with ``engine_extra_env`` over it (see there)."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(engine_extra_env(opts, env_extra))
    return env


def engine_extra_env(opts: EngineSpec, env_extra: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: its spec (``FLASHRL_SPEC``), thread counts and binding sized for a small
    shared CPU box.

    - ``OMP_NUM_THREADS`` = opts.threads: torch's intra-op pool for the model.
    - ``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM's default ("auto") pins OpenMP threads to the
      cores of the first NUMA node after reserving one for its scheduler; on a 2-core machine every
      engine would pin to the same single core while the trainer and the other engines compete for
      it. Unpinned threads let the OS spread engines and trainer. Override through ``env_extra``
      (e.g. "0|1" style lists) on a machine with cores to spare.
    - ``VLLM_CPU_KVCACHE_SPACE`` is dropped by the engine process itself (server.serve): it is whole GiB
      and would override kv_cache_gib.

    The variables only (a launcher merges them over the node's environment).
    """
    env = spec_env(opts)
    if opts.device == "cpu":
        env["OMP_NUM_THREADS"] = str(opts.threads)
        env["MKL_NUM_THREADS"] = str(opts.threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(env_extra or {})
    return env


ENGINE_ARGV = ["python", "-m", "flashrl.engine.server"]  # for ``Launcher.spawn`` ("python" = the node's flashrl python)


def spawn_engine(
    opts: EngineSpec, log_path: str | Path, env_extra: dict[str, str] | None = None, *, heartbeat_s: float = 5.0
) -> EngineProcess:
    """Start ``python -m flashrl.engine.server`` in its own process group, output to ``log_path``.

    ``heartbeat_s`` is the Ping interval of ``EngineProcess.client`` (0 = off).
    """
    cmd = [sys.executable, *ENGINE_ARGV[1:]]
    child = Child.spawn(f"engine {opts.name}", cmd, log_path, env=engine_env(opts, env_extra))
    log.info("engine %s on %s", opts.name, opts.address)
    return EngineProcess(opts, child, heartbeat_s)
