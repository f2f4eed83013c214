"""Local mode: start every process of a run, wire them to the controller, and tear them all down.

    flashrl run config.toml
      -> ensure_model (built-in model built once, cached)
      -> launcher = cluster.make_launcher(cfg) (cluster.launcher: local | ray | slurm); preflight, start
      -> spawn E engine processes + R trainer ranks through it (locally procs.Child each: own process
         group, logs in runs/<name>/logs/, dies with this process)
      -> wait until all answer Ping; each engine joins its own weight-sync group with trainer rank 0
      -> Controller.run()  (rollouts, training loop, weight sync, eval)   +  dashboard refresh  +  memory sampler
         an engine that dies is restarted by EnginePool.restart (the controller asks; engine.max_restarts)
      -> the final policy as a Hugging Face folder: runs/<name>/final/ (trainer rank 0, atomic)
      -> shutdown: close -> cancel -> wait; every child gets Shutdown, then SIGTERM, then SIGKILL;
         launcher.close() (whatever it started is gone, on every node)

Ctrl-C / SIGTERM cancel the main task; the ``finally`` blocks stop every child within the deadline.
Every process starts through the launcher (flashrl/cluster/): the local one by default, Ray or SLURM
on a cluster; this module and the controller are the same for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from flashrl.checkpoint import Resume
from flashrl.cluster import Launcher, LaunchError, activate, deactivate, make_launcher
from flashrl.config import Config, to_toml
from flashrl.core.records import StepRecord
from flashrl.engine.client import ENGINE_ARGV, EngineProcess, EngineSpec, engine_extra_env
from flashrl.procs import child_init, exit_text, paused_gc
from flashrl.trainer.client import TrainerGroup
from flashrl.wire.transport import PeerDead

log = logging.getLogger("flashrl.launch")

SHUTDOWN_DEADLINE_S = 20.0
STOP_GRACE_S = 15.0  # after Ctrl-C / SIGTERM: finish the step and checkpoint within this, else cancel


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


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(k) for k in range(torch.cuda.device_count())]


class MemorySampler:
    """Peak resident memory of the whole run: this process plus every descendant (engines, trainer, vLLM cores)."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak_bytes = 0
        self.last_bytes = 0

    def sample(self) -> int:
        import psutil

        total = 0
        procs = [self._proc]
        with contextlib.suppress(psutil.Error):
            procs += self._proc.children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        self.last_bytes = total
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    async def run(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(interval_s)


def main(cfg: Config, resume: Resume | None = None) -> int:
    """Run ``cfg``; returns the process exit code (0 ok, 1 failure, 2 the launcher cannot do what cfg asks,
    130 interrupted).

    ``resume``: a checkpoint from ``checkpoint.prepare_resume(cfg, path)`` (verified, config checked):
    the run continues from it (trainer state, data position, metrics.jsonl up to its step).
    """
    from flashrl.logging_setup import setup_logging

    child_init("flashrl run")  # started by a supervisor (a test, a chaos bench) that sets FLASHRL_PARENT_PID: die with it
    run_dir = cfg.run_dir
    dropped = prepare_run_dir(cfg, resume)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    setup_logging(run_dir, "controller", cfg.run.log_level)
    if resume is not None:
        log.info("resuming from %s (step %d); metrics.jsonl continues after step %d (%d later line(s) dropped)",
                 resume.path, resume.step, resume.state.metrics_through, dropped)
    resumes = 0
    while True:
        try:
            summary = asyncio.run(_main_with_signals(cfg, resume))
        except KeyboardInterrupt:
            print("interrupted: all processes stopped", file=sys.stderr)
            return 130
        except LaunchError as e:  # the launcher cannot do what the config asks: nothing was started
            log.error("launch error: %s", e)
            print(f"launch error: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # a crash is reported once, loudly, after cleanup
            log.exception("run failed")
            print(f"run failed: {type(e).__name__}: {e} (logs: {run_dir / 'logs'})", file=sys.stderr)
            if resumes >= cfg.run.auto_resume:
                return 1
            resume = _auto_resume(cfg, resumes + 1)
            if resume is None:
                return 1
            resumes += 1
            continue
        break
    if summary is None:
        print("interrupted: all processes stopped", file=sys.stderr)
        return 130
    (run_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    _print_summary(summary)
    if (summary.get("result") or {}).get("stop_reason") == "interrupted":
        ck = summary["result"].get("last_checkpoint")
        where = f"checkpoint {ck} written; continue with `flashrl run CONFIG --resume`" if ck else "no checkpoint written"
        print(f"interrupted: all processes stopped; {where}", file=sys.stderr)
        return 130
    return 0


def _auto_resume(cfg: Config, attempt: int) -> Resume | None:
    """run.auto_resume: every child is stopped by now; find the latest checkpoint and get the run folder
    ready to continue from it (None, said on stderr, when there is none to resume)."""
    from flashrl.checkpoint import CheckpointError, prepare_resume

    try:
        resume = prepare_resume(cfg)
    except CheckpointError as e:
        print(f"run.auto_resume: cannot resume: {e}", file=sys.stderr)
        return None
    dropped = prepare_run_dir(cfg, resume)
    msg = (f"run.auto_resume: restarting from {resume.path} (step {resume.step}), attempt {attempt} of "
           f"{cfg.run.auto_resume}; {dropped} later metrics line(s) dropped")
    log.warning(msg)
    print(msg, file=sys.stderr)
    return resume


def prepare_run_dir(cfg: Config, resume: Resume | None) -> int:
    """Get ``runs/<name>/`` ready for a run: fresh, or continuing ``resume``. Returns the metrics lines dropped.

    Fresh: earlier metrics/samples .jsonl and checkpoints/ are renamed aside (kept, never mixed in).
    Resume: metrics.jsonl and samples.jsonl are cut back to the checkpoint's step, killed saves are
    removed and newer checkpoints set aside (checkpoint.prepare_folder). Restarting after a failure in
    the same process (run.auto_resume) is ``r = checkpoint.prepare_resume(cfg)``, this, ``run_local(cfg, r)``.
    """
    from flashrl.checkpoint import continue_metrics, prepare_folder

    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = run_dir / "checkpoints"
    if resume is not None:
        # metrics.jsonl (and samples.jsonl) continue: lines written after the checkpoint are dropped
        dropped = continue_metrics(run_dir / "metrics.jsonl", resume)
        continue_metrics(run_dir / "samples.jsonl", resume, through=resume.step)
        prepare_folder(ckpts, resume)
        return dropped
    for stem in ("metrics", "samples"):
        old = run_dir / f"{stem}.jsonl"
        if old.exists():  # a rerun under the same name keeps the earlier records, never mixes them
            old.rename(run_dir / f"{stem}.{int(old.stat().st_mtime)}.jsonl")
    if ckpts.exists():  # ... and the earlier checkpoints (resume them with --resume PATH)
        ckpts.rename(run_dir / f"checkpoints.{int(time.time())}")
    return 0


async def _main_with_signals(cfg: Config, resume: Resume | None = None) -> dict[str, Any] | None:
    """Run with Ctrl-C / SIGTERM handled: the first asks the controller to finish its step and checkpoint
    (bounded by STOP_GRACE_S), a second one (or the bound) cancels at once; children are stopped either way."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopped = {"by": ""}
    hooks: dict[str, Any] = {}

    def _stop(signame: str) -> None:
        first = not stopped["by"]
        stopped["by"] = signame
        controller = hooks.get("controller")
        if first and controller is not None and (controller.status == "running"
                                                 or controller.status.startswith("checkpointing")):
            log.warning("%s received: finishing the current step, writing a checkpoint, shutting down "
                        "(again to stop at once)", signame)
            controller.request_stop()
            loop.call_later(STOP_GRACE_S, task.cancel)
            return
        log.warning("%s received: shutting down", signame)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop, sig.name)
    try:
        return await run_local(cfg, resume, hooks=hooks)
    except asyncio.CancelledError:
        if stopped["by"]:
            return None
        raise


async def run_local(cfg: Config, resume: Resume | None = None, *, hooks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start engines and trainer, run the controller, always stop every child."""
    from flashrl.checkpoint import CheckpointWriter
    from flashrl.controller.controller import Controller
    from flashrl.dashboard import Dashboard
    from flashrl.metrics import MetricsWriter, SamplesWriter, open_wandb
    from flashrl.models import ensure_model
    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.plugins import make_suite

    t0 = time.monotonic()
    run_dir = cfg.run_dir
    launcher = make_launcher(cfg, run_dir)
    launcher.preflight()  # what the launcher cannot do fails now, before the model is built or anything starts
    mem = MemorySampler()
    dash = Dashboard.for_config(cfg.run.dashboard)
    dash.start()
    try:
        dash.status(f"preparing model {cfg.model.path}")
        model_path = Path(await asyncio.to_thread(ensure_model, cfg))
        suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
    except BaseException:  # local_cluster (which closes the launcher) is not entered: close it here
        dash.stop()
        await asyncio.shield(launcher.close())  # e.g. a private Ray instance started by preflight
        raise
    # The tokenizer loads while the engines and trainer start (importing transformers alone takes seconds,
    # which used to delay every spawn); a tokenizer error still ends the run before the first request.
    def load() -> Any:
        with paused_gc():  # transformers + torch: 3.3 s -> ~2 s of CPU the engines and trainer also want
            return load_tokenizer(model_path, cfg.model.chat_template, cfg.model.system_prompt)

    tokenizer_load = asyncio.ensure_future(asyncio.to_thread(load))

    mem_task = asyncio.create_task(mem.run(), name="memory-sampler")
    try:
        async with local_cluster(cfg, model_path, run_dir, dash.status, resume=resume.trainer_dir if resume else None,
                                 launcher=launcher, preflighted=True) as (engines, trainer):
            clients = [e.client for e in engines]
            tokenizer = await tokenizer_load
            writer = MetricsWriter(
                run_dir / "metrics.jsonl",
                tensorboard_dir=run_dir / "tensorboard" if cfg.log.tensorboard else None,
                wandb_run=open_wandb(run_dir, cfg.run.name, cfg.log.wandb_project, cfg.log.wandb_mode,
                                     msgspec.to_builtins(cfg)) if cfg.log.wandb else None,
            )
            samples_out = SamplesWriter(run_dir / "samples.jsonl")
            history: list[StepRecord] = []

            def on_step(record: StepRecord) -> None:
                record = msgspec.structs.replace(record, memory_gib=round(mem.last_bytes / 2**30, 3))
                writer.write(record)
                history.append(record)
                dash.step(record)

            checkpoints = CheckpointWriter(run_dir / "checkpoints", trainer, to_toml(cfg), cfg.run.keep_checkpoints,
                                           last_step=resume.step if resume else None)
            restarter = engines if cfg.engine.max_restarts > 0 else None
            controller = Controller(cfg, tokenizer, suite, clients, trainer, on_step=on_step, on_samples=samples_out.write,
                                    restarter=restarter,
                                    checkpoints=checkpoints,
                                    resume=resume.state if resume else None)
            if hooks is not None:
                hooks["controller"] = controller
            if resume is not None:
                dash.status(f"resumed from step {resume.step} ({resume.path})")
            # The controller holds many small per-token lists; default GC thresholds make full collections
            # walk them constantly (~30% of controller CPU in bench/results/controller_overhead). Freeze the
            # start-up objects and collect less often; this process only.
            gc.freeze()
            gc_thresholds = gc.get_threshold()
            gc.set_threshold(50_000, 20, 100)

            async def refresh() -> None:
                while True:
                    dash.update(controller.snapshot())
                    await asyncio.sleep(0.25)

            refresher = asyncio.create_task(refresh(), name="dashboard")
            try:
                result = await controller.run()
            finally:
                refresher.cancel()
                await asyncio.gather(refresher, return_exceptions=True)
                with contextlib.suppress(Exception):
                    dash.update(controller.snapshot())
                writer.close()
                samples_out.close()
                # Frozen objects are never collected, not even at exit: native extensions loaded at
                # start-up (triton, via the tokenizer's torch) would then report them as leaked.
                gc.unfreeze()
                gc.set_threshold(*gc_thresholds)
            mem.sample()
            before = [(int(a), float(b)) for a, b in resume.state.eval_history
                      if a <= resume.state.metrics_through] if resume else []
            summary = _summary(cfg, history, result, time.monotonic() - t0, mem.peak_bytes, evals_before=before)
            if getattr(result, "stop_reason", "steps") != "interrupted":
                # The final policy as a Hugging Face folder (`flashrl export` copies it out).
                dash.status("writing the final policy")
                await trainer.save_model(run_dir / "final", replace=True)
                summary["final_policy"] = str(run_dir / "final")
            return summary
    finally:
        dash.stop()
        mem_task.cancel()
        # the run failed before it needed the tokenizer: its load is waited for (a thread cannot be
        # cancelled) and any error of its own is not the run's
        await asyncio.gather(mem_task, tokenizer_load, return_exceptions=True)


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
    )


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
                 visible_gpus: list[str] | None = None, *, launcher: Launcher) -> None:
        self.cfg = cfg
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
        await self.procs[i].wait_ready(self.cfg.engine.startup_timeout_s)

    async def join(self, i: int) -> None:
        """Engine i and trainer rank 0 form engine i's weight-sync group; then watch engine i's process."""
        ep = self.procs[i]
        master, port = self.launcher.trainer_master(), await self.launcher.trainer_port()
        t = self.cfg.weight_sync.timeout_s
        log.info("weight sync group %s: master %s:%d (%s)", ep.name, master, port, self.backend)
        await asyncio.gather(
            self.trainer.init_weight_sync(master, port, 2, self.backend, t, peer=ep.name),
            ep.client.init_weight_sync(master, port, 1, 2, self.backend, t),
        )
        self._watchers[i] = asyncio.get_running_loop().create_task(self._watch(ep), name=f"watch {ep.name}")

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
            delay = min(2.0 ** (len(starts) - 1), 30.0)  # 1, 2, 4 ... s: a crash loop does not spin
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


@contextlib.asynccontextmanager
async def local_cluster(
    cfg: Config, model_path: Path, run_dir: Path, status: Callable[[str], None] = lambda s: None,
    *, resume: Path | None = None, launcher: Launcher | None = None, preflighted: bool = False,
) -> AsyncIterator[tuple[EnginePool, Any]]:
    """Spawn the engines and the trainer group through the launcher, wait until they answer, join each
    engine's weight-sync group.

    ``resume``: the trainer's part of a checkpoint (``step-N/trainer``); every rank loads it at start.
    ``launcher``: None -> ``make_launcher(cfg, run_dir)`` (cluster.launcher); either way this context
    preflights it (LaunchError before anything starts; ``preflighted``: the caller already did), starts it,
    and closes it on exit.

    Yields (engine pool, trainer group); on exit, however it happens, stops every child.
    """
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
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
        await launcher.start()
        status(f"starting {cfg.engine.count} engine(s) and {cfg.trainer.ranks} trainer rank(s) ({launcher.name} launcher)")
        trainer = await TrainerGroup.spawn(cfg, model_path, run_dir, resume=resume, launcher=launcher)
        engines = EnginePool(cfg, model_path, logs, trainer, device, backend, visible, launcher=launcher)
        await engines.spawn_all()
        await asyncio.gather(
            *(engines.wait_ready(i) for i in range(len(engines))),
            trainer.wait_ready(cfg.engine.startup_timeout_s),
        )
        status("joining the weight-sync groups")
        await asyncio.gather(*(engines.join(i) for i in range(len(engines))))
        yield engines, trainer
    finally:
        await _stop_all(engines, trainer, launcher)
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


def _summary(cfg: Config, history: list[StepRecord], result: Any, wall_s: float, peak: int,
             evals_before: list[tuple[int, float]] | None = None) -> dict[str, Any]:
    # a resumed run's evals continue those in the checkpoint (its metrics.jsonl lines up to it)
    evals = list(evals_before or []) + [(r.step, r.eval.accuracy) for r in history if r.eval is not None]
    return {
        "run": cfg.run.name,
        "steps": max((r.step for r in history), default=0),
        "wall_s": round(wall_s, 1),
        "peak_mem_gib": round(peak / 2**30, 3),
        "eval_first": evals[0][1] if evals else None,
        "eval_last": evals[-1][1] if evals else None,
        "eval_best": max((a for _, a in evals), default=None),
        "evals": evals,
        "pid": os.getpid(),
        "resumed_from": getattr(result, "resumed_from", None),
        "checkpoints": getattr(result, "checkpoints", 0),
        "checkpoint_s": round(getattr(result, "checkpoint_s", 0.0), 3),
        # of the training time (the controller's elapsed_s: start-up and model building excluded)
        "checkpoint_share": round(getattr(result, "checkpoint_s", 0.0) / result.segment_s, 5)
        if getattr(result, "segment_s", 0) else 0.0,
        # what the evals stalled, of the training time (controller/evals.py)
        "eval_wait_share": round(getattr(result, "eval_trainer_wait_s", 0.0) / result.segment_s, 5)
        if getattr(result, "segment_s", 0) else 0.0,
        "result": msgspec.to_builtins(result) if result is not None else None,
    }


def _print_summary(s: dict[str, Any]) -> None:
    evals = s.get("evals") or []
    # with the steps: a run stopped early reports its last eval, which may be an old one (even step 0's)
    acc = (f"held-out accuracy {evals[0][1]:.1%} -> {evals[-1][1]:.1%} (evals of steps {evals[0][0]} -> {evals[-1][0]})"
           if evals else "no eval")
    res = s.get("result") or {}
    ck = f"; {s['checkpoints']} checkpoint(s) in {s['checkpoint_s']:.1f}s ({s['checkpoint_share']:.1%} of training time)"
    if res.get("last_checkpoint"):
        ck += f", latest {res['last_checkpoint']}"
    if (res.get("counters") or {}).get("checkpoint/failed"):
        ck += f"; {res['counters']['checkpoint/failed']} checkpoint(s) FAILED (see the log)"
    if evals and res.get("eval_s"):
        ev = (f"; evals {res['eval_s']:.1f}s, trainer waited {res.get('eval_trainer_wait_s', 0.0):.1f}s for them "
              f"({s.get('eval_wait_share', 0.0):.1%} of training time), generation idle "
              f"{res.get('eval_gen_wait_s', 0.0):.1f}s")
        acc += ev
    resumed = f" (resumed from step {s['resumed_from']})" if s.get("resumed_from") is not None else ""
    print(
        f"done: {s['run']} {s['steps']} steps{resumed} in {s['wall_s']:.0f}s; {acc}; "
        f"peak memory {s['peak_mem_gib']:.2f} GiB (all processes){ck}"
    )
