"""The run driver, the one entry of `flashrl run`: ``main(cfg, resume)`` runs a config to its end.

    flashrl run config.toml  ->  main(cfg, resume)          (every launcher; on SLURM node 0 runs it)
      -> prepare_run_dir, logging; restart from the latest checkpoint on a crash (run.auto_resume)
      -> run_local: launcher = make_launcher(cfg) (cluster.launcher: local | ray | slurm); preflight
      -> ensure_model (built-in model built once, cached); the env suite
      -> processes.local_cluster: E engine processes + R trainer ranks through the launcher, ready, joined
      -> every task of the run is in a task group (aio.supervised), none loose:
           run_local's: Controller.run() (its own group inside) + dashboard refresher + memory
           sampler + tokenizer load; local_cluster's (nested): one watcher per engine process
         a task that crashes cancels the others and the run fails with that task's error, named
      -> the final policy as a Hugging Face folder: runs/<name>/final/ (trainer rank 0, atomic)
      -> shutdown: close -> cancel -> wait; every child gets Shutdown, then SIGTERM, then SIGKILL;
         launcher.close() (whatever it started is gone, on every node)

Ctrl-C / SIGTERM: the first asks the controller to finish its step and checkpoint, a second (or
STOP_GRACE_S) cancels the main task; the ``finally`` blocks stop every child within the deadline.
The calls go one way: driver -> processes -> launcher (flashrl/launch/__init__.py); the launchers
never call back, and this module and the controller are the same for every launcher.
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flashrl.aio import supervised
from flashrl.config import Config, advice, to_toml
from flashrl.core.records import StepRecord
from flashrl.launch import Launcher, LaunchError, make_launcher
from flashrl.launch.processes import judge_gpus, local_cluster, resolve_device
from flashrl.launch.rundir import FAILURE_FILE, FINAL_EXIT, RESTART_ENV, FreshStartRefused, prepare_run_dir
from flashrl.procs import child_init, paused_gc
from flashrl.resuming import Resume

if TYPE_CHECKING:
    from flashrl.dashboard import Dashboard

log = logging.getLogger("flashrl.launch")

STOP_GRACE_S = 15.0  # after Ctrl-C / SIGTERM: finish the step and checkpoint within this, else cancel


class MemorySampler:
    """The whole run's resident memory (peak and last) and CPU time: this process plus every descendant (engines,
    trainer, vLLM cores, judge engines, reward-model workers). ``cpu_s`` sums each process's user + system
    seconds as last seen, so a process that exited keeps counting what it used until its last sample; a process is
    known by its pid and start time, so a pid the kernel hands to a new process of the run counts both."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak_bytes = 0
        self.last_bytes = 0
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, start time) -> user + system seconds at its last sample

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu.values())

    def sample(self) -> int:
        import psutil

        total = 0
        procs = [self._proc]
        with contextlib.suppress(psutil.Error):
            procs += self._proc.children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
                t = p.cpu_times()
                self._cpu[(p.pid, p.create_time())] = t.user + t.system  # a process's CPU time only grows
        self.last_bytes = total
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    async def run(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(interval_s)


def main(cfg: Config, resume: Resume | None = None) -> int:
    """Run ``cfg``; returns the process exit code (0 ok, 1 failure, 2 the launcher cannot do what cfg asks,
    130 interrupted).

    ``resume``: a checkpoint from ``resuming.prepare_resume(cfg, path)`` (verified, config checked):
    the run continues from it (trainer state, data position, metrics.jsonl up to its step).
    """
    from flashrl.logging_setup import setup_logging

    child_init("flashrl run")  # started by a supervisor (a test, a chaos bench) that sets FLASHRL_PARENT_PID: die with it
    run_dir = cfg.run_dir
    try:
        dropped = prepare_run_dir(cfg, resume, restart=bool(os.environ.get(RESTART_ENV)))
    except FreshStartRefused as e:
        return _final(run_dir, e, 2)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    setup_logging(run_dir, "controller", cfg.run.log_level)
    for note in advice(cfg):  # valid but probably not meant: said once, in the log and on stderr
        log.warning(note)
        print(f"warning: {note}", file=sys.stderr)
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
            final = final_failure(e)
            if final is not None:  # a restart (run.auto_resume, --supervise) would meet it again
                return _final(run_dir, *final)
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
    from flashrl.checkpoint import CheckpointError
    from flashrl.resuming import prepare_resume

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


def final_failure(e: BaseException) -> tuple[BaseException, int] | None:
    """The error in ``e`` (itself, its causes, the errors of a group) that ends the run for good, with the
    exit code: a config error found once the run began (2: the config cannot work), or an error final by
    its own definition (FINAL_EXIT: every judge engine down for good, JudgeDown; an adapter vLLM refuses
    again and again, AdapterRefused). None: a crash a restart may get past (run.auto_resume, --supervise)."""
    from flashrl.config import ConfigError
    from flashrl.distill.build import TeacherModelError
    from flashrl.distill.engines import TeacherDown
    from flashrl.judge.build import JudgeModelError
    from flashrl.judge.engines import JudgeDown
    from flashrl.models import ModelPathError
    from flashrl.models.chat import ChatTemplateError
    from flashrl.plugins import PluginError
    from flashrl.rewardmodel.build import RewardModelError
    from flashrl.wire.protocol import AdapterRefused

    config_errors = (ConfigError, PluginError, ModelPathError, ChatTemplateError, RewardModelError, JudgeModelError,
                     TeacherModelError)
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (JudgeDown, TeacherDown, AdapterRefused)):
            return x, FINAL_EXIT
        if isinstance(x, config_errors):
            return x, 2
        if isinstance(x, BaseExceptionGroup):
            todo += list(x.exceptions)
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
    return None


def _final(run_dir: Path, e: BaseException, code: int) -> int:
    """A run that ended for good: said on stderr and in runs/<name>/failure.json (the supervisor names it
    from there instead of restarting); ``code``: the process exit code."""
    kind = "config error" if code == 2 else "final failure"
    print(f"{kind}: {type(e).__name__}: {e}; a restart would fail the same way", file=sys.stderr)
    log.error("%s, not restarted: %s: %s", kind, type(e).__name__, e)
    with contextlib.suppress(OSError):
        (run_dir / FAILURE_FILE).write_bytes(msgspec.json.encode(
            {"error": type(e).__name__, "message": str(e), "exit_code": code, "time": time.time()}))
    return code


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
    """Start engines and trainer, run the controller, always stop every child.

    Every task of the run lives in one task group (aio.supervised): the controller, the dashboard
    refresher, the memory sampler, the tokenizer load and (inside local_cluster) the engine watchers.
    One that crashes cancels the rest and the run fails with its error, naming it (``_helper``): no
    task's failure goes unseen and none leaves the run hanging.
    """
    from flashrl.dashboard import Dashboard
    from flashrl.models import Progress
    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.plugins import make_suite
    from flashrl.vision.build import ensure_policy as ensure_model

    t0 = time.monotonic()
    run_dir = cfg.run_dir
    launcher = make_launcher(cfg, run_dir)
    launcher.preflight()  # what the launcher cannot do fails now, before the model is built or anything starts
    mem = MemorySampler()
    dash = Dashboard.for_config(cfg.run.dashboard)
    dash.start()
    wrapped: Any = None  # the suite with its reward model or judge started, to close if what follows fails
    try:
        dash.status(f"preparing model {cfg.model.path}")
        # a first run builds the built-in model (minutes): its phases show on the status line as they go
        shown = Progress(f"preparing model {cfg.model.path}", say=dash.status, every_s=10.0)
        model_path = Path(await asyncio.to_thread(ensure_model, cfg, progress=shown))
        suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
        if cfg.reward.model:  # a reward model beside the verifier: the suite scores episodes with it too
            from flashrl.rewardmodel import with_reward_model

            suite = wrapped = await with_reward_model(cfg, suite, progress=shown)
        elif cfg.judge.model:  # a generative judge beside the verifier, on engines of its own
            from flashrl.judge import with_judge

            await launcher.start()  # the judge's engines are placed by the run's launcher (local_cluster's start: a no-op)
            device = resolve_device(cfg)  # the judge runs where the policy's engines do
            suite = wrapped = await with_judge(cfg, suite, progress=shown, launcher=launcher, device=device,
                                     gpus=judge_gpus(cfg)[: cfg.judge.engines] if device == "cuda" else None)
        teachers = await _teachers(cfg, model_path, shown, launcher)
    except BaseException:  # local_cluster (which closes the launcher) is not entered: close it here
        dash.stop()
        if wrapped is not None:  # the teachers failed to start: the judge's engines (the reward model's workers) stop
            await asyncio.shield(wrapped.aclose())
        await asyncio.shield(launcher.close())  # e.g. a private Ray instance started by preflight
        raise
    # The tokenizer loads while the engines and trainer start (importing transformers alone takes seconds,
    # which used to delay every spawn); a tokenizer error ends the run at once, before the first request.
    def load() -> Any:
        with paused_gc():  # transformers + torch: 3.3 s -> ~2 s of CPU the engines and trainer also want
            return load_tokenizer(model_path, cfg.model.chat_template, cfg.model.system_prompt)

    try:
        async with supervised() as tasks:
            tokenizer_load = tasks.create_task(_helper("the tokenizer load", asyncio.to_thread, load),
                                               name="tokenizer-load")
            sampler = tasks.create_task(_helper("the memory sampler", mem.run), name="memory-sampler")
            summary = await _train(cfg, resume, hooks, tasks, tokenizer_load, model_path, suite, launcher, mem, dash, t0,
                                   teachers)
            sampler.cancel()  # the run is over: the group ends once its helpers have
        return summary
    finally:
        dash.stop()
        if cfg.reward.model or cfg.judge.model:  # its workers or engines, when the controller never closed the suite
            await asyncio.shield(suite.aclose())
        if teachers is not None:
            await asyncio.shield(teachers.aclose())


async def _teachers(cfg: Config, model_path: Path, shown: Any, launcher: Launcher) -> Any:
    """The run's distillation teachers (flashrl/distill; None without any), their engines starting in the background
    beside the policy's, placed by the run's launcher after the judge's."""
    if not cfg.distill.on:
        return None
    from flashrl.distill import start_teachers

    await launcher.start()  # local_cluster's start: a no-op
    device = resolve_device(cfg)  # the teachers run where the policy's engines do
    gpus = judge_gpus(cfg)[(cfg.judge.engines if cfg.judge.model else 0):] if device == "cuda" else None
    return await start_teachers(cfg, model_path, progress=shown, launcher=launcher, device=device, gpus=gpus)


async def _helper(what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """A helper task of the run: ``await fn(*args)``; its failure is raised as "<what> failed: <error>" (the
    cause kept), so the run's error says which part of it broke. (``fn`` is called here, not by the caller:
    a task cancelled before it starts leaves no coroutine behind un-awaited.)"""
    try:
        return await fn(*args)
    except Exception as e:
        raise RuntimeError(f"{what} failed: {type(e).__name__}: {e}") from e


async def _train(cfg: Config, resume: Resume | None, hooks: dict[str, Any] | None, tasks: asyncio.TaskGroup,
                 tokenizer_load: asyncio.Task[Any], model_path: Path, suite: Any, launcher: Launcher,
                 mem: MemorySampler, dash: Dashboard, t0: float, teachers: Any = None) -> dict[str, Any]:
    """run_local's middle: the processes up, the controller run, the final policy written; the summary."""
    from flashrl.checkpoint import CheckpointWriter
    from flashrl.controller.controller import Controller
    from flashrl.deadlines import resolve as resolve_deadlines
    from flashrl.metrics import MetricsWriter, SamplesWriter, open_wandb
    from flashrl.moe.routes import capture_routes, route_shape
    from flashrl.vision.model import is_vision_model
    from flashrl.vision.prompts import VisionPrompts

    run_dir = cfg.run_dir
    user_cfg, cfg = cfg, resolve_deadlines(cfg, model_path)  # checkpoints keep the user's (auto stays auto)
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
            record = msgspec.structs.replace(record, memory_gib=round(mem.last_bytes / 2**30, 3),
                                             cpu_s=round(mem.cpu_s, 2))
            writer.write(record)
            history.append(record)
            dash.step(record)

        checkpoints = CheckpointWriter(run_dir / "checkpoints", trainer, to_toml(user_cfg), cfg.run.keep_checkpoints,
                                       last_step=resume.step if resume else None, background=cfg.trainer.checkpoint_async,
                                       timeout_s=cfg.trainer.checkpoint_timeout_s)
        restarter = engines if cfg.engine.max_restarts > 0 else None
        controller = Controller(cfg, tokenizer, suite, clients, trainer, on_step=on_step, on_samples=samples_out.write,
                                restarter=restarter,
                                checkpoints=checkpoints,
                                resume=resume.state if resume else None, teachers=teachers)
        if capture_routes(cfg, model_path):  # the engines capture them (launch/processes.py): checked per answer
            controller.route_shape = route_shape(model_path)
        if is_vision_model(model_path):  # its processor read once, off the loop: tasks' images onto their prompts
            controller.vision = await asyncio.to_thread(VisionPrompts.of, model_path)
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

        refresher = tasks.create_task(_helper("the dashboard refresher", refresh), name="dashboard")
        try:
            result = await controller.run()
        finally:
            if teachers is not None:  # before local_cluster closes the launcher: an engine it stops is no death
                await asyncio.shield(teachers.aclose())
            refresher.cancel()
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
    c = res.get("counters") or {}
    if s.get("resumed_from") is not None and ("resume/restored_groups" in c or "resume/regenerated_tokens" in c):
        # what the resumes (all of them: the counters add up) kept of the untrained work, and generated again
        ck += (f"; resumes kept {c.get('resume/restored_tokens', 0)} generated tokens ({c.get('resume/restored_rollouts', 0)} "
               f"unfinished rollouts continued), {c.get('resume/regenerated_tokens', 0)} generated again")
    if evals and res.get("eval_s"):
        acc += (f"; evals {res['eval_s']:.1f}s, trainer waited {res.get('eval_trainer_wait_s', 0.0):.1f}s for them "
                f"({s.get('eval_wait_share', 0.0):.1%} of training time), generation idle "
                f"{res.get('eval_gen_wait_s', 0.0):.1f}s")
    resumed = f" (resumed from step {s['resumed_from']})" if s.get("resumed_from") is not None else ""
    print(
        f"done: {s['run']} {s['steps']} steps{resumed} in {s['wall_s']:.0f}s; {acc}; "
        f"peak memory {s['peak_mem_gib']:.2f} GiB (all processes){ck}"
    )
