"""The controller: every scheduling decision of a run, in one asyncio process. This module holds the
loops and shutdown; each other job is a part of its own, wired here:

    publisher.py   WeightPublisher   prepare, broadcast, verify each version; frees a batch's slots
    supervisor.py  EngineSupervisor  engine deaths, restarts, a restarted engine's catch-up; the watcher
    evals.py       Evals             held-out evals on exactly the evaluated weights
    ledger.py      Ledger            step records, histories, meters, the checkpoint state
    rollout.py     RolloutContext    what every rollout shares (built complete when run() starts)

    admission loop ──admit(uid, task)──> SampleBuffer ──> group task per prompt (rollout.run_group)
      waits: buffer.changed()              ^   |              rollouts -> engines (Router)
      admits: Admission.admit_count()      |   |              each ok sample -> buffer.add() at once
                                           |   v
    train loop (host of the task group)  take_batch(step) ── stale samples -> refill group task (stale = drop)
      waits: buffer.changed() for a batch (stale = wait: also while a due group is still generating),
             the trainer, the eval of the current weights, the last sync
      0. batch taken (the buffer advances staleness.next_step to step+1): ctx.abort_stale() cancels
         multi-turn rollouts that can no longer pass the staleness bound (core/staleness.py,
         rollout.py), instead of letting them finish
      1. trainer.train_step(batch)  (beside it: the sync of version v, started by the previous step)
      2. wait for that sync (time/sync/wait_s; its error raises here), and for a running eval
      3. manifest = publisher.prepare(v+1)  (gather + pack: it reads the weights before the next
         step changes them)
      4. version = v+1; publisher.start(v+1): the sync runs as a task of the group
         (weight_sync.overlap; false: the loop waits for it here, the serial order); when every live
         engine holds v+1, buffer.mark_trained(batch) frees the batch's admission slots (the
         staleness bound; a prompt admitted into them generates with v+1)
      5. the step's record goes out (ledger.emit -> on_step) once its sync is done; an eval starts
         when due (step 0, every run.eval_every, the end)
    watch task: supervisor.watch (engines reported dead, a dead trainer rank)

Checkpoints (``checkpoints=`` a checkpoint.CheckpointWriter): after every run.checkpoint_every-th
step, at the end, and on ``request_stop()`` (Ctrl-C / SIGTERM: the step in progress finishes, a
batch being waited for is given up), the train loop writes the ledger's state + the trainer's DCP
state, after the running sync; a failed write is logged and counted (``checkpoint/failed``) and
training goes on. ``resume=`` a ControllerState continues a run: same version, counters and
history, the stream re-admits the prompts that were outstanding, and run() publishes the
checkpoint's weights before any request.

Records: exactly one per step (plus step 0's eval), so metrics.jsonl has one line per step. With
run.max_time_s set, a step's record that carries no eval is held until the next batch is in hand:
if the deadline comes first, the final eval is merged into that record instead of a second line.

All tasks live in one asyncio.TaskGroup (each group task runs its rollouts as its own tasks and
never returns before they have ended). Shutdown is close -> cancel -> wait: admission and restarts
stop, every task of the group is cancelled (every cancelled generate sends engine.abort; every env
is closed, shielded), then the group exits only when every task has. A crash in any task cancels
the others the same way and run() re-raises that error. Engines and the trainer are closed by
whoever created them (the launcher), never here; the environment suite's own resources
(``aclose()``, e.g. a remote worker pool) are released here, after the task group, shielded, on
every path. Time is the event loop's (``loop.time()``), so the simulator runs this same code on a
virtual clock. Plain asyncio rather than anyio: the per-sample path must cost tens of microseconds
(rollout.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from flashrl.aio import shielded
from flashrl.checkpoint import ControllerState
from flashrl.config import Config
from flashrl.controller.buffer import Group, GroupState, SampleBuffer
from flashrl.controller.evals import Evals
from flashrl.controller.ledger import Ledger, RunMeters, RunSummary
from flashrl.controller.publisher import WeightPublisher
from flashrl.controller.rollout import RolloutContext, run_group
from flashrl.controller.scheduler import Admission, DataStream, Router
from flashrl.controller.supervisor import EngineSupervisor
from flashrl.controller.types import Published, Trajectory
from flashrl.core.records import StepRecord
from flashrl.core.staleness import Staleness
from flashrl.env import Closable, EnvSuite
from flashrl.interfaces import EngineClient, EngineRestarter, Tokenizer, TrainerClient
from flashrl.metrics import Snapshot
from flashrl.wire.protocol import TrainBatch

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Controller", "RunSummary"]

log = logging.getLogger(__name__)

SUITE_CLOSE_TIMEOUT_S = 30.0  # bound on suite.aclose() at shutdown


class Controller:
    """Drives one run: admission, rollouts, batches, training steps, weight syncs, evals.

    ``tokenizer``: an interfaces.Tokenizer (a ChatTokenizer renders turns itself). ``on_step``
    receives one flashrl.core.records.StepRecord per step (ledger.Ledger.step_record).
    """

    # made when run() starts (the meters read the loop's clock at once; the context and the evals
    # are built complete, with them)
    meters: RunMeters
    ctx: RolloutContext
    evals: Evals

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        suite: EnvSuite,
        engines: Sequence[EngineClient],
        trainer: TrainerClient,
        on_step: Callable[[StepRecord], None] | None = None,
        on_samples: Callable[[list[dict[str, Any]]], None] | None = None,
        *,
        restarter: EngineRestarter | None = None,
        checkpoints: Any | None = None,
        resume: ControllerState | None = None,
    ) -> None:
        if not engines:
            raise ValueError("Controller needs at least one engine (engine.count >= 1)")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.suite = suite
        self.engines = list(engines)  # shared with the supervisor and the publisher: a restart replaces one
        self.engine_versions = [0] * len(engines)
        self.trainer = trainer
        self.on_samples = on_samples  # readable rollouts for samples.jsonl (log.samples_per_step, log.eval_samples)
        self.counters: Counter[str] = Counter()
        self.version = 0
        self.router = Router(len(engines), cfg.engine.max_num_seqs)
        # THE staleness rule of this run: the buffer applies it (and advances next_step as it hands
        # out batches), the rollouts' early abort and the step records read it.
        self.staleness = Staleness(cfg.scheduler.async_ratio, mode=cfg.scheduler.stale)
        self.buffer = SampleBuffer(
            group_size=cfg.rollout.group_size,
            batch_prompts=cfg.rollout.batch_prompts,
            staleness=self.staleness,
            ordered=not cfg.scheduler.queue_scheduling,
            filter_ties=cfg.algorithm.filter_ties,
            counters=self.counters,
            version=lambda: self.published.version,  # wait's deadlines, partial's bound (set just below)
        )
        self.admission = Admission(cfg.scheduler.queue_scheduling)
        self.stream = DataStream(suite.train_tasks(), cfg.run.seed)
        self.eval_tasks = list(suite.eval_tasks())
        self.ledger = Ledger(cfg, suite, tokenizer, self.counters, on_step)
        # the weights every live engine holds (their version: a lower bound on a new token's version)
        self.published = Published()
        self.supervisor = EngineSupervisor(cfg, self.engines, self.engine_versions, self.router, self.counters,
                                           trainer, restarter, self.published, self._spawn)
        self.publisher = WeightPublisher(cfg, trainer, self.engines, self.engine_versions, self.router, self.counters,
                                         self.published, self.supervisor, clock=self._clock, spawn=self._spawn,
                                         on_synced=self.buffer.mark_trained, emit=self.ledger.emit)
        self.status = "starting"
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # the group's live tasks (cancelled at shutdown)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._ran = False
        self._t0 = 0.0
        self._t_end: float | None = None  # set when run() ends (the clock then stops there)
        # Checkpoints (flashrl/checkpoint.py): a CheckpointWriter, or None (no checkpoints: tests, bench).
        self.checkpoints = checkpoints
        self._stop_requested = False
        if resume is not None:
            self._restore(resume)

    @property
    def on_step(self) -> Callable[[StepRecord], None] | None:
        """Receives every step record (settable until the run's first record)."""
        return self.ledger.on_step

    @on_step.setter
    def on_step(self, fn: Callable[[StepRecord], None] | None) -> None:
        self.ledger.on_step = fn

    # ------------------------------------------------------------------ run and shutdown
    async def run(self) -> RunSummary:
        if self._ran:
            raise RuntimeError("Controller.run() can only be called once; build a new Controller")
        self._ran = True
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time() - self.ledger.elapsed_before  # resumed: elapsed time continues
        self.meters = self.ledger.meters = RunMeters(len(self.engines), self._clock, self._t0)
        self.ctx = RolloutContext(
            cfg=self.cfg,
            tokenizer=self.tokenizer,
            suite=self.suite,
            engines=self.engines,
            router=self.router,
            version=lambda: self.published.version,
            counters=self.counters,
            busy=self.meters.busy,
            token_rates=self.meters.tokens,
            staleness=self.staleness,
            on_engine_dead=self.supervisor.engine_dead,
            wait_engine=self.supervisor.wait_engine if self.supervisor.restarts else None,
        )
        self.evals = Evals(self.cfg, self.eval_tasks, self.ctx, self.ledger, self.publisher, clock=self._clock,
                           spawn=self._spawn, on_samples=self.on_samples)
        stop = "steps"
        try:
            if self.ledger.resumed_from is not None:
                # The engines started from the base model: publish the checkpoint's weights (its version)
                # before the first request, so every sample is generated by the policy it is labelled with.
                self.status = "loading checkpoint weights"
                await self.publisher.sync_now(self.version)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self.supervisor.start()
                self._spawn(self._admission_loop(), "admission")
                self._spawn(self.supervisor.watch(), "watch")
                self.status = "running"
                log.info("controller running: first rollouts requested")  # start-up ends here (bench steptime)
                stop = await self._train_loop()
                # close -> cancel -> wait: no new work, cancel every task, the group waits for all.
                self.status = "stopping"
                self._closing = True
                self.supervisor.stop()
                for t in list(self._tasks):
                    t.cancel()
        except BaseExceptionGroup as eg:
            self.status = "crashed"
            errors = [e for e in _leaves(eg) if not isinstance(e, asyncio.CancelledError)]
            if len({(type(e), str(e)) for e in errors}) == 1:  # one failure, seen by several tasks
                raise errors[0] from None
            raise
        except BaseException:
            self.status = "crashed"
            raise
        finally:
            self._tg = None
            self.supervisor.stop()
            self._t_end = self._loop.time()
            await self._close_suite()
        self.status = "done"
        checkpoints = self.checkpoints
        return self.ledger.summary(
            version=self.version, elapsed=self._clock() - self._t0, stop=stop,  # the clock stopped at the run's end
            checkpoints=checkpoints.saved if checkpoints is not None else 0,
            checkpoint_s=checkpoints.seconds if checkpoints is not None else 0.0,
        )

    async def _close_suite(self) -> None:
        """``await suite.aclose()`` when the suite has one (flashrl.env.Closable): shielded and bounded, never
        masking a crash."""
        if not isinstance(self.suite, Closable):
            return
        try:
            finished = await shielded(self.suite.aclose(), SUITE_CLOSE_TIMEOUT_S)
        except asyncio.CancelledError:
            # Cancelled while closing: the close still ran (bounded). Re-deliver the cancel at the
            # caller's next await rather than raise it here, over a crash that may be propagating.
            task = asyncio.current_task()
            if task is not None:
                task.cancel()
            return
        except Exception as e:  # the run's own outcome matters more than a failed cleanup
            self.counters["env/close_failed"] += 1
            log.error("environment suite aclose() failed: %s; its workers may still be running", e)
            return
        if not finished:
            self.counters["env/close_timeout"] += 1
            log.error("environment suite aclose() took longer than %.0f s; gave up waiting", SUITE_CLOSE_TIMEOUT_S)

    def _clock(self) -> float:
        """The loop's clock during run(); frozen at the run's start before it and at its end after."""
        if not self._ran:
            return self._t0
        if self._t_end is not None:
            return self._t_end
        assert self._loop is not None
        return self._loop.time()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Start ``coro`` in the run's task group; tracked so that shutdown can cancel it."""
        assert self._tg is not None
        t = self._tg.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ------------------------------------------------------------------ admission and groups
    async def _admission_loop(self) -> None:
        assert self._loop is not None
        loop = self._loop
        while not self._closing:
            b = self.buffer
            for _ in range(self.admission.admit_count(b.outstanding, b.capacity, b.generating)):
                uid, task = self.stream.next()
                g = b.admit(uid, task, loop.time())
                self._launch(g, g.need)
            await b.changed()

    def _launch(self, g: Group, need: int) -> None:
        extra = self.cfg.rollout.redundancy
        first = self.buffer.start(g, need + extra)
        self._spawn(self._group_task(g, need, first, extra), f"group {g.uid}")

    async def _group_task(self, g: Group, need: int, first: int, extra: int) -> None:
        ok = await run_group(
            self.ctx,
            task=g.task,
            group=g.uid,
            need=need,
            first_index=first,
            extra=extra,
            temperature=self.cfg.rollout.temperature,
            on_sample=self._on_sample,
        )
        if not ok and g.state is GroupState.RUNNING:
            log.info("group %d dropped: fewer than %d rollouts succeeded", g.uid, need)
            self.buffer.drop(g, "unfillable")

    def _on_sample(self, t: Trajectory) -> None:
        if self.buffer.add(t, self._clock()):
            self.meters.samples.add()

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> str:
        cfg = self.cfg
        deadline = self._t0 + cfg.run.max_time_s if cfg.run.max_time_s > 0 else math.inf
        if self.ledger.resumed_from is None:
            self.evals.start(StepRecord(step=0, version=0), self.version)
        elif self.ledger.pending is not None:
            # the checkpoint's own step record was not written yet: write it now (evaluated, if it was
            # waiting for its eval: the weights are the checkpoint's, so it is the same evaluation)
            record, wants_eval = self.ledger.pending
            self.ledger.pending = None
            if wants_eval:
                self.evals.start(record, self.version)
            else:
                self.ledger.emit(record)
        last_end = self._clock()
        stop = "steps"
        every = cfg.run.checkpoint_every
        # A step record without an eval, held (only when a deadline is set) until the next batch is
        # in hand: should the deadline come first, the final eval goes into it, not into a 2nd line.
        held: StepRecord | None = None
        try:
            for s in range(self.version, cfg.run.steps):
                batch = None if self._stop_requested else await self._next_batch(s, deadline)
                if batch is None:
                    stop = "interrupted" if self._stop_requested else "max_time"
                    break
                if held is not None:
                    self.publisher.release(held)
                    held = None
                record = await self._train_step(s, batch, last_end)
                last_end = now = self._clock()
                final = s + 1 == cfg.run.steps or now >= deadline
                if (cfg.run.eval_every and self.version % cfg.run.eval_every == 0) or final:
                    self.evals.start(record, self.version)
                elif deadline < math.inf:
                    held = record
                else:
                    self.publisher.release(record)
                if now >= deadline:
                    stop = "max_time"
                    break
                if every and self.version % every == 0 and not final and not self._stop_requested:
                    await self._checkpoint(held)  # its time shows in the next step's time/step_s
            await self.publisher.wait()  # the last weights reach the engines before the end (eval, checkpoint)
            if stop == "interrupted":
                # Ctrl-C / SIGTERM: no final eval. A step record still waiting for its eval goes into
                # the checkpoint; the resumed run evaluates those same weights and writes it then.
                if held is not None:
                    self.publisher.release(held)
                    held = None
            else:
                if held is not None:
                    # Stopped by max_time while waiting for a batch: evaluate the final weights, in the
                    # record of the step that made them.
                    self.evals.start(held, self.version)
                    held = None
                await self.evals.quiesce()
            await self._checkpoint(None)
        finally:
            if held is not None:  # crashed or cancelled while waiting: the step still gets its line
                self.ledger.emit(held)
        return stop

    def request_stop(self) -> None:
        """Stop soon and cleanly (Ctrl-C / SIGTERM): finish the step in progress, checkpoint, return.

        A batch being waited for is given up; a training step or weight sync in progress completes
        first (the trainer cannot be interrupted mid-update without losing the step).
        """
        self._stop_requested = True
        self.buffer.wake()

    async def _train_step(self, s: int, batch: list[Group], last_end: float) -> StepRecord:
        """Train ``batch`` as step ``s`` and start publishing version s+1; the step's record.

        weight_sync.overlap (default): the sync of s+1 (the broadcast and every engine's load) runs
        beside the next step's training; this step waits only for the previous sync (``time/sync/wait_s``)
        and for the prepare (the gather and pack must read the weights before the next step changes them).
        The batch's slots are freed (buffer.mark_trained) when the sync is done, so a prompt admitted
        into them generates with version s+1, as in the serial order (overlap = false)."""
        samples = [t for g in batch for t in g.samples]
        t0 = self._clock()
        result = await self.trainer.train_step(TrainBatch(step=s, samples=[t.to_train_sample() for t in samples]))
        train_s = self._clock() - t0
        wait_s = await self.publisher.wait()  # version s on every engine (it ran beside this step's training)
        tq = self._clock()
        await self.evals.quiesce()  # eval tokens must all come from the weights being evaluated
        t1 = self._clock()
        manifest, phases = await self.publisher.prepare(s + 1)
        # now, before rollouts are dispatched to a dead engine meanwhile
        self.supervisor.mark_reported_dead("weight_sync/found_dead_engines")
        self.version = s + 1
        pending = self.publisher.start(s + 1, batch, manifest, t1)
        if not self.cfg.weight_sync.overlap:
            wait_s += await self.publisher.wait()
        now = self._clock()
        if self.on_samples is not None and self.cfg.log.samples_per_step:
            # the trainer's per-sample behaviour weights, in the batch's sample order (empty: not reported)
            iw = dict(zip((t.sample_id for t in samples), result.sample_iw))
            self.on_samples(self.ledger.train_lines(s + 1, batch, iw))
        record = self.ledger.step_record(s, self.version, batch, result.metrics, step_s=now - last_end, train_s=train_s,
                                         elapsed=self._clock() - self._t0, sync={"quiesce_s": t1 - tq, "wait_s": wait_s, **phases})
        self.publisher.attach(pending, record)
        return record

    async def _next_batch(self, step: int, deadline: float) -> list[Group] | None:
        try:
            async with asyncio.timeout_at(deadline if math.isfinite(deadline) else None):
                while not self._stop_requested:
                    batch, refills = self.buffer.take_batch(step)
                    for g in refills:
                        self._launch(g, g.missing)
                    if batch is not None:
                        # From now on only steps > ``step`` can take a sample (staleness.next_step):
                        # cancel the rollouts this already makes too stale, rather than finish them.
                        self.ctx.abort_stale()
                        return batch
                    await self.buffer.changed()
                return None
        except TimeoutError:
            return None

    # ------------------------------------------------------------------ checkpoints
    async def _checkpoint(self, held: StepRecord | None) -> None:
        """Write a checkpoint of the current version (flashrl/checkpoint.py); a failure is logged,
        counted (``checkpoint/failed``) and survived: the previous checkpoint stays the latest."""
        if self.checkpoints is None or self.version == 0:
            return
        await self.publisher.wait()  # a checkpoint's weights are the engines' too (a resumed run publishes them)
        state = self.state(held)
        status, self.status = self.status, f"checkpointing step {state.step}"
        try:
            await self.ledger.save(self.checkpoints, state, self._clock)
        finally:
            self.status = status

    def state(self, held: StepRecord | None = None) -> ControllerState:
        """The controller's part of a checkpoint at the current version (call between steps; ledger.Ledger.state)."""
        eval_record = self.evals.record if self._ran else None
        return self.ledger.state(self.version, self._clock() - self._t0, held, eval_record, self.stream, self.buffer)

    def _restore(self, st: ControllerState) -> None:
        if st.train_size != self.stream.size or st.seed != self.cfg.run.seed:
            raise ValueError(
                f"checkpoint does not match this run's data: train split of {st.train_size} tasks with seed "
                f"{st.seed}, this run has {self.stream.size} with seed {self.cfg.run.seed} (env.params / run.seed changed?)"
            )
        self.version = self.published.version = st.version
        self.ledger.restore(st)
        self.staleness.next_step = st.step  # the next batch is step ``st.step``
        self.stream.restore(st.next_uid, st.readmit)
        self.buffer.dropped_uids = list(st.dropped_uids)

    # ------------------------------------------------------------------ the dashboard
    def snapshot(self) -> Snapshot:
        """The dashboard's view right now (cheap; call it as often as you redraw; ledger.Ledger.snapshot).

        Rates and busy fractions are over the last RATE_WINDOW_S seconds of the loop clock; after
        run() has ended, the clock stops at its end, so they read as they were at the end.
        """
        now = self._clock()
        return self.ledger.snapshot(now=now, elapsed=max(now - self._t0, 0.0), version=self.version, status=self.status,
                                    engines=self.engines, engine_versions=self.engine_versions, router=self.router,
                                    buffer=self.buffer, last_sync_s=self.publisher.last_sync_s)


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]
