"""The controller: every scheduling decision of a run, in one asyncio process. This module holds the
loops and shutdown; each other job is a part of its own, wired here:

    feed.py        Feed              the admission loop, a group task per prompt, the wait for a batch
    publisher.py   WeightPublisher   prepare, broadcast, verify each version; frees a batch's slots
    supervisor.py  EngineSupervisor  engine deaths, restarts, a restarted engine's catch-up; the watcher
    evals.py       Evals             held-out evals on exactly the evaluated weights
    ledger.py      Ledger            step records, histories, meters, the checkpoint state
    resume.py      restore           a resumed run's state put back (ledger, stream, buffer, rollouts)
    context.py     RolloutContext    what every rollout shares (built complete when run() starts)
    cut.py         CheckpointCut     the training rollouts a partial-mode checkpoint saves, and the cut
    group.py       run_group         one prompt's rollouts (rollout.py: one sample, one trajectory)

    admission loop (feed.py) ──> SampleBuffer <── group task per prompt (group.run_group)
    train loop (host of the task group) ──feed.next_batch(step)──> batch
      waits: for a batch (feed.py), the trainer, the last sync (never for an eval: evals.py)
      0. batch taken (the buffer advances staleness.next_step to step+1): ctx.abort_stale() cancels
         multi-turn rollouts that can no longer pass the staleness bound (core/staleness.py,
         rollout.py), instead of letting them finish
      1. trainer.train_step(batch)  (beside it: the sync of version v, started by the previous step)
      2. wait for that sync (time/sync/wait_s; its error raises here; a version an eval holds back
         is not waited for: publisher.py)
      3. manifest = publisher.prepare(v+1)  (gather + pack: it reads the weights before the next
         step changes them)
      4. version = v+1; publisher.start(v+1): the sync runs as a task of the group
         (weight_sync.overlap; false: the loop waits for it here, the serial order); when every live
         engine holds v+1, buffer.mark_trained(batch) frees the batch's admission slots (the
         staleness bound; a prompt admitted into them generates with v+1)
      5. the step's record goes out (ledger.emit -> on_step) once its sync is done; an eval starts
         when due (step 0, every run.eval_every, the end): it holds the engines at its version while
         the trainer goes on (evals.py; what the loop waited because of it: time/eval_wait_s)
    watch task: supervisor.watch (engines reported dead, a dead trainer rank)

Checkpoints (``checkpoints=`` a checkpoint.CheckpointWriter): after every run.checkpoint_every-th
step (postponed while an eval of older weights runs, by at most async_ratio + 1 steps, then waiting
for it), at the end, and on ``request_stop()`` (Ctrl-C / SIGTERM: the step in progress finishes, a
batch being waited for is given up), the train loop writes the ledger's state + the trainer's DCP
state, after the running sync; a failed write is logged and counted (``checkpoint/failed``) and
training goes on. In partial mode each checkpoint first cuts the training rollouts at their current
tokens (feed.cut) and saves the untrained groups with their prefixes (feed.snapshot), read in the
same synchronous step as the data position; a resume puts them back and continues them. ``resume=`` a ControllerState continues a run: same version, counters and
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
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from flashrl.aio import shielded, supervised
from flashrl.checkpoint import ControllerState, RolloutSnapshot
from flashrl.config import Config
from flashrl.controller.buffer import Group, SampleBuffer
from flashrl.controller.context import RolloutContext
from flashrl.controller.cut import CheckpointCut
from flashrl.controller.evals import Evals
from flashrl.controller.feed import Feed
from flashrl.controller.ledger import Ledger, RunMeters, RunSummary
from flashrl.controller.publisher import WeightPublisher
from flashrl.controller.resume import Restored, restore
from flashrl.controller.scheduler import Admission, DataStream, Router
from flashrl.controller.supervisor import EngineSupervisor
from flashrl.controller.types import Published
from flashrl.core.records import StepRecord
from flashrl.core.staleness import Staleness
from flashrl.env import Closable, EnvSuite
from flashrl.interfaces import EngineClient, EngineRestarter, Tokenizer, TrainerClient
from flashrl.metrics import Snapshot
from flashrl.moe.routes import RouteShape
from flashrl.wire.protocol import TrainBatch

__all__ = ["Controller", "RunSummary"]

log = logging.getLogger(__name__)

SUITE_CLOSE_TIMEOUT_S = 30.0  # bound on suite.aclose() at shutdown


class Controller:
    """Drives one run: admission, rollouts, batches, training steps, weight syncs, evals.

    ``tokenizer``: an interfaces.Tokenizer (a ChatTokenizer renders turns itself). ``on_step``
    receives one flashrl.core.records.StepRecord per step (ledger.Ledger.step_record).
    """

    # made when run() starts (the meters read the loop's clock at once; the context, the evals and
    # the feed are built complete, with them)
    meters: RunMeters
    ctx: RolloutContext
    evals: Evals
    feed: Feed

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
        teachers: Any | None = None,
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
        self.teachers = teachers  # on-policy distillation (flashrl/distill): scores every finished training rollout
        self.counters: Counter[str] = Counter()
        self.version = 0
        self.router = Router(len(engines), cfg.engine.max_num_seqs)
        self.route_shape: RouteShape | None = None  # set before run() when the engines capture MoE routes
        self.vision: Any = None  # set before run() for a vision-language policy (flashrl/vision/prompts.py)
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
            # scheduler.drain: admit no more than the run trains, so nothing is left generating at its end
            total_steps=cfg.run.steps if cfg.scheduler.drain else None,
            lending=lambda: self.publisher.held if cfg.scheduler.lends_slots and self.publisher.defers else None,
        )
        self.admission = Admission(cfg.scheduler.queue_scheduling)
        self.stream = DataStream(suite.train_tasks(), cfg.run.seed)
        self.eval_tasks = list(suite.eval_tasks())
        self.ledger = Ledger(cfg, suite, tokenizer, self.counters, on_step, counting=[teachers] if teachers else [])
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
        self._ran = False
        self._t0 = 0.0
        self._t_end: float | None = None  # set when run() ends (the clock then stops there)
        # Checkpoints (flashrl/checkpoint.py): a CheckpointWriter, or None (no checkpoints: tests, bench).
        self.checkpoints = checkpoints
        self._stop_requested = False
        # a resumed run's untrained groups still generating and their unfinished rollouts (to the feed)
        self._restored: Restored = []
        if resume is not None:  # resume.py: the ledger, the stream, the buffer and the staleness rule continue
            self.version = self.published.version = resume.version
            self._restored = restore(resume, cfg, self.stream, self.buffer, self.staleness, self.ledger, self.counters)

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
            # a checkpoint keeps the unfinished rollouts (partial mode): they are cut at each one
            cut=CheckpointCut(self.engines, self.counters)
            if self.checkpoints is not None and self.staleness.mode == "partial" else None,
            on_engine_dead=self.supervisor.engine_dead,
            wait_engine=self.supervisor.wait_engine if self.supervisor.restarts else None,
            teachers=self.teachers,
            routes=self.route_shape,
            vision=self.vision,
        )
        self.evals = Evals(self.cfg, self.eval_tasks, self.ctx, self.ledger, self.publisher, clock=self._clock,
                           spawn=self._spawn, on_samples=self.on_samples)
        self.feed = Feed(self.cfg, self.buffer, self.stream, self.admission, self.ctx, self.meters, self.evals,
                         self.publisher, clock=self._clock, spawn=self._spawn, stopped=lambda: self._stop_requested)
        self.feed.restored, self._restored = self._restored, []
        stop = "steps"
        try:
            if self.ledger.resumed_from is not None:
                # The engines started from the base model: publish the checkpoint's weights (its version)
                # before the first request, so every sample is generated by the policy it is labelled with.
                self.status = "loading checkpoint weights"
                await self.publisher.sync_now(self.version)
            async with supervised() as tg:  # a lone error (or one seen by several tasks) raises as itself
                self._tg = tg
                self.supervisor.start()
                self._spawn(self.feed.admission_loop(), "admission")
                self._spawn(self.supervisor.watch(), "watch")
                self.status = "running"
                log.info("controller running: first rollouts requested")  # start-up ends here (bench steptime)
                stop = await self._train_loop()
                # close -> cancel -> wait: no new work, cancel every task, the group waits for all.
                self.status = "stopping"
                self.feed.close()
                self.supervisor.stop()
                for t in list(self._tasks):
                    t.cancel()
        except BaseException:
            self.status = "crashed"
            raise
        finally:
            self._tg = None
            self.supervisor.stop()
            if self.checkpoints is not None:
                # a background checkpoint still in flight (a crash, Ctrl-C mid-write): let it complete, bounded;
                # past its deadline it stays incomplete and the one before stays the latest
                await shielded(self.checkpoints.close(), self.checkpoints.timeout_s + 60.0)
            self._t_end = self._loop.time()
            await self._close_suite()
        self.status = "done"
        checkpoints = self.checkpoints
        summary = self.ledger.summary(
            version=self.version, elapsed=self._clock() - self._t0, stop=stop,  # the clock stopped at the run's end
            checkpoints=checkpoints.saved if checkpoints is not None else 0,
            checkpoint_s=checkpoints.seconds if checkpoints is not None else 0.0,
        )
        summary.eval_s = self.evals.total_s
        summary.eval_trainer_wait_s = self.evals.trainer_wait_s
        summary.eval_gen_wait_s = self.evals.gen_wait_s
        return summary

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
        checkpoint_due: int | None = None  # the step a checkpoint is postponed from (an eval was running)
        try:
            for s in range(self.version, cfg.run.steps):
                batch = None if self._stop_requested else await self.feed.next_batch(s, deadline)
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
                    checkpoint_due = self.version
                # An eval of older weights than a checkpoint's cannot wait in it (ledger.state: a resumed
                # run evaluates its own weights): the checkpoint is postponed while one runs, not for long.
                if checkpoint_due is not None and (
                        not self._older_eval() or self.version - checkpoint_due > self.staleness.async_ratio):
                    checkpoint_due = None
                    await self._checkpoint(held)  # its time shows in the next step's time/step_s
            # Every eval started ends, and the last weights reach the engines, before the end (the final
            # eval, the checkpoint). Ctrl-C / SIGTERM: no final eval, but a running one ends first: its
            # record, of older weights than the checkpoint's, could not wait in it (ledger.state).
            if stop == "interrupted":
                if held is not None:
                    self.publisher.release(held)
                    held = None
            elif held is not None:
                # Stopped by max_time while waiting for a batch: evaluate the final weights, in the
                # record of the step that made them.
                self.evals.start(held, self.version)
                held = None
            await self._drain()
            await self._checkpoint(None, final=True)
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

    def _older_eval(self) -> bool:
        """Whether an eval of older weights than the trainer's runs (or waits to)."""
        return any(v < self.version for v in self.publisher.holds)

    async def _drain(self) -> None:
        """Wait for every eval started and then for the newest version on the engines."""
        await self.evals.quiesce()
        await self.publisher.flush()

    async def _train_step(self, s: int, batch: list[Group], last_end: float) -> StepRecord:
        """Train ``batch`` as step ``s`` and start publishing version s+1; the step's record.

        weight_sync.overlap (default): the sync of s+1 (the broadcast and every engine's load) runs
        beside the next step's training; this step waits only for the previous sync (``time/sync/wait_s``)
        and for the prepare (the gather and pack must read the weights before the next step changes them).
        The batch's slots are freed (buffer.mark_trained) when the sync is done, so a prompt admitted
        into them generates with version s+1, as in the serial order (overlap = false)."""
        samples = [t for g in batch for t in g.samples]
        t0 = self._clock()
        result = await self.trainer.train_step(TrainBatch(step=s, samples=list(samples)))
        train_s = self._clock() - t0
        p = self.publisher.pending
        # version s on every engine (it ran beside this step's training), unless an eval holds it back;
        # blocked: an eval due for it waits for the running one
        with self.evals.trainer_waits(blocked=p is not None and p.deferred and p.pinned):
            wait_s = await self.publisher.wait()
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
                                         elapsed=self._clock() - self._t0, sync={"wait_s": wait_s, **phases})
        assert record.batch is not None
        record.batch.eval_wait_s = self.evals.take_step_wait()  # since the last step's (its checkpoint's too)
        if self.checkpoints is not None:
            record.batch.ckpt_write_s = self.checkpoints.take_write_s()  # background writes done since the last step
        self.publisher.attach(pending, record)
        return record

    # ------------------------------------------------------------------ checkpoints
    async def _checkpoint(self, held: StepRecord | None, final: bool = False) -> None:
        """Write a checkpoint of the current version (flashrl/checkpoint.py); a failure is logged,
        counted (``checkpoint/failed``) and survived: the previous checkpoint stays the latest.

        Partial mode: the training rollouts are cut at their current tokens first (feed.cut), and the
        snapshot of the untrained work is read with the rest of the state in one synchronous step, so
        the data position, the trained steps and the saved prefixes agree. Then they continue from
        their prefixes, unless ``final`` (the run ends: they stay stopped, so what the snapshot holds
        is all they generated).

        With trainer.checkpoint_async this returns once the trainer has staged its state; the write
        completes beside the next steps and is recorded (``ledger.last_checkpoint``) when complete.
        ``final``: the call returns only when it (and any write before it) is done."""
        if self.checkpoints is None:
            return
        if self.version == 0:
            if final:
                await self.checkpoints.wait()
            return
        # A checkpoint's weights are the engines' too (a resumed run publishes them), and no eval of
        # older weights runs (its record could not wait in the checkpoint: ledger.state); an eval of
        # this version may (its record waits in the checkpoint, pending_eval).
        if self._older_eval():
            with self.evals.trainer_waits(blocked=True):  # an eval-caused wait of the next step
                await self._drain()
        else:
            await self.publisher.wait()
        try:
            t0 = self._clock()
            unsettled = await self.feed.cut()
            cut = self.feed.snapshot(self.version, unsettled)
            state = self.state(held, cut)
        finally:
            if not final:
                self.feed.go_on()
        snap = cut[0]
        log.info("checkpoint of step %d: %d untrained groups saved (%d finished samples, %d unfinished rollouts, %d "
                 "generated tokens) after a %.3f s cut; %d groups to re-admit, %d tokens that a resume generates again",
                 self.version, len(snap.groups), sum(len(g.samples) for g in snap.groups),
                 sum(len(g.unfinished) for g in snap.groups),
                 sum(len(t.response_ids) for g in snap.groups for t in (*g.samples, *g.unfinished)),
                 self._clock() - t0, len(cut[1]), snap.regenerated_tokens)
        status, self.status = self.status, f"checkpointing step {state.step}"
        try:
            await self.ledger.save(self.checkpoints, state, self._clock, wait=final)
        finally:
            self.status = status

    def state(self, held: StepRecord | None = None, cut: tuple[RolloutSnapshot, list[int]] | None = None) -> ControllerState:
        """The controller's part of a checkpoint at the current version (call between steps; ledger.Ledger.state;
        ``cut``: feed.Feed.snapshot's, taken in the same step)."""
        eval_record = self.evals.record if self._ran else None
        return self.ledger.state(self.version, self._clock() - self._t0, held, eval_record, self.stream, self.buffer, cut)

    # ------------------------------------------------------------------ the dashboard
    def snapshot(self) -> Snapshot:
        """The dashboard's view right now (cheap; call it as often as you redraw; ledger.Ledger.snapshot).

        Rates and busy fractions are over the last RATE_WINDOW_S seconds of the loop clock; after
        run() has ended, the clock stops at its end, so they read as they were at the end.
        """
        now = self._clock()
        snap = self.ledger.snapshot(now=now, elapsed=max(now - self._t0, 0.0), version=self.version, status=self.status,
                                    engines=self.engines, engine_versions=self.engine_versions, router=self.router,
                                    buffer=self.buffer, last_sync_s=self.publisher.last_sync_s)
        if self._ran:  # the evals exist once run() started
            snap.eval_s, snap.eval_trainer_wait_s = self.evals.total_s, self.evals.trainer_wait_s
            snap.eval_gen_wait_s, snap.eval_running = self.evals.gen_wait_s, self.evals.running
        return snap

