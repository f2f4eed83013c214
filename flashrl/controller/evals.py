"""Evals: one greedy rollout per held-out task, on exactly the weights of the version evaluated.

    train loop ──start(record, version)──> eval task in the run's task group (step 0, every
                                           run.eval_every, the last step)
      eval task: waits for the weight sync of ``version`` (publisher.wait) ──> one rollout per
                 held-out task (rollout.run_group, need 1, rollout.eval_temperature), through the same
                 Router as training rollouts ──> accuracy into the record ──> ledger.emit(record)
    train loop ──quiesce()──> waits for a running eval before the next weight sync, a checkpoint
                              and the end of the run

Invariants: every eval token comes from the evaluated weights (the eval starts once every live
engine holds ``version``, and the next sync waits for it to finish: ``quiesce``); at most one eval
runs at a time; the record it completes is emitted exactly once, by the eval (``record`` names it
while it runs, so a checkpoint written meanwhile stores it as pending). A failed eval rollout counts
as wrong (``eval/failed``). Eval rollouts use group ids ``-1 - task position`` (never a training
uid: no staleness watch, seeds of their own) and their samples go to the eval's own list, never to
the buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from flashrl.config import Config
from flashrl.controller.ledger import Ledger
from flashrl.controller.publisher import WeightPublisher
from flashrl.controller.rollout import RolloutContext, run_group
from flashrl.controller.types import Trajectory, metric_means
from flashrl.core.records import EvalStats, StepRecord

__all__ = ["Evals"]


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
        self.record: StepRecord | None = None  # the record the running eval will complete
        self._done: asyncio.Event | None = None

    def start(self, record: StepRecord, version: int) -> None:
        """Evaluate ``version`` into ``record`` (no held-out tasks: the record goes out as it is)."""
        if not self.tasks:
            if record.step > 0:
                self.publisher.release(record)
            return
        done = asyncio.Event()
        self._done = done
        self.record = record
        self._spawn(self._eval(version, record, done), f"eval v{version}")

    async def quiesce(self) -> None:
        """Wait for the running eval, if any."""
        if self._done is not None:
            await self._done.wait()

    async def _eval(self, version: int, record: StepRecord, done: asyncio.Event) -> None:
        results: list[Trajectory] = []
        t0 = self._clock()
        await self.publisher.wait()  # every engine holds ``version`` before the first eval request
        assert self.publisher.published.version == version, (self.publisher.published.version, version)
        async with asyncio.TaskGroup() as tg:
            for k, task in enumerate(self.tasks):
                tg.create_task(self._eval_one(k, task, version, results), name=f"eval {k}")
        n = len(self.tasks)
        acc = sum(t.correct for t in results) / n  # a failed eval rollout counts as wrong
        self.ledger.eval_history.append((record.step, acc))
        self.ledger.counters["eval/failed"] += n - len(results)
        ev = EvalStats(accuracy=acc, reward_mean=sum(t.reward for t in results) / n, reward_metrics=metric_means(results))
        m = self.cfg.log.eval_samples
        if self._on_samples is not None and m:
            firsts = sorted(results, key=lambda t: -1 - t.group)[:m]  # the same held-out tasks every time
            self._on_samples([self.ledger.sample_line("eval", record.step, t, self.tasks[-1 - t.group]) for t in firsts])
        ev.eval_s = self._clock() - t0
        record.eval = ev
        self.ledger.emit(record)
        if self.record is record:
            self.record = None
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
