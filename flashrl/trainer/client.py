"""The controller's handle on the trainer group: R rank processes, one ZeroMQ channel to rank 0.

    TrainerGroup.spawn --launcher.spawn("trainer", rank) x R (env as torchrun sets it: MASTER_ADDR =
                        launcher.trainer_master(); the TrainerSpec in FLASHRL_SPEC, trainer/spec.py)
                        --> worker.py ranks (locally procs.Child: own process group)
                        stdout+stderr -> <run_dir>/logs/trainer<rank>.log
    train_step / prepare_weights / ... --RpcClient--> rank 0 (fans out to the others)
         each call races its reply against the rank processes: a rank that exits fails the call at
         once with TrainerDied (and the tail of its log) instead of leaving it waiting forever
    close(): Shutdown request -> wait -> SIGTERM each rank's process group -> wait -> SIGKILL

``TrainerGroup`` implements ``flashrl.interfaces.TrainerClient``. Each rank's ``procs.Child`` (local) SIGKILLs
its process group if dropped without ``close()`` (a half-built group leaves no orphans), and each rank
dies on its own when the controller does (``procs.child_init``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from pathlib import Path
from typing import Any

from flashrl.config import Config
from flashrl.deadlines import weight_sync_timeout_s
from flashrl.launch.base import Launcher, Proc
from flashrl.procs import Child, exited_within, tail
from flashrl.trainer.spec import TrainerSpec
from flashrl.wire import protocol
from flashrl.wire.protocol import (
    CheckpointSaved,
    ComputeLogprobs,
    DropWeightPeer,
    FinishCheckpoint,
    InitWeightSync,
    Logprobs,
    Msg,
    Ok,
    Ping,
    Pong,
    PrepareWeights,
    SaveCheckpoint,
    SaveModel,
    SendWeights,
    Shutdown,
    TrainBatch,
    TrainResult,
    TrainStep,
    WeightManifest,
)
from flashrl.wire.spec import spec_env
from flashrl.wire.transport import PeerDead, RpcClient

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a waiting call checks that every rank is still alive


class TrainerDied(PeerDead):
    """A trainer rank process exited; the message carries its exit code and the tail of its log."""


class TrainerGroup:
    """R trainer ranks as one ``TrainerClient``. Build with ``spawn``; then ``await wait_ready()``."""

    def __init__(self, children: list[Proc], address: str, cfg: Config, *, curve: dict[str, bytes] | None = None,
                 owned_launcher: Any = None) -> None:
        self.children = children
        self.address = address  # where the controller reaches rank 0
        self.cfg = cfg
        self.curve = curve
        self.version = 0
        self._rpc: RpcClient | None = None
        self._closed = False
        self._owned_launcher = owned_launcher  # spawn() without a launcher made its own: closed with the group

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """The local rank processes (local launcher only: tests signal them)."""
        return [c.proc for c in self.children if isinstance(c, Child)]

    @property
    def logs(self) -> list[Path]:
        return [c.log_path for c in self.children if c.log_path is not None]

    @classmethod
    async def spawn(cls, cfg: Config, model_path: str | Path, run_dir: str | Path,
                    *, launcher: Launcher, resume: str | Path | None = None,
                    close_launcher: bool = False) -> TrainerGroup:
        """Start ``cfg.trainer.ranks`` worker processes through ``launcher`` (what torchrun would do), a
        started launcher handed in (launch/processes.py; the trainer knows no concrete launcher);
        ``close_launcher``: the group owns it and closes it with itself (or at once, if the spawn fails).
        """
        run_dir = Path(run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        owned = launcher if close_launcher else None
        world = cfg.trainer.ranks
        ep = await launcher.endpoint("trainer", 0)
        master, master_port = launcher.trainer_master(), await launcher.trainer_port()
        cmd = ["python", "-m", "flashrl.trainer.worker"]
        spec = spec_env(TrainerSpec(cfg=cfg, address=ep.bind, model=str(model_path),
                                    resume=None if resume is None else str(resume)))
        children: list[Proc] = []
        try:
            for rank in range(world):
                env = {
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                    "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": master, "MASTER_PORT": str(master_port),
                    "OMP_NUM_THREADS": str(cfg.trainer.threads),
                    # idle OpenMP threads sleep instead of spinning: the rank shares the cores with the
                    # engines, and a spinning pool (threads > 1) steals them from a busy engine
                    "OMP_WAIT_POLICY": "PASSIVE", **spec,
                }
                children.append(await launcher.spawn("trainer", rank, cmd, env, run_dir / "logs" / f"trainer{rank}.log"))
        except BaseException:
            for c in children:
                c.kill()
            if owned is not None:
                await owned.close()
            raise
        log.info("trainer group: %d rank(s), rank 0 at %s, torch.distributed master %s:%d, logs %s",
                 world, ep.connect, master, master_port, run_dir / "logs")
        curve = launcher.curve.client() if launcher.curve is not None else None
        return cls(children, ep.connect, cfg, curve=curve, owned_launcher=owned)

    # ------------------------------------------------------------------ liveness
    def _check_alive(self) -> None:
        for c in self.children:
            if not c.alive:
                raise TrainerDied(c.describe())

    @property
    def dead(self) -> TrainerDied | None:
        """The error naming the first rank that exited (how, and its log), or None while all run."""
        try:
            self._check_alive()
        except TrainerDied as e:
            return e
        return None

    def _client(self) -> RpcClient:
        if self._closed:
            raise PeerDead("trainer group is closed")
        if self._rpc is None:
            self._rpc = RpcClient(self.address, protocol.TRAINER_REPLIES, name="trainer", curve=self.curve)
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
        except TimeoutError:
            raise TimeoutError(f"trainer group not ready after {timeout:.0f}s; see {self.logs[0]}:\n"
                               f"{tail(self.logs[0], 30)}") from None
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

    async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
        """Broadcast ``version`` to ``peers`` (None: every joined engine). A peer that fails is logged
        (the trainer forgets its group) and never fails the call: each engine's own reply says whether
        it loaded the weights."""
        reply = await self._call(SendWeights(version=version, peers=None if peers is None else list(peers)),
                                 timeout=weight_sync_timeout_s(self.cfg))
        if isinstance(reply, Ok) and "failed:" in reply.info:
            log.warning("trainer: %s", reply.info)

    async def drop_weight_peer(self, peer: str) -> None:
        """Engine ``peer`` is dead: rank 0 stops waiting on its weight-sync group (DropWeightPeer, answered
        at once: a send in flight to ``peer`` ends for it, the other engines' go on)."""
        reply = await self._call(DropWeightPeer(peer=peer), timeout=30.0)
        log.info("trainer: %s", reply.info if isinstance(reply, Ok) else reply)

    async def init_weight_sync(self, master_addr: str, master_port: int, world_size: int = 2,
                               backend: str = "gloo", timeout_s: float | None = None, peer: str = "engine") -> None:
        """Host ``peer``'s weight-sync group (trainer rank 0 = group rank 0); the engine joins concurrently."""
        t = timeout_s if timeout_s is not None else weight_sync_timeout_s(self.cfg)
        msg = InitWeightSync(master_addr=master_addr, master_port=master_port, rank=0, world_size=world_size,
                             backend=backend, timeout_s=t, peer=peer)  # type: ignore[arg-type]
        await self._call(msg, timeout=t + 30.0)

    async def compute_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                               temperature: float | None = None) -> list[float]:
        """The trainer's logprob of each response token, at ``temperature`` (None: rollout.temperature)."""
        reply = await self._call(ComputeLogprobs(prompt_ids=prompt_ids, response_ids=response_ids,
                                                 temperature=temperature))
        assert isinstance(reply, Logprobs), type(reply)
        return reply.logprobs

    async def save_checkpoint(self, path: str | Path, background: bool = False) -> float:
        """DCP checkpoint of model + optimizer at ``path`` (appears atomically when complete). ``background``:
        returns once the state is staged; ``path`` appears after ``finish_checkpoint(path)``. Returns the
        seconds the trainer waited for an earlier background write still in flight."""
        reply = await self._call(SaveCheckpoint(path=str(path), background=background))
        assert isinstance(reply, CheckpointSaved), type(reply)
        return reply.wait_s

    async def finish_checkpoint(self, path: str | Path, timeout_s: float) -> float:
        """Wait for the background write of ``path`` to finish on every rank (at most ``timeout_s``) and have
        rank 0 seal it into place; the write's whole duration. Raises when it failed or was late."""
        reply = await self._call(FinishCheckpoint(path=str(path), timeout_s=timeout_s), timeout=timeout_s + 60.0)
        assert isinstance(reply, CheckpointSaved), type(reply)
        return reply.write_s

    async def save_model(self, path: str | Path, replace: bool = False) -> None:
        """The current policy as a Hugging Face folder at ``path`` (appears atomically when complete)."""
        await self._call(SaveModel(path=str(path), replace=replace))

    async def ping(self) -> int:
        reply = await self._call(Ping(), timeout=30.0)
        assert isinstance(reply, Pong), type(reply)
        return reply.version

    async def close(self, grace_s: float = 15.0) -> None:
        """Shutdown (orderly), then SIGTERM, then SIGKILL (procs.Child.stop); returns when every rank has exited."""
        if self._closed:
            return
        asked = False
        if all(c.alive for c in self.children):
            with contextlib.suppress(Exception):
                await self._call(Shutdown(), timeout=grace_s)
                asked = True
        self._closed = True
        if asked:  # rank 0 fans Shutdown out to the others: every rank gets the grace to exit
            await asyncio.gather(*(exited_within(c, grace_s) for c in self.children))
        await asyncio.gather(*(c.stop() for c in self.children))  # then SIGTERM, SIGKILL, group reaped
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None
        if self._owned_launcher is not None:
            await self._owned_launcher.close()

