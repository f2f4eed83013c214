"""The feed: keeps the sample buffer filled and hands the train loop its batches.

    admission loop ──admit(uid, task)──> SampleBuffer ──> group task per prompt (rollout.run_group)
      waits: buffer.changed()              ^   |              rollouts -> engines (Router)
      admits: Admission.admit_count()      |   |              each ok sample -> buffer.add() at once
                                           |   v
    train loop ──next_batch(step)──> take_batch(step) ── stale samples -> refill group task (stale = drop)
      waits: buffer.changed() for a batch (stale = wait: also while a due group is still generating)

Invariants: every group admitted gets exactly one group task, and a group handed back for a refill
(stale = drop) one more; a group task that cannot fill its group drops it (``unfillable``), so no
admission slot stays taken by a group nobody fills. A batch handed out has advanced
staleness.next_step past its step, and the rollouts this makes too stale are cancelled at once
(ctx.abort_stale), not finished. No wait here is unbounded: the batch wait ends at the run's
deadline, on ``stopped()`` (the buffer is woken) or with a batch; the admission loop ends at
``close()``. What an eval causes of these waits is the eval's to count (evals.py: the train loop's
wait while no sample can be fresh before the eval ends; idle generation while it runs).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from flashrl.config import Config
from flashrl.controller.buffer import Group, GroupState, SampleBuffer
from flashrl.controller.evals import Evals
from flashrl.controller.ledger import RunMeters
from flashrl.controller.publisher import WeightPublisher
from flashrl.controller.rollout import RolloutContext, run_group
from flashrl.controller.scheduler import Admission, DataStream
from flashrl.controller.types import Trajectory

__all__ = ["Feed"]

log = logging.getLogger(__name__)


class Feed:
    """The run's admission loop, group tasks and batch wait (see the module docstring); made when run()
    starts, with the rollout context, the meters and the evals it uses."""

    def __init__(self, cfg: Config, buffer: SampleBuffer, stream: DataStream, admission: Admission,
                 ctx: RolloutContext, meters: RunMeters, evals: Evals, publisher: WeightPublisher, *,
                 clock: Callable[[], float], spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
                 stopped: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self.stream = stream
        self.admission = admission
        self.ctx = ctx
        self.meters = meters
        self.evals = evals
        self.publisher = publisher
        self._clock = clock
        self._spawn = spawn
        self._stopped = stopped  # request_stop(): a batch being waited for is given up
        self._closing = False

    def close(self) -> None:
        """No more admissions (shutdown: the admission loop ends at its next wake-up or cancel)."""
        self._closing = True

    async def admission_loop(self) -> None:
        b = self.buffer
        while not self._closing:
            for _ in range(self.admission.admit_count(b.outstanding, b.capacity, b.generating)):
                uid, task = self.stream.next()
                g = b.admit(uid, task, self._clock())
                self._launch(g, g.need)
            # no training rollout generating while an eval runs: generation waits for the eval's end
            with self.evals.generation_waits(idle=b.generating == 0):
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

    async def next_batch(self, step: int, deadline: float) -> list[Group] | None:
        """The batch of ``step`` (None: stopped or past the deadline). While the engines are held at a
        version too old for this step (staleness.oldest(step) above it), no sample can be fresh before
        the eval ends: that part of the wait is the eval's (evals.trainer_waits)."""
        staleness = self.buffer.staleness
        try:
            async with asyncio.timeout_at(deadline if math.isfinite(deadline) else None):
                while not self._stopped():
                    batch, refills = self.buffer.take_batch(step)
                    for g in refills:
                        self._launch(g, g.missing)
                    if batch is not None:
                        # From now on only steps > ``step`` can take a sample (staleness.next_step):
                        # cancel the rollouts this already makes too stale, rather than finish them.
                        self.ctx.abort_stale()
                        return batch
                    held = self.publisher.held
                    with self.evals.trainer_waits(blocked=held is not None and staleness.oldest(step) > held):
                        await self.buffer.changed()
                return None
        except TimeoutError:
            return None
