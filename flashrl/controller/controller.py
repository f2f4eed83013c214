"""The controller: every scheduling decision of a run, in one asyncio process.

    admission loop ──admit(uid, task)──> SampleBuffer ──> group task per prompt (rollout.run_group)
      waits: buffer.changed()              ^   |              rollouts -> engines (Router)
      admits: Admission.admit_count()      |   |              each ok sample -> buffer.add() at once
                                           |   v
    train loop (host of the task group)  take_batch(step) ── stale samples -> refill group task
      waits: buffer.changed() for a batch, the trainer, the eval of the current weights, the last sync
      0. batch taken (the buffer advances staleness.next_step to step+1): ctx.abort_stale() cancels
         multi-turn rollouts that can no longer pass the staleness bound (core/staleness.py,
         rollout.py), instead of letting them finish
      1. trainer.train_step(batch)  (beside it: the sync of version v, started by the previous step)
      2. wait for that sync (time/sync/wait_s; its error raises here), and for a running eval
      3. manifest = trainer.prepare_weights(v+1)  (gather + pack: it reads the weights before the
         next step changes them)
      4. version = v+1; the sync of v+1 starts as a task of the group (weight_sync.overlap; false: the
         loop waits for it here, the serial order): engines whose client already reports ``dead``
         are marked dead and skipped (counted); trainer.send_weights(v+1) || engine.update_weights
         for every live engine; then buffer.mark_trained(batch) (frees admission slots: the staleness
         bound; a prompt admitted into them generates with v+1) and the record gets the sync's times
      5. on_step(record: core.records.StepRecord) (when its sync is done); start an eval task when due
    eval task (step 0, every run.eval_every, end): waits for the sync of its version, then one greedy
      rollout per held-out task, through the same Router as training rollouts; the record of that
      step is emitted when it finishes, and the next weight sync waits for it so that every eval
      token comes from the evaluated weights. Checkpoints, the end of the run and an engine's
      catch-up (the sync lock) wait for a running sync too.

Checkpoints (``checkpoints=`` a checkpoint.CheckpointWriter): after every run.checkpoint_every-th
step, at the end, and on ``request_stop()`` (Ctrl-C / SIGTERM: the step in progress finishes, a
batch being waited for is given up), the train loop writes ``state()`` + the trainer's DCP state; a
failed write is logged and counted (``checkpoint/failed``) and training goes on. ``resume=`` a
ControllerState continues a run: same version, counters and history, the stream re-admits the
prompts that were outstanding, and run() publishes the checkpoint's weights before any request.

Records: exactly one per step (plus step 0's eval), so metrics.jsonl has one line per step. With
run.max_time_s set, a step's record that carries no eval is held until the next batch is in hand:
if the deadline comes first, the final eval is merged into that record instead of a second line.

Dashboard numbers are the controller's own, on the loop clock: per engine, the busy fraction
(share of the last 10 s with >= 1 generate in flight, core.meters.BusyMeter) and generated tokens/s;
overall, samples/s (training samples delivered to the buffer) and tokens/s, all over a 10 s window
(core.meters.RateMeter). Step records also carry the run averages (run/samples_per_s, run/tokens_per_s).

All tasks live in one asyncio.TaskGroup (each group task runs its rollouts as its own tasks and
never returns before they have ended). Shutdown is close -> cancel -> wait: admission stops, every
task of the group is cancelled (every cancelled generate sends engine.abort; every env is closed,
shielded), then the group exits only when every task has. A crash in any task cancels the
others the same way and run() re-raises that error. Engines and the trainer are closed by whoever
created them (the launcher), never here; the environment suite's own resources (``aclose()``, e.g.
a remote worker pool) are released here, after the task group, shielded, on every path. Time is
the event loop's (``loop.time()``), so the simulator runs this same code on a virtual clock.
Plain asyncio rather than anyio: the per-sample path must cost tens of microseconds (rollout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from flashrl.aio import shielded, timeout
from flashrl.checkpoint import CheckpointError, ControllerState
from flashrl.config import Config
from flashrl.controller.buffer import Group, GroupState, SampleBuffer
from flashrl.controller.rollout import RolloutContext, Trajectory, run_group
from flashrl.controller.scheduler import Admission, DataStream, Router
from flashrl.core.meters import BusyMeter, RateMeter
from flashrl.core.records import BatchStats, EvalStats, StepRecord
from flashrl.core.staleness import Staleness, lag_stats
from flashrl.env import Closable, Counting, EnvSuite
from flashrl.interfaces import EngineClient, EngineRestarter, Tokenizer, TrainerClient
from flashrl.metrics import EngineStat, Snapshot
from flashrl.wire.protocol import TrainBatch, WeightManifest, WeightsUpdated
from flashrl.wire.transport import PeerDead, RemoteError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Controller", "RunSummary"]

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0  # dashboard rates and busy fractions: "now", not since the start of the run
SUITE_CLOSE_TIMEOUT_S = 30.0  # bound on suite.aclose() at shutdown
WATCH_S = 0.5  # how often the controller looks for engines reported dead and for a dead trainer rank


class EngineCatchUpError(RuntimeError):
    """A restarted engine did not load the published weights."""


class RunSummary(msgspec.Struct, kw_only=True):
    """What run() returns: how far the run got, why it stopped, and every counter."""

    steps: int
    version: int
    elapsed_s: float
    samples_trained: int
    tokens_trained: int
    eval_accuracy: float | None
    stop_reason: str  # "steps" | "max_time" | "interrupted" (request_stop: Ctrl-C / SIGTERM)
    counters: dict[str, int]  # the controller's, plus the suite's under "env/<name>" (rounded)
    resumed_from: int | None = None  # the checkpoint step this run started from
    segment_s: float = 0.0  # training time of this run() alone (elapsed_s less the resumed checkpoint's)
    checkpoints: int = 0  # checkpoints written by this run
    checkpoint_s: float = 0.0  # seconds the train loop spent writing them
    last_checkpoint: str | None = None  # the newest checkpoint folder written (None: none, or the last failed)


class Controller:
    """Drives one run: admission, rollouts, batches, training steps, weight syncs, evals.

    ``tokenizer``: an interfaces.Tokenizer (a ChatTokenizer renders turns itself). ``on_step`` receives one flashrl.core.records.StepRecord per step (see ``_step_record``).
    """

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
        self.suite = suite
        self.engines = list(engines)
        self.trainer = trainer
        self.on_step = on_step
        self.on_samples = on_samples  # readable rollouts for samples.jsonl (log.samples_per_step, log.eval_samples)
        self.counters: Counter[str] = Counter()
        self.version = 0
        self.router = Router(len(engines), cfg.engine.max_num_seqs)
        # THE staleness rule of this run: the buffer applies it (and advances next_step as it hands
        # out batches), the rollouts' early abort and the step records read it.
        self.staleness = Staleness(cfg.scheduler.async_ratio)
        self.buffer = SampleBuffer(
            group_size=cfg.rollout.group_size,
            batch_prompts=cfg.rollout.batch_prompts,
            staleness=self.staleness,
            ordered=not cfg.scheduler.queue_scheduling,
            filter_ties=cfg.algorithm.filter_ties,
            counters=self.counters,
        )
        self.admission = Admission(cfg.scheduler.queue_scheduling)
        self.stream = DataStream(suite.train_tasks(), cfg.run.seed)
        self.eval_tasks = list(suite.eval_tasks())
        self.ctx = RolloutContext(
            cfg=cfg,
            tokenizer=tokenizer,
            suite=suite,
            engines=self.engines,
            router=self.router,
            version=lambda: self._served,  # what every live engine holds: a lower bound on a new token's version
            counters=self.counters,
            staleness=self.staleness,
        )
        self.engine_versions = [0] * len(engines)
        # Engine restarts (launch.py's EnginePool; None: a dead engine stays dead, as with the fakes).
        self.restarter = restarter
        self._reviving: set[int] = set()
        self._engine_change = asyncio.Event()  # replaced after each set: an engine came back or gave up
        self._engine_timings: dict[str, float] = {}  # the current sync's slowest-engine phases
        self._engine_occupancy: list[dict[str, float]] = []  # the current sync's engines: busy since the last
        self._sync_lock = asyncio.Lock()  # a regular sync and a restarted engine's catch-up never interleave
        self._published: WeightManifest | None = None  # the manifest every live engine holds (None: version 0)
        self._served = 0  # its version (self.version runs ahead of it while a sync runs beside training)
        self._sync: _PendingSync | None = None  # the last sync started by the train loop (weight_sync.overlap)
        self._last_sync_s = 0.0  # the last finished sync's time/weight_sync_s (the dashboard's)
        if restarter is not None:
            self.ctx.on_engine_dead = self._on_engine_dead
            self.ctx.wait_engine = self._wait_engine
        self.status = "starting"
        self.reward_history: list[tuple[int, float]] = []
        self.eval_history: list[tuple[int, float]] = []
        self.last: StepRecord | None = None  # the last trained step's record
        self.samples_trained = 0
        self.tokens_trained = 0
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # the group's live tasks (cancelled at shutdown)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._eval_done: asyncio.Event | None = None
        self._eval_record: StepRecord | None = None  # the record the running eval will complete
        self._closing = False
        self._ran = False
        self._t0 = 0.0
        self._t_end: float | None = None  # set when run() ends (the clock then stops there)
        self._sample_rate: RateMeter | None = None  # made in run(): a RateMeter reads the clock at once
        # Checkpoints (flashrl/checkpoint.py): a CheckpointWriter, or None (no checkpoints: tests, bench).
        self.checkpoints = checkpoints
        self.last_checkpoint: str | None = None
        self._stop_requested = False
        self._emitted_through = -1  # last step whose record went to on_step (records go out in step order)
        self._checkpoint_s = 0.0  # the last checkpoint's duration, reported in the next step's record
        self._elapsed_before = 0.0  # training time of the run before the checkpoint it resumed from
        self._env_before: dict[str, float] = {}  # the suite's counters at the checkpoint resumed from (they continue)
        self.resumed_from: int | None = None
        self._pending: tuple[StepRecord, bool] | None = None
        if resume is not None:
            self._restore(resume)

    # ------------------------------------------------------------------ run and shutdown
    async def run(self) -> RunSummary:
        if self._ran:
            raise RuntimeError("Controller.run() can only be called once; build a new Controller")
        self._ran = True
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time() - self._elapsed_before  # resumed: elapsed time continues
        self.ctx.busy = [BusyMeter(RATE_WINDOW_S, self._t0) for _ in self.engines]
        self.ctx.token_rates = [RateMeter(clock=self._clock, window_s=RATE_WINDOW_S) for _ in self.engines]
        self._sample_rate = RateMeter(clock=self._clock, window_s=RATE_WINDOW_S)
        stop = "steps"
        try:
            if self.resumed_from is not None:
                # The engines started from the base model: publish the checkpoint's weights (its version)
                # before the first request, so every sample is generated by the policy it is labelled with.
                self.status = "loading checkpoint weights"
                await self._sync_weights(self.version)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._spawn(self._admission_loop(), "admission")
                self._spawn(self._watch(), "watch")
                self.status = "running"
                log.info("controller running: first rollouts requested")  # start-up ends here (bench steptime)
                stop = await self._train_loop()
                # close -> cancel -> wait: no new work, cancel every task, the group waits for all.
                self.status = "stopping"
                self._closing = True
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
            self._t_end = self._loop.time()
            await self._close_suite()
        self.status = "done"
        last_eval = self.eval_history[-1][1] if self.eval_history else None
        return RunSummary(
            steps=self.version,
            version=self.version,
            elapsed_s=self._clock() - self._t0,  # stopped at the run's end: suite.aclose() is not part of it
            samples_trained=self.samples_trained,
            tokens_trained=self.tokens_trained,
            eval_accuracy=last_eval,
            stop_reason=stop,
            counters=self._all_counters(),
            resumed_from=self.resumed_from,
            segment_s=self._clock() - self._t0 - self._elapsed_before,
            checkpoints=self.checkpoints.saved if self.checkpoints is not None else 0,
            checkpoint_s=self.checkpoints.seconds if self.checkpoints is not None else 0.0,
            last_checkpoint=self.last_checkpoint,
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
        if self.buffer.add(t, self._clock()) and self._sample_rate is not None:
            self._sample_rate.add()

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> str:
        cfg = self.cfg
        deadline = self._t0 + cfg.run.max_time_s if cfg.run.max_time_s > 0 else math.inf
        if self.resumed_from is None:
            self._start_eval(StepRecord(step=0, version=0))
        elif self._pending is not None:
            # the checkpoint's own step record was not written yet: write it now (evaluated, if it was
            # waiting for its eval: the weights are the checkpoint's, so it is the same evaluation)
            record, wants_eval = self._pending
            self._pending = None
            if wants_eval:
                self._start_eval(record)
            else:
                self._emit(record)
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
                    self._release(held)
                    held = None
                record = await self._train_step(s, batch, last_end)
                last_end = now = self._clock()
                final = s + 1 == cfg.run.steps or now >= deadline
                if (cfg.run.eval_every and self.version % cfg.run.eval_every == 0) or final:
                    self._start_eval(record)
                elif deadline < math.inf:
                    held = record
                else:
                    self._release(record)
                if now >= deadline:
                    stop = "max_time"
                    break
                if every and self.version % every == 0 and not final and not self._stop_requested:
                    await self._checkpoint(held)  # its time shows in the next step's time/step_s
            await self._await_sync()  # the last weights reach the engines before the end (eval, checkpoint)
            if stop == "interrupted":
                # Ctrl-C / SIGTERM: no final eval. A step record still waiting for its eval goes into
                # the checkpoint; the resumed run evaluates those same weights and writes it then.
                if held is not None:
                    self._release(held)
                    held = None
            else:
                if held is not None:
                    # Stopped by max_time while waiting for a batch: evaluate the final weights, in the
                    # record of the step that made them.
                    self._start_eval(held)
                    held = None
                await self._eval_quiesce()
            await self._checkpoint(None)
        finally:
            if held is not None:  # crashed or cancelled while waiting: the step still gets its line
                self._emit(held)
        return stop

    def request_stop(self) -> None:
        """Stop soon and cleanly (Ctrl-C / SIGTERM): finish the step in progress, checkpoint, return.

        A batch being waited for is given up; a training step or weight sync in progress completes
        first (the trainer cannot be interrupted mid-update without losing the step).
        """
        self._stop_requested = True
        self.buffer.wake()

    # ------------------------------------------------------------------ checkpoints
    async def _checkpoint(self, held: StepRecord | None) -> None:
        """Write a checkpoint of the current version (flashrl/checkpoint.py); a failure is logged,
        counted (``checkpoint/failed``) and survived: the previous checkpoint stays the latest."""
        if self.checkpoints is None or self.version == 0:
            return
        await self._await_sync()  # a checkpoint's weights are the engines' too (a resumed run publishes them)
        state = self.state(held)
        t0 = self._clock()
        status, self.status = self.status, f"checkpointing step {state.step}"
        try:
            path = await self.checkpoints.save(state)
        except CheckpointError as e:
            self.counters["checkpoint/failed"] += 1
            self.last_checkpoint = None
            log.error("%s; training goes on", e)
        else:
            self.last_checkpoint = str(path)
            log.info("checkpoint %s written in %.2f s", path, self._clock() - t0)
        finally:
            self._checkpoint_s = self._clock() - t0
            self.status = status

    def state(self, held: StepRecord | None = None) -> ControllerState:
        """The controller's part of a checkpoint at the current version (call between steps).

        Outstanding groups (admitted, generating, complete but untrained) are recorded by uid only:
        a resumed run re-admits those prompts first (flashrl/checkpoint.py says why).
        """
        pending: dict[str, Any] | None = None
        pending_eval = False
        if self._emitted_through < self.version:
            if held is not None and held.step == self.version:
                pending = held.to_dict()
            elif self._eval_record is not None and self._eval_record.step == self.version:
                pending = msgspec.structs.replace(self._eval_record, eval=None).to_dict()
                pending_eval = True
        readmit = sorted({g.uid for g in self.buffer.groups.values()} | set(self.stream.pending_readmit))
        return ControllerState(
            step=self.version,
            version=self.version,
            elapsed_s=self._clock() - self._t0,
            samples_trained=self.samples_trained,
            tokens_trained=self.tokens_trained,
            seed=self.cfg.run.seed,
            train_size=self.stream.size,
            next_uid=self.stream.uid,
            readmit=readmit,
            dropped_uids=list(self.buffer.dropped_uids),
            counters=dict(self.counters),
            env_counters=self._env_counters(),
            reward_history=list(self.reward_history),
            eval_history=list(self.eval_history),
            metrics_through=min(self._emitted_through, self.version),
            pending_record=pending,
            pending_eval=pending_eval,
        )

    def _restore(self, st: ControllerState) -> None:
        if st.train_size != self.stream.size or st.seed != self.cfg.run.seed:
            raise ValueError(
                f"checkpoint does not match this run's data: train split of {st.train_size} tasks with seed "
                f"{st.seed}, this run has {self.stream.size} with seed {self.cfg.run.seed} (env.params / run.seed changed?)"
            )
        self.version = self._served = st.version
        self.samples_trained = st.samples_trained
        self.tokens_trained = st.tokens_trained
        self.counters.update(st.counters)
        self.counters["resume/readmitted_groups"] += len(st.readmit)
        self.reward_history = [(int(a), float(b)) for a, b in st.reward_history]
        self.eval_history = [(int(a), float(b)) for a, b in st.eval_history]
        self._elapsed_before = st.elapsed_s
        self._emitted_through = st.metrics_through
        self.staleness.next_step = st.step  # the next batch is step ``st.step``
        self.stream.restore(st.next_uid, st.readmit)
        self.buffer.dropped_uids = list(st.dropped_uids)
        self._env_before = dict(st.env_counters)
        self.resumed_from = st.step
        self._pending = (StepRecord.from_dict(st.pending_record), st.pending_eval) if st.pending_record is not None else None

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
        wait_s = await self._await_sync()  # version s on every engine (it ran beside this step's training)
        tq = self._clock()
        await self._eval_quiesce()  # eval tokens must all come from the weights being evaluated
        t1 = self._clock()
        manifest, phases = await self._prepare(s + 1)
        self._mark_reported_dead()  # now, before rollouts are dispatched to a dead engine meanwhile
        self.version = s + 1
        pending = _PendingSync(s + 1, batch)
        pending.task = self._spawn(self._publish(pending, manifest, t1), f"sync v{s + 1}")
        self._sync = pending
        if not self.cfg.weight_sync.overlap:
            wait_s += await self._await_sync()
        now = self._clock()
        n = self.cfg.log.samples_per_step
        if self.on_samples is not None and n:
            # Spread over the groups: the first sample of each group, then the second, ...
            picked = [(g.task, g.samples[j]) for j in range(self.cfg.rollout.group_size) for g in batch if j < len(g.samples)]
            self.on_samples([self._sample_line("train", s + 1, t, task) for task, t in picked[:n]])
        record = self._step_record(s, samples, result.metrics, now - last_end, train_s, 0.0)
        b = record.batch
        assert b is not None
        b.prompt_uids = [g.uid for g in batch]  # which prompts this step trained (resume checks)
        # where the step's time went beyond the trainer's own phases (time/trainer/*): the request's trip
        # (controller encode, transport, fan-out, reply) and the weight sync's parts (flashrl bench steptime)
        if "step_time_s" in result.metrics:
            b.transport_s = max(0.0, train_s - float(result.metrics["step_time_s"]))
        b.sync = {"quiesce_s": t1 - tq, "wait_s": wait_s, **phases}
        pending.record = b
        if pending.phases is not None:  # done already (serial, or a sync faster than the lines above)
            _add_sync(b, pending.phases, pending.engine)
        if self._checkpoint_s:
            b.checkpoint_s = self._checkpoint_s  # the checkpoint written before this step
            self._checkpoint_s = 0.0
        pending.step_record = record
        return record

    async def _await_sync(self) -> float:
        """Wait for the train loop's last sync (its error raises here); the seconds waited."""
        p = self._sync
        if p is None or p.task is None:
            return 0.0
        t0 = self._clock()
        if not p.task.done():
            await asyncio.wait([p.task])  # not ``await task``: a cancel of this waiter must not cancel the sync
        p.task.result()
        return self._clock() - t0

    async def _publish(self, p: _PendingSync, manifest: WeightManifest, t0: float) -> None:
        """The sync of a prepared version, beside training: every live engine loads it, then the
        batch that made it frees its slots, and its step record gets the sync's times (and goes out, if
        the loop released it meanwhile)."""
        phases = await self._send(p.version, manifest)
        if self._engine_occupancy:  # the least busy engine since the previous sync (records: engine/*)
            least = min(self._engine_occupancy, key=lambda o: sum(o.values()))
            p.engine = {**least, "busy": min(1.0, sum(least.values()))}
        self.buffer.mark_trained(p.batch)
        self._last_sync_s = self._clock() - t0  # prepare + broadcast + loads: the sync's own time
        phases["weight_sync_s"] = self._last_sync_s
        p.phases = phases
        if p.record is not None:
            _add_sync(p.record, phases, p.engine)
            # the counters at the step's end, which is now (its batch trained, its skipped engines counted)
            p.record.counters = dict(sorted(self.counters.items()))
            if p.emit and p.step_record is not None:
                self._emit(p.step_record)

    def _release(self, record: StepRecord) -> None:
        """Emit ``record`` now, or when the sync it carries the times of is done."""
        p = self._sync
        if p is not None and p.step_record is record and p.phases is None:
            p.emit = True
        else:
            self._emit(record)

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

    async def _sync_weights(self, version: int) -> dict[str, float]:
        """Publish ``version`` to every live engine, here and now (a resumed run's first weights)."""
        manifest, phases = await self._prepare(version)
        phases.update(await self._send(version, manifest))
        return phases

    async def _prepare(self, version: int) -> tuple[WeightManifest, dict[str, float]]:
        """The trainer's gather + pack + checksums of ``version`` (``prepare_s``: the round trip;
        ``trainer/*``: its parts). The previous sync must be done (the trainer refuses otherwise)."""
        t0 = self._clock()
        manifest = await self.trainer.prepare_weights(version)
        phases = {"prepare_s": self._clock() - t0}
        phases.update({f"trainer/{k}": v for k, v in manifest.timings.items()})
        return msgspec.structs.replace(manifest, timings={}), phases  # engines need no trainer timings

    async def _send(self, version: int, manifest: WeightManifest) -> dict[str, float]:
        """Broadcast a prepared ``version`` to every live engine; return where the time went (``time/sync/*``
        seconds, by phase: send = the broadcast until every engine answered; engine/* = the slowest
        engine's pause, receive, verify, load, rpc, resume)."""
        async with self._sync_lock:
            t1 = self._clock()
            phases: dict[str, float] = {}
            self._engine_timings = {}
            self._engine_occupancy = []
            self._mark_reported_dead()
            live = self.router.live
            if not live and not self._reviving:
                raise RuntimeError(
                    f"no live engine to publish weights version {version} to (all {len(self.engines)} dead): "
                    "check the engine logs in the run directory and restart the run"
                )
            limit = self.cfg.weight_sync.timeout_s
            peers = [self.engines[i].name for i in live]
            try:
                async with timeout(limit), asyncio.TaskGroup() as tg:
                    tg.create_task(self.trainer.send_weights(version, peers), name="trainer.send_weights")
                    for i in live:
                        tg.create_task(self._update_engine(i, manifest), name=f"update {self.engines[i].name}")
            except TimeoutError:
                raise RuntimeError(
                    f"weight sync to version {version} took longer than weight_sync.timeout_s = "
                    f"{self.cfg.weight_sync.timeout_s}: check the trainer and engine logs, or raise the timeout"
                ) from None
            self._published = manifest
            self._served = version
            skipped = len(self.engines) - len(self.router.live)
            if skipped:
                self.counters["weight_sync/skipped_dead_engines"] += skipped
            phases["send_s"] = self._clock() - t1
            phases.update({f"engine/{k}": v for k, v in self._engine_timings.items()})
            return phases

    def _mark_reported_dead(self) -> None:
        """Mark dead every live engine whose client already says so (``client.dead``), before a sync.

        A rollout learns of a dead engine only when its own request fails; an engine that died
        while no request of ours was waiting on it would otherwise be sent the weights and fail
        the whole sync. Skipped here, it fails only its own rollouts (retried elsewhere).
        """
        for i in self.router.live:
            dead = self.engines[i].dead
            if dead:
                self.counters["weight_sync/found_dead_engines"] += 1
                self.ctx.engine_dead(i, dead if isinstance(dead, BaseException) else PeerDead("reported dead"))

    async def _update_engine(self, i: int, manifest: WeightManifest) -> None:
        """One engine's part of a sync. An engine that dies meanwhile only drops out (its request
        fails at once: launch.py fails a dead process's client), never fails or stalls the sync."""
        engine = self.engines[i]
        try:
            r = await engine.update_weights(manifest)
        except PeerDead as e:
            self.counters["weight_sync/engine_died"] += 1
            self.ctx.engine_dead(i, e)
            return
        except RemoteError as e:
            if self.trainer.dead is not None:
                return  # the sender died mid-broadcast: its own call raises TrainerDied, naming the rank
            if self.restarter is None:
                raise
            self.counters["weight_sync/engine_failed"] += 1
            self.ctx.engine_dead(i, e)  # its receive failed: taken out; a fresh process gets verified weights
            return
        if not r.ok or r.version != manifest.version:
            msg = (f"engine {engine.name} failed to load weights version {manifest.version} "
                   f"(answered ok={r.ok}, version={r.version}): {r.error or 'no error given'}; a bad sync is never served")
            if self.restarter is None:
                raise RuntimeError(msg)
            self.counters["weight_sync/engine_failed"] += 1
            self.ctx.engine_dead(i, RuntimeError(msg))  # taken out; a fresh process gets verified weights
            return
        self.engine_versions[i] = manifest.version
        for k, v in r.timings.items():  # the slowest engine's phases: what the sync waited for
            self._engine_timings[k] = max(v, self._engine_timings.get(k, 0.0))
        if r.occupancy:
            self._engine_occupancy.append(r.occupancy)

    # ------------------------------------------------------------------ engine restarts
    def _on_engine_dead(self, i: int, err: BaseException) -> None:
        """An engine died (rollout, sync or watcher found it): restart it in the background."""
        if self._closing or i in self._reviving or self._tg is None:
            return
        self._reviving.add(i)
        self._spawn(self._revive(i), f"revive {self.engines[i].name}")

    async def _watch(self) -> None:
        """Notice a dead engine that no request is waiting on (the launcher fails a dead process's client
        at once; a hung one fails its heartbeat), so that its restart starts without delay; and a dead
        trainer rank while no trainer call is waiting (e.g. every engine restarting): the run stops."""
        while not self._closing:
            trainer_dead = self.trainer.dead
            if trainer_dead is not None:
                raise trainer_dead
            if self.restarter is not None:
                for i in self.router.live:
                    dead = self.engines[i].dead
                    if dead:
                        self.ctx.engine_dead(i, dead if isinstance(dead, BaseException) else PeerDead("reported dead"))
            await asyncio.sleep(WATCH_S)

    async def _revive(self, i: int) -> None:
        """Restart engine i (the launcher: kill what is left, back off, spawn, join its weight-sync
        group), give it the current weights, verified, then route to it again. Gives up when the
        launcher does (engine.max_restarts); the run goes on with the other engines."""
        assert self.restarter is not None
        name = self.engines[i].name
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            while True:
                try:
                    client = await self.restarter.restart(i)
                except Exception as e:  # noqa: BLE001 - the launcher gave up on this engine
                    self.counters["engine/gave_up"] += 1
                    log.error("engine %s stays down: %s", name, e)
                    if self.router.all_dead and self._reviving == {i}:
                        raise RuntimeError(
                            f"no live engine left (all {len(self.engines)} dead; {name} could not be restarted: {e})"
                        ) from e
                    return
                try:
                    await self._catch_up(i, client)
                except EngineCatchUpError as e:
                    self.counters["engine/catch_up_failed"] += 1
                    log.error("engine %s: restarted but the catch-up sync failed (%s); restarting again", name, e)
                    continue
                break
            self.counters["engine/restarts"] += 1
            self.counters["engine/down_s"] += round(loop.time() - t0)
            log.warning("engine %s is back at version %d after %.1f s", name, self.engine_versions[i], loop.time() - t0)
        finally:
            self._reviving.discard(i)
            self._engine_change.set()
            self._engine_change = asyncio.Event()

    async def _catch_up(self, i: int, client: EngineClient) -> None:
        """Send the published weights to restarted engine ``i`` alone; route to it only once it loaded them."""
        async with self._sync_lock:
            m = self._published
            if m is not None:
                limit = self.cfg.weight_sync.timeout_s

                async def engine_side() -> WeightsUpdated:
                    try:
                        return await client.update_weights(m)
                    except (PeerDead, RemoteError) as e:  # the engine's failure, not the trainer's
                        raise EngineCatchUpError(f"{type(e).__name__}: {e}") from e

                update = asyncio.ensure_future(engine_side())
                try:
                    async with timeout(limit):
                        await self.trainer.send_weights(m.version, [client.name])  # a trainer error ends the run
                        r = await update
                except TimeoutError as e:
                    raise EngineCatchUpError(f"no catch-up within weight_sync.timeout_s = {limit}") from e
                finally:
                    if not update.done():
                        update.cancel()
                        with contextlib.suppress(BaseException):
                            await update
                if not r.ok or r.version != m.version:
                    raise EngineCatchUpError(f"answered ok={r.ok}, version={r.version}: {r.error}")
            self.engines[i] = client
            self.engine_versions[i] = m.version if m is not None else 0
            self.router.revive(i)

    async def _wait_engine(self) -> None:
        """Wait until some engine is live again (the last restart to give up ends the run instead)."""
        while self.router.all_dead:
            await self._engine_change.wait()

    # ------------------------------------------------------------------ eval
    def _start_eval(self, record: StepRecord) -> None:
        if not self.eval_tasks:
            if record.step > 0:
                self._release(record)
            return
        done = asyncio.Event()
        self._eval_done = done
        self._eval_record = record
        self._spawn(self._eval(self.version, record, done), f"eval v{self.version}")

    async def _eval_quiesce(self) -> None:
        if self._eval_done is not None:
            await self._eval_done.wait()

    async def _eval(self, version: int, record: StepRecord, done: asyncio.Event) -> None:
        results: list[Trajectory] = []
        t0 = self._clock()
        await self._await_sync()  # every engine holds ``version`` before the first eval request
        assert self._served == version, (self._served, version)
        async with asyncio.TaskGroup() as tg:
            for k, task in enumerate(self.eval_tasks):
                tg.create_task(self._eval_one(k, task, version, results), name=f"eval {k}")
        n = len(self.eval_tasks)
        acc = sum(t.correct for t in results) / n  # a failed eval rollout counts as wrong
        self.eval_history.append((record.step, acc))
        self.counters["eval/failed"] += n - len(results)
        ev = EvalStats(accuracy=acc, reward_mean=sum(t.reward for t in results) / n, reward_metrics=_metric_means(results))
        m = self.cfg.log.eval_samples
        if self.on_samples is not None and m:
            firsts = sorted(results, key=lambda t: -1 - t.group)[:m]  # the same held-out tasks every time
            self.on_samples([self._sample_line("eval", record.step, t, self.eval_tasks[-1 - t.group]) for t in firsts])
        ev.eval_s = self._clock() - t0
        record.eval = ev
        self._emit(record)
        if self._eval_record is record:
            self._eval_record = None
        done.set()

    async def _eval_one(self, k: int, task: Any, version: int, results: list[Trajectory]) -> None:
        await run_group(
            self.ctx,
            task=task,
            group=-1 - k,
            need=1,
            first_index=0,
            extra=0,
            temperature=self.cfg.rollout.eval_temperature,
            on_sample=results.append,
            seed_key=lambda idx: (-1 - k, version),
            sample_ids=lambda idx: f"eval{version}-{k}",
        )

    # ------------------------------------------------------------------ records and snapshot
    def _step_record(
        self, s: int, samples: list[Trajectory], metrics: dict[str, float], step_s: float, train_s: float, sync_s: float
    ) -> StepRecord:
        stale_mean, stale_max = lag_stats(s, (t.version_start for t in samples))
        tokens = sum(t.n_generated for t in samples)
        rewards = [t.reward for t in samples]
        self.samples_trained += len(samples)
        self.tokens_trained += tokens
        reward_mean = sum(rewards) / len(rewards) if rewards else 0.0
        elapsed = self._clock() - self._t0
        batch = BatchStats(
            reward_mean=reward_mean,
            staleness_mean=stale_mean,
            staleness_max=stale_max,
            step_s=step_s,
            train_s=train_s,
            weight_sync_s=sync_s,
            elapsed_s=elapsed,
            samples=len(samples),
            samples_per_s=len(samples) / step_s if step_s > 0 else 0.0,  # trained, over this step
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            run_samples_per_s=self.samples_trained / elapsed if elapsed > 0 else 0.0,  # trained, run average
            run_tokens_per_s=self.tokens_trained / elapsed if elapsed > 0 else 0.0,
            # generated, over the last RATE_WINDOW_S (reading the meters also prunes them)
            rate_samples_per_s=self._sample_rate.rate() if self._sample_rate else 0.0,
            rate_tokens_per_s=sum(m.rate() for m in self.ctx.token_rates),
            turns_mean=sum(t.turns for t in samples) / len(samples) if samples else 0.0,
            response_len_mean=sum(len(t.response_ids) for t in samples) / len(samples) if samples else 0.0,
            trainer=dict(metrics),
            reward_metrics=_metric_means(samples),
            counters=dict(sorted(self.counters.items())),
            env_counters={k.removeprefix("env/"): v for k, v in self._env_counters().items()},
        )
        record = StepRecord(step=s + 1, version=self.version, batch=batch)
        self.reward_history.append((s + 1, reward_mean))
        self.last = record
        return record

    def _sample_line(self, kind: str, step: int, t: Trajectory, task: Any) -> dict[str, Any]:
        """One rollout as samples.jsonl shows it: text in and out, reward, versions, how it ended."""
        decode = self.ctx.tokenizer.decode
        return {
            "step": step, "kind": kind, "sample_id": t.sample_id, "task_id": t.task_id,
            "prompt": decode(t.prompt_ids), "response": decode(t.response_ids), "answer": getattr(task, "answer", ""),
            "reward": t.reward, "correct": t.correct, "metrics": dict(t.metrics),
            "policy_versions": sorted({v for v, m in zip(t.versions, t.loss_mask) if m}),
            "finish_reason": t.finish_reason, "turns": t.turns, "response_tokens": t.n_generated, "engine": t.engine,
        }

    def _emit(self, record: StepRecord) -> None:
        self._emitted_through = max(self._emitted_through, record.step)
        if self.on_step is not None:
            self.on_step(record)

    def _env_counters(self) -> dict[str, float]:
        """The suite's own counters (flashrl.env.Counting: envs/faults.py, envs/remote.py) as ``env/<name>``."""
        out = dict(self._env_before)  # a resumed run's counters continue from the checkpoint's
        if isinstance(self.suite, Counting):
            for k, v in self.suite.counters.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"env/{k}"] = out.get(f"env/{k}", 0) + v
        return dict(sorted(out.items()))

    def _all_counters(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update({k: round(v) for k, v in self._env_counters().items()})  # e.g. env/delay_s is a float
        return out

    def snapshot(self) -> Snapshot:
        """The dashboard's view right now (cheap; call it as often as you redraw).

        Rates and busy fractions are over the last RATE_WINDOW_S seconds of the loop clock; after
        run() has ended, the clock stops at its end, so they read as they were at the end.
        """
        now = self._clock()
        elapsed = max(now - self._t0, 0.0)
        rates = self.ctx.token_rates
        engines = [
            EngineStat(
                name=e.name,
                inflight=self.router.inflight[i],
                busy_fraction=self.ctx.busy[i].fraction(now) if self._ran else 0.0,
                tokens_per_s=rates[i].rate() if rates else 0.0,
                version=self.engine_versions[i],
                alive=self.router.alive[i],
            )
            for i, e in enumerate(self.engines)
        ]
        groups = self.buffer.groups.values()
        last = self.last.batch if self.last is not None else None
        return Snapshot(
            run_name=self.cfg.run.name,
            step=self.version,
            total_steps=self.cfg.run.steps,
            version=self.version,
            elapsed_s=elapsed,
            samples_per_s=self._sample_rate.rate() if self._sample_rate else 0.0,
            tokens_per_s=sum(e.tokens_per_s for e in engines),
            engines=engines,
            pending_prompts=sum(g.state is GroupState.ADMITTED for g in groups),
            running_samples=sum(self.router.inflight),
            buffered_groups=len(self.buffer.complete),
            staleness_mean=float(last.staleness_mean) if last else 0.0,
            staleness_max=int(last.staleness_max) if last else 0,
            reward_mean=float(last.reward_mean) if last else 0.0,
            weight_sync_s=self._last_sync_s,
            step_s=float(last.step_s) if last else 0.0,
            mismatch_kl=last.trainer.get("mismatch/kl") if last else None,
            lr=last.trainer.get("lr") if last else None,
            reward_history=list(self.reward_history),
            eval_history=list(self.eval_history),
            counters=self._all_counters(),
            status=self.status,
            resumed_from=self.resumed_from,
        )


class _PendingSync:
    """A weight sync started by the train loop: the version, the batch that made it, and the step
    record that gets its times (emitted by the sync when the loop released it before it was done)."""

    __slots__ = ("version", "batch", "task", "record", "step_record", "phases", "engine", "emit")

    def __init__(self, version: int, batch: list[Group]) -> None:
        self.version = version
        self.batch = batch
        self.task: asyncio.Task[None] | None = None
        self.record: BatchStats | None = None
        self.step_record: StepRecord | None = None
        self.phases: dict[str, float] | None = None  # set when done
        self.engine: dict[str, float] = {}  # the least busy engine's occupancy, reported by this sync
        self.emit = False


def _add_sync(b: BatchStats, phases: dict[str, float], engine: dict[str, float]) -> None:
    """A finished sync's times into its step's record: ``weight_sync_s`` (its own time), its phases, and
    how busy its least busy engine was since the previous sync (``engine``: stepping, commands, busy)."""
    b.weight_sync_s = phases["weight_sync_s"]
    b.sync.update({k: v for k, v in phases.items() if k != "weight_sync_s"})
    b.engine = dict(engine)


def _metric_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Mean of each per-trajectory metric (a reward function's extras) over the trajectories that have it."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for t in trajs:
        for k, v in t.metrics.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] += 1
    return {k: total / counts[k] for k, total in sums.items()}


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]
