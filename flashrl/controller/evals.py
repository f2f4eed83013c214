"""Evals: one greedy rollout per held-out task, on exactly the weights of the version evaluated,
off the training path: the trainer never waits for an eval while it has fresh samples to train.

    train loop ──start(record, version)──> publisher.hold(version) + eval task in the run's task group
                                           (step 0, every run.eval_every, the last step)
      eval task: waits for the eval before it (if any) and for ``version`` on every engine
                 (publisher.loaded) ──> one rollout per held-out task (group.run_group, need 1,
                 rollout.eval_temperature), through the same Router as training rollouts ──> accuracy
                 and its cost into the record ──> ledger.emit(record) ──> publisher.unhold(version):
                 the newest version the trainer made meanwhile loads at once (one sync)
    train loop ──quiesce()──> waits for every eval started, only before a checkpoint and at the end
    train loop, admission loop (feed.py) ──trainer_waits / generation_waits──> what an eval cost them

Why the trainer need not wait: while the eval holds the engines at v, training rollouts go on
generating with v (tagged v), and the trainer takes them for up to async_ratio steps beyond v (the
staleness bound, core/staleness.py, unchanged); only past that does it wait, for samples of the
version loaded when the eval ends. What an eval cost goes into its record (core/records.py
EvalStats): ``eval_s`` its wall time, ``trainer_wait_s`` what the train loop waited because of it
(a batch that could not be fresh before the eval ended, or a sync queued behind it),
``gen_wait_s`` how long no training rollout was generating while it ran, and ``engine_share``
its tokens' share of all tokens generated while it ran.

Stragglers (multi-turn episodes, rollout.max_turns > 1): an eval holds the engines until its slowest
episode ends, and a multi-turn episode's time is mostly its environment calls, whose latency has a
tail (configs/tools.toml: a tool call's p99 is 10x its median; an eval's last episode ended 2.4-5.8 s
after it began, 90% of its episodes by 1.2-1.7 s, and the async_ratio + 1 steps the trainer can take
beside it took ~2-2.5 s: bench/results/evals). So once ``HEDGE_AT`` (75%) of an eval's episodes have finished, each one still running
gets a second copy: the same task, the same sampling seeds (``seed_key`` ignores the copy), on the same
held weights, so it samples the same tokens and earns the same reward, but its environment calls draw
their latency afresh (a new env instance); the first of the two to finish is kept and the other is
cancelled (its requests aborted, its env closed). Which copy wins depends on the environment's
latency, not on what the policy does, so the eval's result is the one a run without the straggler
gets (up to engine numerics that could turn a sampled token: then a copy whose episode is faster could
be favoured). Counted: ``eval/hedged`` (copies started), ``eval/hedge_won`` (copies kept). The
copies' tokens are not in ``engine_share`` (which counts the kept episodes' tokens). Single-turn
episodes are never copied: their time is their generation, which a copy with the same seeds repeats.

Invariants: every eval token comes from the evaluated weights (the eval starts once every live
engine holds ``version``, and no newer version is loaded before it ends: publisher.hold; a token of
another version is counted, ``eval/mixed_versions``, and logged as an error); evals run one at a
time, in version order (one due while another runs waits for it, and its version is pinned in the
publisher); the record an eval completes is emitted exactly once, by the eval (``record`` names the
newest while it runs, so a checkpoint written meanwhile stores it as pending). A failed eval rollout counts
as wrong (``eval/failed``). Eval rollouts use group ids ``-1 - task position`` (never a training
uid: no staleness watch, seeds of their own) and their samples go to the eval's own list, never to
the buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from flashrl.aio import cancel_and_wait
from flashrl.config import Config
from flashrl.controller.context import RolloutContext
from flashrl.controller.group import run_group
from flashrl.controller.ledger import Ledger
from flashrl.controller.publisher import WeightPublisher
from flashrl.controller.scheduler import EVAL_ENGINES
from flashrl.controller.types import Trajectory, metric_means
from flashrl.core.records import EvalStats, StepRecord

__all__ = ["Evals"]

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02  # how often an eval on engines set apart looks whether their training rollouts ended
HEDGE_AT = 0.75  # the share of an eval's (multi-turn) episodes finished when the rest get a second copy


class _Wait:
    """A wait an eval causes, on the loop's clock: in progress since ``since`` (None: none), charged at
    its end or at the eval's end, whichever comes first (what follows the eval's end is not its cost)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.since: float | None = None
        self.total = 0.0  # over the run

    def charge(self) -> float:
        """The seconds since ``since`` (0.0: none in progress), added to ``total``; no longer timed."""
        if self.since is None:
            return 0.0
        seconds, self.since = self._clock() - self.since, None
        self.total += seconds
        return seconds


class Evals:
    """The run's evals over ``tasks`` (the suite's held-out split; see the module docstring)."""

    def __init__(self, cfg: Config, tasks: Sequence[Any], ctx: RolloutContext, ledger: Ledger,
                 publisher: WeightPublisher, *, clock: Callable[[], float],
                 spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
                 on_samples: Callable[[list[dict[str, Any]]], None] | None) -> None:
        self.cfg = cfg
        self.tasks = list(tasks)
        self.ctx = ctx
        self.ledger = ledger
        self.publisher = publisher
        self._clock = clock
        self._spawn = spawn
        self._on_samples = on_samples
        self.record: StepRecord | None = None  # the record the newest eval started will complete
        self._done: asyncio.Event | None = None  # set when the newest eval started has ended
        self._running: EvalStats | None = None  # the running eval's stats: its costs accumulate here
        # the run's totals over every finished eval (the run summary's, the dashboard's)
        self.total_s = 0.0
        self._trainer_wait = _Wait(clock)  # the train loop waits for the running eval
        self._gen_wait = _Wait(clock)  # no training rollout generating during an eval
        self._step_wait = 0.0  # the train loop's eval-caused wait not yet in a step record

    def start(self, record: StepRecord, version: int) -> None:
        """Evaluate ``version`` into ``record`` (no held-out tasks: the record goes out as it is)."""
        if not self.tasks:
            if record.step > 0:
                self.publisher.release(record)
            return
        prev = self._done
        done = asyncio.Event()
        self._done = done
        self.record = record
        self.ledger.eval_due(record.step)
        self.publisher.hold(version)  # now: a version made before the eval begins must not load
        self._spawn(self._eval(version, record, prev, done), f"eval v{version}")

    @property
    def running(self) -> bool:
        """Whether an eval is running or due (started and not ended)."""
        return self._done is not None and not self._done.is_set()

    async def quiesce(self) -> None:
        """Wait for every eval started (they end in order: the newest last)."""
        if self._done is not None:
            await self._done.wait()

    def trainer_waits(self, *, blocked: bool) -> contextlib.AbstractContextManager[None]:
        """A wait of the train loop; ``blocked``: only the running eval's end can end it (a batch no
        sample can be fresh for, a sync queued behind it). Its seconds up to the eval's end (after it,
        the loop waits as it does without evals) are charged to the eval, the run's total and the next
        step record (take_step_wait)."""
        return self._waiting(self._trainer_wait, blocked, self._charge_trainer)

    def take_step_wait(self) -> float:
        """The train loop's eval-caused wait since the last call (a step record's time/eval_wait_s)."""
        out, self._step_wait = self._step_wait, 0.0
        return out

    def generation_waits(self, *, idle: bool) -> contextlib.AbstractContextManager[None]:
        """A wait of the admission loop; ``idle``: no training rollout is generating. While an eval runs,
        that idle time up to the wait's end (or the eval's) is the eval's cost."""
        return self._waiting(self._gen_wait, idle and self.running, self._charge_gen)

    @contextlib.contextmanager
    def _waiting(self, wait: _Wait, timed: bool, charge: Callable[[], None]) -> Iterator[None]:
        """A wait, timed on ``wait`` from now when ``timed``; ``charge`` books it at its end."""
        if timed:
            wait.since = self._clock()
        try:
            yield
        finally:
            charge()

    def _charge_trainer(self) -> None:
        seconds = self._trainer_wait.charge()
        self._step_wait += seconds
        if self._running is not None:
            self._running.trainer_wait_s += seconds

    def _charge_gen(self) -> None:
        seconds = self._gen_wait.charge()
        if self._running is not None:
            self._running.gen_wait_s += seconds

    @property
    def trainer_wait_s(self) -> float:
        """The train loop's waits caused by evals, over the run."""
        return self._trainer_wait.total

    @property
    def gen_wait_s(self) -> float:
        """Idle generation during evals, over the run."""
        return self._gen_wait.total

    async def _eval(self, version: int, record: StepRecord, prev: asyncio.Event | None, done: asyncio.Event) -> None:
        results: list[Trajectory] = []
        if prev is not None:
            await prev.wait()  # one eval at a time: the engines hold one version
        t0 = self._clock()
        ev = self._running = EvalStats(accuracy=0.0, reward_mean=0.0)
        await self.publisher.loaded(version)  # every engine (or every one set apart) holds ``version`` first
        if not self.publisher.holding(version):  # LoRA: the eval's engines refused ``version``
            self._refuse(version, record, done)
            return
        apart = self.publisher.eval_engines
        if apart is not None:  # this task's requests, and those of the rollouts it starts, go there only
            EVAL_ENGINES.set(apart)
            await self._drained(apart)
        tokens0 = sum(m.total for m in self.ctx.token_rates)
        hedge = _Hedge(len(self.tasks), self.cfg.rollout.max_turns > 1)
        async with asyncio.TaskGroup() as tg:
            for k, task in enumerate(self.tasks):
                tg.create_task(self._eval_one(k, task, version, results, hedge), name=f"eval {k} of {len(self.tasks)}")
        mixed = [t.sample_id for t in results if any(v != version for v, m in zip(t.versions, t.loss_mask) if m)]
        if mixed:  # the publisher's hold failed: say so loudly, the accuracy is not of one version
            self.ledger.counters["eval/mixed_versions"] += len(mixed)
            log.error("eval of version %d: %d rollouts have tokens of another version (e.g. %s)", version, len(mixed), mixed[0])
        n = len(self.tasks)
        acc = sum(t.correct for t in results) / n  # a failed eval rollout counts as wrong
        self.ledger.eval_history.append((record.step, acc))
        self.ledger.counters["eval/failed"] += n - len(results)
        ev.accuracy = acc
        ev.reward_mean = sum(t.reward for t in results) / n
        ev.reward_metrics = metric_means(results)
        generated = sum(m.total for m in self.ctx.token_rates) - tokens0
        if self.ctx.token_rates and generated > 0:
            ev.engine_share = sum(t.n_generated for t in results) / generated
        m = self.cfg.log.eval_samples
        if self._on_samples is not None and m:
            firsts = sorted(results, key=lambda t: -1 - t.group)[:m]  # the same held-out tasks every time
            self._on_samples([self.ledger.sample_line("eval", record.step, t, self.tasks[-1 - t.group]) for t in firsts])
        ev.eval_s = self._clock() - t0
        self.total_s += ev.eval_s
        self._charge_trainer()  # a wait of the train loop for this eval ends here
        self._charge_gen()  # so does idle generation because of it
        self._running = None
        record.eval = ev
        self.ledger.emit(record)
        if self.record is record:
            self.record = None
        self.publisher.unhold(version)  # after the emit: the records a deferred sync carries are later steps
        done.set()

    def _refuse(self, version: int, record: StepRecord, done: asyncio.Event) -> None:
        """The eval of ``version`` is not run: its engines do not all hold it (a LoRA adapter refused). An eval on
        mixed versions would report one version's accuracy for another's: counted (``eval/refused_versions``),
        logged, and the record goes out without an eval."""
        p = self.publisher
        engines = p.eval_engines if p.eval_engines is not None else frozenset(self.ctx.router.live)
        held = {p.engines[i].name: p.engine_versions[i] for i in sorted(engines)}
        self.ledger.counters["eval/refused_versions"] += 1
        log.error("eval of version %d not run: its engines hold %s (published version %d; a refused LoRA adapter); "
                  "the step's record has no eval", version, held, p.published.version)
        self._charge_trainer()
        self._charge_gen()
        self._running = None
        self.ledger.emit(record)
        if self.record is record:
            self.record = None
        p.unhold(version)
        done.set()

    async def _drained(self, apart: frozenset[int]) -> None:
        """Wait until the training rollouts still bound to the eval's engines (routed before the hold; no new
        one goes there) have ended, at most rollout.trajectory_timeout_s: the eval's requests would take
        those engines' permits, and leave them, and the groups they complete, waiting for the eval's end."""
        router = self.ctx.router
        deadline = self._clock() + self.cfg.rollout.trajectory_timeout_s
        # polled: the router is a pure decision object (scheduler.py: nothing there waits), and this wait is rare
        while any(router.inflight[i] for i in apart if router.alive[i]) and self._clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(DRAIN_POLL_S)

    async def _eval_one(self, k: int, task: Any, version: int, results: list[Trajectory], hedge: _Hedge) -> None:
        """Task ``k``'s episode; once ``hedge`` is due and it still runs, a second copy of it (same task, same
        sampling seeds, on the same weights), and the first of the two to finish decides."""

        async def copy(c: int) -> Trajectory | None:
            out: list[Trajectory] = []
            await run_group(
                self.ctx,
                task=task,
                group=-1 - k,
                need=1,
                first_index=0,
                extra=0,
                temperature=self.cfg.rollout.eval_temperature,
                on_sample=out.append,
                seed_key=lambda idx: (-1 - k, version),  # the copy's too: the same tokens on the same weights
                sample_ids=lambda idx: f"eval{version}-{k}" + (f"-h{c}" if c else ""),
            )
            return out[0] if out else None  # None: failed (it counts as wrong)

        if not hedge.active:  # single-turn: never copied, so no task of its own (see _Hedge)
            t0 = await copy(0)
            if t0 is not None:
                results.append(t0)
            return
        first = asyncio.create_task(copy(0), name=f"eval {k}")
        copies = [first]
        due = asyncio.create_task(hedge.due.wait(), name=f"eval {k} hedge")
        try:
            await asyncio.wait([first, due], return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                copies.append(asyncio.create_task(copy(1), name=f"eval {k} copy"))
                self.ledger.counters["eval/hedged"] += 1
                await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
            winner = next(t for t in copies if t.done())  # the original when both are
            t = winner.result()
        finally:
            await cancel_and_wait([due, *copies])  # the other copy's engine requests are aborted, its env closed
        if winner is not first:
            self.ledger.counters["eval/hedge_won"] += 1
        if t is not None:
            results.append(t)
        hedge.finished()


class _Hedge:
    """When an eval's stragglers get a second copy: once ``HEDGE_AT`` of its episodes have finished, with
    multi-turn episodes (rollout.max_turns > 1) only (see the module docstring)."""

    def __init__(self, n: int, multi_turn: bool) -> None:
        self.due = asyncio.Event()
        self._left = max(1, int(HEDGE_AT * n)) if multi_turn and n > 1 else None  # finishes until due

    @property
    def active(self) -> bool:
        """Whether any episode of this eval may be copied (multi-turn, more than one task)."""
        return self._left is not None

    def finished(self) -> None:
        if self._left is None:
            return
        self._left -= 1
        if self._left <= 0:
            self.due.set()
