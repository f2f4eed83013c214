"""The feed: keeps the sample buffer filled and hands the train loop its batches.

    admission loop ──admit(uid, task)──> SampleBuffer ──> group task per prompt (group.run_group)
      waits: buffer.changed()              ^   |              rollouts -> engines (Router)
      admits: Admission.admit_count()      |   |              each ok sample -> buffer.add() at once
                                           |   v
    train loop ──next_batch(step)──> take_batch(step) ── stale samples -> refill group task (stale = drop)
      waits: buffer.changed() for a batch (stale = wait: also while a due group is still generating)

Checkpoints (partial mode): ``cut()`` stops the training rollouts at their current tokens
(cut.CheckpointCut) and ``snapshot()`` then reads, in one synchronous step, every
outstanding group with its finished samples and its unfinished rollouts' prefixes
(checkpoint.RolloutSnapshot); ``go_on()`` lets them continue. A resumed run's saved groups are put
back by the controller (buffer.restore) and their rollouts launched here first (``restored``),
continuing from their prefixes. Outside partial mode the snapshot names the outstanding groups for
re-admission instead.

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

from flashrl.checkpoint import RolloutSnapshot, SavedGroup
from flashrl.config import Config
from flashrl.controller.buffer import Group, GroupState, SampleBuffer
from flashrl.controller.context import RolloutContext
from flashrl.controller.evals import Evals
from flashrl.controller.group import run_group
from flashrl.controller.ledger import RunMeters
from flashrl.controller.publisher import WeightPublisher
from flashrl.controller.scheduler import Admission, DataStream
from flashrl.controller.types import Trajectory
from flashrl.wire.trajectory import snapshot

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
        # a resumed run's saved groups still generating, with their unfinished rollouts and their finished
        # samples held back (launch order): launched first
        self.restored: list[tuple[Group, list[Trajectory], list[Trajectory]]] = []

    def close(self) -> None:
        """No more admissions (shutdown: the admission loop ends at its next wake-up or cancel)."""
        self._closing = True

    async def admission_loop(self) -> None:
        b = self.buffer
        restored, self.restored = self.restored, []
        for g, resumes, held in restored:
            self._launch(g, g.missing, resumes, held)
        while not self._closing:
            # the capacity (staleness bound), the barrier without queue scheduling, and no more groups
            # than the run still trains (buffer invariant 5: the run ends with nothing generating)
            for _ in range(min(self.admission.admit_count(b.outstanding, b.admission_capacity, b.generating), b.admit_room())):
                uid, task = self.stream.next()
                g = b.admit(uid, task, self._clock())
                self._launch(g, g.need)
            # no training rollout generating while an eval runs: generation waits for the eval's end
            with self.evals.generation_waits(idle=b.generating == 0):
                await b.changed()

    def _launch(self, g: Group, need: int, resumes: list[Trajectory] | None = None,
                held: list[Trajectory] | None = None) -> None:
        extra = self.cfg.rollout.redundancy
        resumes = resumes or []
        held = held or []
        first = self.buffer.start(g, max(0, need + extra - len(resumes) - len(held)))  # run_group's fresh rollouts
        self._spawn(self._group_task(g, need, first, extra, resumes, held), f"group {g.uid}")

    async def _group_task(self, g: Group, need: int, first: int, extra: int, resumes: list[Trajectory],
                          held: list[Trajectory]) -> None:
        ok = await run_group(
            self.ctx,
            task=g.task,
            group=g.uid,
            need=need,
            first_index=first,
            extra=extra,
            temperature=self.cfg.rollout.temperature,
            on_sample=self._on_sample,
            resumes=resumes,
            finished=held,
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

    # ------------------------------------------------------------------ checkpoints
    async def cut(self) -> int:
        """Stop the training rollouts at their current tokens for a snapshot (partial mode with
        checkpoints; else nothing to do): how many requests did not answer in time."""
        return await self.ctx.cut.cut() if self.ctx.cut is not None else 0

    def go_on(self) -> None:
        """After a cut: the rollouts continue from their tokens so far."""
        if self.ctx.cut is not None:
            self.ctx.cut.go_on()

    def snapshot(self, version: int, unsettled: int = 0) -> tuple[RolloutSnapshot, list[int]]:
        """(The untrained work at this instant, the uids to re-admit instead). Call after ``cut()``, between
        two steps, in the same synchronous step as the rest of the checkpoint's state.

        Partial mode with cuts: every outstanding group is saved, complete ones in completion order
        (the order batches take them), then the running ones by uid, each with its finished samples
        (delivered, and ``held``: finished but waiting for an earlier-launched rollout, launch order)
        and one entry per rollout in flight: its prefix when it is still in its first turn (a
        single-turn rollout always is), else an empty one (it restarts; its tokens are counted in
        ``regenerated_tokens``). Otherwise every outstanding group is named for re-admission and its
        known tokens (finished samples, folded prefixes) are counted there."""
        b = self.buffer
        cut = self.ctx.cut
        keep = cut is not None
        inflight: dict[int, list[tuple[str, int, Trajectory | None]]] = {}
        held: dict[int, list[Trajectory]] = {}
        if cut is not None:
            for sid, (uid, idx, t) in cut.rollouts.items():
                inflight.setdefault(uid, []).append((sid, idx, t))
            for t in cut.held.values():
                held.setdefault(t.group, []).append(t)
        running = sorted((g for g in b.groups.values() if g.state in (GroupState.ADMITTED, GroupState.RUNNING)),
                         key=lambda g: g.uid)
        groups: list[SavedGroup] = []
        readmit: list[int] = []
        regenerated = 0
        for g in [*b.complete, *b.parked, *running]:  # parked: complete, joining the order at their version
            live = inflight.get(g.uid, []) if g.state is not GroupState.COMPLETE else []
            waiting = held.get(g.uid, []) if g.state is not GroupState.COMPLETE else []
            if not keep:
                readmit.append(g.uid)
                regenerated += sum(t.n_generated for t in (*g.samples, *waiting))
                regenerated += sum(t.n_generated for _, _, t in live if t is not None)
                continue
            unfinished = []
            for sid, idx, t in sorted(live, key=lambda x: x[1]):
                if t is not None and not _first_turn(t):
                    regenerated += t.n_generated  # its environment's state is not saved: it restarts
                    t = None
                unfinished.append(snapshot(t) if t is not None else Trajectory(sample_id=sid, group=g.uid, index=idx))
            groups.append(SavedGroup(
                uid=g.uid, task_id=g.task.id, complete=g.state is GroupState.COMPLETE, next_index=g.next_index,
                admitted_version=g.admitted_version, completed_version=g.completed_version,
                samples=[snapshot(t) for t in g.samples], unfinished=unfinished,
                held=[snapshot(t) for t in sorted(waiting, key=lambda t: t.index)],
            ))
        snap = RolloutSnapshot(version=version, groups=groups, regenerated_tokens=regenerated, unsettled=unsettled)
        return snap, readmit


def _first_turn(t: Trajectory) -> bool:
    """Whether a rollout in flight is still in its first turn (no environment step has come back: a
    snapshot can keep it as prompt + prefix), or its environment step after it is running."""
    return t.turns == 0 or (t.turns == 1 and 0 not in t.loss_mask)
