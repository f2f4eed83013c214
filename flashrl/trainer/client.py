"""The controller's handle on the trainer group: R rank processes, one ZeroMQ channel to rank 0.

    TrainerGroup.spawn --subprocess x R (own session each; env as torchrun sets it)--> worker.py ranks
                        stdout+stderr -> <run_dir>/logs/trainer<rank>.log
    train_step / prepare_weights / ... --RpcClient--> rank 0 (fans out to the others)
         each call races its reply against the rank processes: a rank that exits fails the call at
         once with TrainerDied (and the tail of its log) instead of leaving it waiting forever
    close(): Shutdown request -> wait -> SIGTERM each rank's process group -> wait -> SIGKILL

``TrainerGroup`` implements ``flashrl.interfaces.TrainerClient``. A finalizer SIGKILLs every rank's
process group if the object is dropped without ``close()`` (a half-built group leaves no orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from typing import IO

from flashrl import protocol
from flashrl.config import Config
from flashrl.protocol import (
    ComputeLogprobs,
    InitWeightSync,
    Logprobs,
    Msg,
    Ping,
    Pong,
    PrepareWeights,
    SaveCheckpoint,
    SendWeights,
    Shutdown,
    TrainBatch,
    TrainResult,
    TrainStep,
    WeightManifest,
)
from flashrl.transport import PeerDead, RpcClient, free_port, local_address

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a waiting call checks that every rank is still alive


class TrainerDied(PeerDead):
    """A trainer rank process exited; the message carries its exit code and the tail of its log."""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _signal_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # each rank leads its own session: this reaches its children too


class TrainerGroup:
    """R trainer ranks as one ``TrainerClient``. Build with ``spawn``; then ``await wait_ready()``."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], logs: list[Path], address: str, cfg: Config) -> None:
        self.procs = procs
        self.logs = logs
        self.address = address
        self.cfg = cfg
        self.version = 0
        self._rpc: RpcClient | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _signal_groups, [p.pid for p in procs], signal.SIGKILL)

    @classmethod
    def spawn(cls, cfg: Config, model_path: str | Path, run_dir: str | Path, config_path: str | Path,
              *, resume: str | Path | None = None, python: str = sys.executable) -> TrainerGroup:
        """Start ``cfg.trainer.ranks`` worker processes on this machine (what torchrun would do)."""
        run_dir = Path(run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        world = cfg.trainer.ranks
        address = local_address("trainer")
        master_port = free_port()
        cmd = [python, "-m", "flashrl.trainer.worker", "--config", str(config_path), "--address", address,
               "--model", str(model_path)]
        if resume is not None:
            cmd += ["--resume", str(resume)]
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        try:
            for rank in range(world):
                env = dict(os.environ)
                env.update({
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                    "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                    "OMP_NUM_THREADS": str(cfg.trainer.threads),
                })
                path = run_dir / "logs" / f"trainer{rank}.log"
                out: IO[bytes] = open(path, "ab")  # noqa: SIM115 - the child owns it from here
                try:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True))
                finally:
                    out.close()
                logs.append(path)
        except BaseException:
            _signal_groups([p.pid for p in procs], signal.SIGKILL)
            raise
        log.info("trainer group: %d rank(s), rank 0 at %s, logs %s", world, address, run_dir / "logs")
        return cls(procs, logs, address, cfg)

    # ------------------------------------------------------------------ liveness
    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                raise TrainerDied(f"trainer rank {rank} exited with code {code}; last lines of "
                                  f"{self.logs[rank]}:\n{_tail(self.logs[rank])}")

    def _client(self) -> RpcClient:
        if self._closed:
            raise PeerDead("trainer group is closed")
        if self._rpc is None:
            self._rpc = RpcClient(self.address, protocol.TRAINER_REPLIES, name="trainer")
        return self._rpc

    async def _call(self, msg: Msg, timeout: float | None = None) -> Msg:
        """One request to rank 0, failing fast (TrainerDied) if any rank exits while it waits."""
        self._check_alive()
        task = asyncio.ensure_future(self._client().request(msg, timeout=timeout))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL_S)
                if done:
                    return task.result()
                self._check_alive()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until rank 0 answers a Ping (every rank has loaded the model by then).

        One Ping only: ZeroMQ queues it until rank 0 binds, and ``_call`` fails fast if a rank exits.
        """
        try:
            reply = await self._call(Ping(), timeout=timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(f"trainer group not ready after {timeout:.0f}s; see {self.logs[0]}:\n"
                               f"{_tail(self.logs[0])}") from None
        assert isinstance(reply, Pong), type(reply)
        self.version = reply.version

    # ------------------------------------------------------------------ TrainerClient
    async def train_step(self, batch: TrainBatch) -> TrainResult:
        reply = await self._call(TrainStep(batch=batch))
        assert isinstance(reply, TrainResult), type(reply)
        self.version = batch.step + 1
        return reply

    async def prepare_weights(self, version: int) -> WeightManifest:
        reply = await self._call(PrepareWeights(version=version))
        assert isinstance(reply, WeightManifest), type(reply)
        return reply

    async def send_weights(self, version: int) -> None:
        await self._call(SendWeights(version=version), timeout=self.cfg.weight_sync.timeout_s)

    async def init_weight_sync(self, master_addr: str, master_port: int, world_size: int,
                               backend: str = "gloo", timeout_s: float | None = None) -> None:
        """Trainer rank 0 hosts the weight-sync group (group rank 0); engines join concurrently."""
        t = timeout_s if timeout_s is not None else self.cfg.weight_sync.timeout_s
        msg = InitWeightSync(master_addr=master_addr, master_port=master_port, rank=0, world_size=world_size,
                             backend=backend, timeout_s=t)  # type: ignore[arg-type]
        await self._call(msg, timeout=t + 30.0)

    async def compute_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                               temperature: float | None = None) -> list[float]:
        """The trainer's logprob of each response token, at ``temperature`` (None: rollout.temperature)."""
        reply = await self._call(ComputeLogprobs(prompt_ids=prompt_ids, response_ids=response_ids,
                                                 temperature=temperature))
        assert isinstance(reply, Logprobs), type(reply)
        return reply.logprobs

    async def save_checkpoint(self, path: str | Path) -> None:
        """DCP checkpoint of model + optimizer at ``path`` (appears atomically when complete)."""
        await self._call(SaveCheckpoint(path=str(path)))

    async def ping(self) -> int:
        reply = await self._call(Ping(), timeout=30.0)
        assert isinstance(reply, Pong), type(reply)
        return reply.version

    async def close(self, grace_s: float = 15.0) -> None:
        """Shutdown (orderly), then SIGTERM, then SIGKILL; returns when every rank has exited."""
        if self._closed:
            return
        if all(p.poll() is None for p in self.procs):
            with contextlib.suppress(Exception):
                await self._call(Shutdown(), timeout=grace_s)
        self._closed = True
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            if sig is not None:
                log.warning("trainer group: %d rank(s) still running; sending %s", len(alive), sig.name)
                _signal_groups([p.pid for p in alive], sig)
            await self._wait_exit(wait_s)
        self._finalizer.detach()
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None

    async def _wait_exit(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(p.wait, max(0.0, end - loop.time()))
