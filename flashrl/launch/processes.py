"""The run's processes: the engine pool and the trainer group, started through the run's launcher.

    local_cluster(cfg, model_path, run_dir, launcher=...)        (driver.run_local; tests; bench)
      launcher.preflight(); activate(launcher) (remote env workers started later use it too); start()
      -> TrainerGroup.spawn (R ranks) + EnginePool.spawn_all (E engines): each launcher.spawn(...)
      -> wait until all answer Ping; each engine joins its own weight-sync group with trainer rank 0
      -> yield (engines, trainer)
      -> on exit, however it happens: Shutdown, SIGTERM, SIGKILL to every child, then launcher.close()

An engine that dies is restarted by ``EnginePool.restart`` when the controller asks (engine.max_restarts).
A launcher with background work of its own (the slurm launcher's poller) has a ``watch()`` coroutine: it
runs beside the engine watchers, and its failure ends the run at once with the launcher's LaunchError.
The same code runs with every launcher: only ``launcher.endpoint/spawn/trainer_port`` differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from flashrl.aio import supervised
from flashrl.config import Config
from flashrl.deadlines import resolve as resolve_deadlines
from flashrl.deadlines import startup_timeout_s, weight_sync_timeout_s
from flashrl.engine.client import ENGINE_ARGV, EngineProcess, EngineSpec, engine_extra_env
from flashrl.engine.server import EXIT_ADDRESS_IN_USE
from flashrl.launch import Launcher, activate, deactivate, make_launcher
from flashrl.launch.base import LaunchError, served_engines
from flashrl.launch.local import LocalLauncher
from flashrl.moe.routes import capture_routes
from flashrl.procs import backoff, exit_text
from flashrl.trainer.client import TrainerGroup
from flashrl.wire.transport import PeerDead

log = logging.getLogger("flashrl.launch")

SHUTDOWN_DEADLINE_S = 20.0  # per child: Shutdown message, then SIGTERM, then SIGKILL within this


def resolve_device(cfg: Config) -> str:
    """engine.device auto -> cuda when a GPU is visible, else cpu."""
    if cfg.engine.device != "auto":
        return cfg.engine.device
    if sys.platform.startswith("linux") and not _gpu_device_nodes():
        return "cpu"  # no GPU driver here: no need to import torch (1.5 s before anything could start)
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _gpu_device_nodes() -> list[str]:
    """The device files a GPU driver creates on Linux: NVIDIA's, AMD ROCm's (/dev/kfd, which torch.cuda
    also drives) and WSL2's (/dev/dxg). Without any of them torch.cuda.is_available() cannot be True."""
    nodes = [p for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg") if os.path.exists(p)]
    return nodes + [str(p) for p in Path("/dev").glob("nvidia[0-9]*")]


def engine_gpu(i: int, ranks: int, engines: int, visible: list[str]) -> str | None:
    """The GPU engine ``i`` is pinned to on this machine (its CUDA_VISIBLE_DEVICES), or None.

    Trainer rank r uses visible GPU r (cuda:LOCAL_RANK); engine i gets visible GPU ``ranks + i`` when
    there are at least ``ranks + engines`` of them. With fewer, nothing is pinned (vLLM's own default,
    the first visible GPU): processes then share GPUs, and ``gpu_memory_utilization`` must leave room.
    """
    return visible[ranks + i] if len(visible) >= ranks + engines else None


def judge_gpus(cfg: Config, visible: list[str] | None = None) -> list[str | None]:
    """Each judge engine's GPU on this machine (local launcher, cuda): visible GPU ``ranks + engines + j`` when
    there are enough for every trainer rank, engine and judge engine; else None (unpinned: they share)."""
    visible = _visible_gpus() if visible is None else visible
    first, n = cfg.trainer.ranks + cfg.engine.count, served_engines(cfg)  # the judge's, then the teachers'
    return [visible[first + j] if len(visible) >= first + n else None for j in range(n)]


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(k) for k in range(torch.cuda.device_count())]


def engine_spec(cfg: Config, model_path: Path, i: int, device: str, address: str) -> EngineSpec:
    """Engine i's options (``address``: what it binds)."""
    return EngineSpec(
        address=address,
        model=str(model_path),
        name=f"engine{i}",
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        kv_cache_gib=cfg.engine.kv_cache_gib,
        max_num_seqs=cfg.engine.max_num_seqs,
        device=device,  # type: ignore[arg-type]
        threads=cfg.engine.threads,
        seed=cfg.run.seed + i,
        gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
        log_level=cfg.run.log_level,
        nice=cfg.engine.nice,
        sync_load=cfg.weight_sync.load,
        routes=capture_routes(cfg, model_path),
        route_source=route_source_for(cfg, device),
        **_lora_engine(cfg, model_path),
    )


def route_source_for(cfg: Config, device: str) -> Literal["auto", "vllm", "hooks"]:
    """``[moe] capture_source`` for an engine on ``device``; "vllm" where vLLM's capture cannot run is refused
    here, before an engine starts (flashrl/moe/source.py; the engine chooses "auto" itself and logs why)."""
    if cfg.moe.capture_source == "vllm":
        from flashrl.moe.routes import RoutesError
        from flashrl.moe.source import choose_route_source

        try:
            choose_route_source(device, "vllm")
        except RoutesError as e:  # a launch error: said in one line, nothing started, no restart would help
            raise LaunchError(str(e)) from None
    return cfg.moe.capture_source


def _lora_engine(cfg: Config, model_path: Path) -> dict[str, Any]:
    """EngineSpec's LoRA options: the adapter's rank and its peft config (none when model.lora is off)."""
    lo = cfg.model.lora
    if not lo.rank:
        return {}
    from flashrl.trainer.lora import adapter_config, spec_of

    return {"lora_rank": lo.rank, "lora_config": adapter_config(spec_of(lo), str(model_path))}


class EnginePool:
    """The engine processes of a run (a list of ``EngineProcess`` to its users), restartable; every one
    started through the launcher.

    Every engine joins its own weight-sync group with trainer rank 0 (master: launcher.trainer_master(),
    a fresh port from launcher.trainer_port() per start, see trainer/weights.py). A watcher per engine awaits its process's exit: the group is reaped (vLLM's
    EngineCore must not outlive it) and its client is failed at once, so every request waiting on it
    raises PeerDead now (retried elsewhere) instead of at the next missed heartbeat. ``restart(i)``
    (the controller's ``EngineRestarter``) replaces a dead engine, with backoff, at most
    ``engine.max_restarts`` times per ``engine.restart_window_s``.
    """

    def __init__(self, cfg: Config, model_path: Path, logs: Path, trainer: TrainerGroup, device: str, backend: str,
                 visible_gpus: list[str] | None = None, *, launcher: Launcher,
                 tasks: asyncio.TaskGroup | None = None) -> None:
        self.cfg = cfg
        self.tasks = tasks  # where the watchers run (local_cluster's group: a watcher that fails ends the run)
        self.launcher = launcher
        self.visible_gpus = visible_gpus or []
        self.model_path = model_path
        self.logs = logs
        self.trainer = trainer
        self.device = device
        self.backend = backend
        self.procs: list[EngineProcess] = []  # index = engine number
        self._starts: list[list[float]] = [[] for _ in range(cfg.engine.count)]  # restart times per engine
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._closing = False

    def __len__(self) -> int:
        return len(self.procs)

    def __iter__(self) -> Iterator[EngineProcess]:
        return iter(list(self.procs))

    def __getitem__(self, i: int) -> EngineProcess:
        return self.procs[i]

    async def _spawn(self, i: int) -> EngineProcess:
        cfg = self.cfg
        ep = await self.launcher.endpoint("engine", i)  # a new socket per start: no stale replies
        opts = engine_spec(cfg, self.model_path, i, self.device, ep.bind)
        gpu_env = None
        if self.device == "cuda" and self.launcher.name == "local":  # remote launchers give each its own GPU
            gpu = engine_gpu(i, cfg.trainer.ranks, cfg.engine.count, self.visible_gpus)
            gpu_env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
        proc = await self.launcher.spawn("engine", i, ENGINE_ARGV, engine_extra_env(opts, gpu_env),
                                         self.logs / f"engine{i}.log")
        log.info("engine %s on %s", opts.name, ep.connect)
        curve = self.launcher.curve.client() if self.launcher.curve is not None else None
        return EngineProcess(opts, proc, cfg.engine.heartbeat_s, connect=ep.connect, curve=curve)

    async def spawn_all(self) -> None:
        for i in range(self.cfg.engine.count):
            self.procs.append(await self._spawn(i))

    async def wait_ready(self, i: int) -> None:
        await self.procs[i].wait_ready(startup_timeout_s(self.cfg))

    async def start(self, i: int, trainer_ready: Awaitable[Any]) -> None:
        """At launch: wait until engine i answers, then (once ``trainer_ready``) join its weight-sync group.
        An engine killed by a signal meanwhile (SIGKILL, the OOM killer: a negative exit code) is restarted
        as a running one would be (``restart``: backoff, engine.max_restarts), so a kill during a
        (re)start costs that engine's restart, not the whole run's start; one that exits with an error of
        its own (a model vLLM refuses, a bad option) still ends the start at once, named; one whose address was
        taken before it could bind it (EXIT_ADDRESS_IN_USE) is started again on a new one."""
        try:
            await self.wait_ready(i)
            await trainer_ready
            await self.join(i)
        except Exception as e:
            code = self.procs[i].child.returncode
            if self._closing or code is None or (code >= 0 and code != EXIT_ADDRESS_IN_USE):
                raise
            why = "found its address taken" if code == EXIT_ADDRESS_IN_USE else f"was killed (signal {-code})"
            log.error("engine%d %s while starting: %s; restarting it", i, why,
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
            await trainer_ready
            await self.restart(i)

    async def join(self, i: int) -> None:
        """Engine i and trainer rank 0 form engine i's weight-sync group; then watch engine i's process."""
        ep = self.procs[i]
        master, port = self.launcher.trainer_master(), await self.launcher.trainer_port()
        t = weight_sync_timeout_s(self.cfg)
        log.info("weight sync group %s: master %s:%d (%s)", ep.name, master, port, self.backend)
        await asyncio.gather(
            self.trainer.init_weight_sync(master, port, 2, self.backend, t, peer=ep.name),
            ep.client.init_weight_sync(master, port, 1, 2, self.backend, t),
        )
        spawn = self.tasks.create_task if self.tasks is not None else asyncio.get_running_loop().create_task
        self._watchers[i] = spawn(self._watch(ep), name=f"watch {ep.name}")

    async def _watch(self, ep: EngineProcess) -> None:
        code = await ep.child.exited()
        await ep.child.reap_group()
        if not self._closing:
            log.error("engine %s %s; log %s", ep.name, exit_text(code), ep.log_path)
            ep.client.fail(PeerDead(f"engine {ep.name} {exit_text(code)} (log {ep.log_path})"))

    async def restart(self, i: int) -> Any:
        """Replace dead engine i; returns its client once it is ready and joined (see EngineRestarter)."""
        cfg = self.cfg.engine
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            starts = [t for t in self._starts[i] if now - t < cfg.restart_window_s]
            if len(starts) >= cfg.max_restarts:
                raise RuntimeError(
                    f"engine{i} needed {len(starts)} restarts within {cfg.restart_window_s:.0f} s "
                    f"(engine.max_restarts = {cfg.max_restarts}); it stays down. Log: {self.logs / f'engine{i}.log'}"
                )
            starts.append(now)
            self._starts[i] = starts
            await self._discard(i)
            delay = backoff(len(starts), 1.0, 30.0)  # 1, 2, 4 ... s
            log.warning("engine%d: restart %d in %.0f s", i, len(starts), delay)
            await asyncio.sleep(delay)
            ep = await self._spawn(i)
            self.procs[i] = ep
            try:
                await self.wait_ready(i)
                await self.join(i)
            except Exception as e:  # noqa: BLE001 - counted against max_restarts, tried again
                log.error("engine%d: restart failed: %s", i, e)
                continue
            return ep.client

    async def _discard(self, i: int) -> None:
        """Kill what is left of engine i (its whole process group) and forget its watcher."""
        w = self._watchers.pop(i, None)
        if w is not None:
            w.cancel()
        await self.procs[i].discard()

    async def stop_all(self, grace_s: float) -> None:
        self._closing = True
        for w in self._watchers.values():
            w.cancel()
        await asyncio.gather(*(e.terminate(grace_s) for e in self.procs), return_exceptions=True)


async def spawn_local_trainer(cfg: Config, model_path: str | Path, run_dir: str | Path, *,
                              resume: str | Path | None = None) -> TrainerGroup:
    """A trainer group on this machine through a local launcher of its own (cfg.cluster.interface), closed
    with the group: the trainer alone, without engines (tests, benches)."""
    launcher = LocalLauncher(Path(run_dir), cfg.cluster.interface)
    launcher.preflight()
    await launcher.start()
    return await TrainerGroup.spawn(cfg, model_path, run_dir, resume=resume, launcher=launcher, close_launcher=True)


@contextlib.asynccontextmanager
async def local_cluster(
    cfg: Config, model_path: Path, run_dir: Path, status: Callable[[str], None] = lambda s: None,
    *, resume: Path | None = None, launcher: Launcher | None = None, preflighted: bool = False,
) -> AsyncIterator[tuple[EnginePool, Any]]:
    """Spawn the engines and the trainer group through the launcher, wait until they answer, join each
    engine's weight-sync group.

    ``resume``: the trainer's part of a checkpoint (``step-N/trainer``); every rank loads it at start.
    ``launcher``: None -> ``make_launcher(cfg, run_dir)`` (by cluster.launcher); either way this context
    preflights it (LaunchError before anything starts; ``preflighted``: the caller already did), starts it,
    and closes it on exit.

    Yields (engine pool, trainer group); on exit, however it happens, stops every child.
    """
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg = resolve_deadlines(cfg, model_path)  # the auto (0) deadlines, scaled to this model
    device = resolve_device(cfg)
    backend = cfg.trainer.backend if cfg.trainer.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    trainer: Any = None
    visible = _visible_gpus() if device == "cuda" else []
    if device == "cuda" and len(visible) < cfg.trainer.ranks + cfg.engine.count:
        log.warning("%d GPU(s) visible for %d trainer rank(s) + %d engine(s): engines are not pinned and share GPUs "
                    "with the trainer", len(visible), cfg.trainer.ranks, cfg.engine.count)
    engines: EnginePool | None = None
    if launcher is None:
        launcher = make_launcher(cfg, run_dir)
    if not preflighted:
        launcher.preflight()
    token = activate(launcher, logs)  # remote env workers, started later by the env suite, use it too
    try:
        async with supervised() as tasks:  # the engine watchers: one that fails ends the run with its error
            try:
                await launcher.start()
                watch = getattr(launcher, "watch", None)  # a launcher's own background work (slurm: its poller)
                if watch is not None:  # watched like the engines: its failure ends the run, named, at once
                    tasks.create_task(watch(), name=f"{launcher.name} launcher")
                status(f"starting {cfg.engine.count} engine(s) and {cfg.trainer.ranks} trainer rank(s) "
                       f"({launcher.name} launcher)")
                trainer = await TrainerGroup.spawn(cfg, model_path, run_dir, resume=resume, launcher=launcher)
                engines = EnginePool(cfg, model_path, logs, trainer, device, backend, visible, launcher=launcher,
                                     tasks=tasks)
                await engines.spawn_all()
                async with supervised() as starting:  # the first error ends the start, the others cancelled
                    ready = starting.create_task(trainer.wait_ready(startup_timeout_s(cfg)), name="trainer start")
                    for i in range(len(engines)):  # each joins its weight-sync group once it and the trainer answer
                        starting.create_task(engines.start(i, ready), name=f"engine{i} start")
                status("engines and trainer ready, weight-sync groups joined")
                yield engines, trainer
            finally:
                await _stop_all(engines, trainer, launcher)  # cancels the watchers: the group can end
    finally:
        deactivate(token)


async def _stop_all(engines: EnginePool | None, trainer: Any, launcher: Launcher | None = None) -> None:
    """Stop every child: Shutdown message, SIGTERM, SIGKILL, then the launcher's own teardown — shielded so a
    second Ctrl-C cannot orphan them."""

    async def stop() -> None:
        jobs = []
        if engines is not None:
            jobs.append(engines.stop_all(SHUTDOWN_DEADLINE_S))
        if trainer is not None:
            jobs.append(trainer.close(SHUTDOWN_DEADLINE_S))
        await asyncio.gather(*jobs, return_exceptions=True)
        if launcher is not None:
            try:
                await launcher.close()
            except Exception:  # noqa: BLE001 - logged; the run's own error (if any) is the one raised
                log.exception("%s launcher: close failed", launcher.name)

    await asyncio.shield(stop())

