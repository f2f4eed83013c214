"""One group: ``need + extra`` rollouts of a prompt, ``need`` ok samples handed over, the rest cancelled.

    run_group(uid, need, extra)                       one asyncio task per rollout; each reports its
      ├─ run_sample(index k) x (need + extra) ──┐     result to the group's tally as it finishes:
      │    (rollout.py: retries, one trajectory) │     first ``need`` ok samples (finish or launch order) -> on_sample()
      └────── _GroupState.finish(traj) <────────┘     then the group cancels the rest: each cancelled
                                                      generate sends engine.abort([request_id])
                                                      unfillable (ok + still running < need) -> False

With checkpoint cuts (cut.CheckpointCut, partial mode) every training rollout is registered from its
launch to the step its outcome reaches the group (``started`` / ``settled``), and a finished sample held
back behind an earlier launch (launch order) is the cut's ``held`` until handed over: a cut sees each
sample here or in the buffer, never in neither or both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from flashrl.aio import cancel_and_wait
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.cut import CheckpointCut
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import sample_id
from flashrl.controller.types import Trajectory
from flashrl.env import Task

__all__ = ["run_group"]


async def run_group(
    ctx: RolloutContext,
    *,
    task: Task,
    group: int,
    need: int,
    first_index: int,
    extra: int,
    temperature: float,
    on_sample: Callable[[Trajectory], object],
    seed_key: Callable[[int], tuple[int, int]] | None = None,
    sample_ids: Callable[[int], str] | None = None,
    resumes: Sequence[Trajectory] = (),
    finished: Sequence[Trajectory] = (),
) -> bool:
    """Run ``need + extra`` rollouts of ``task``; hand ``need`` ok ones to ``on_sample``: the first to finish,
    or with ``rollout.redundant_keep = "launch_order"`` the first in launch order (``_GroupState``).

    ``resumes``: a checkpoint's unfinished rollouts of this group (each its own sample index),
    continued from their prefixes; ``finished``: its finished samples that were held back (launch order:
    an earlier-launched rollout had not finished), tallied as finished before anything runs. With them,
    ``need + extra - len(resumes) - len(finished)`` fresh rollouts (none when that is negative) take the
    indices from ``first_index`` on. Launch order is the order of the sample indices: restored ones
    (below ``first_index``, with gaps where samples were delivered or failed) before the fresh ones.

    Returns True when ``need`` samples were delivered, False when the group cannot be filled
    (the caller drops it and counts it). The remaining rollouts are cancelled either way, which
    aborts their engine requests and frees their permits and engine counts; run_group returns
    (or raises) only once every one of its tasks has ended. A rollout that raises (a bug) cancels
    the others and its error is raised here.
    """
    fresh = max(0, need + extra - len(resumes) - len(finished))
    n = fresh + len(resumes)  # rollouts to run (the finished ones are tallied, not run)
    router = ctx.router
    if router.all_dead and ctx.wait_engine is not None:
        await ctx.wait_engine()
    if ctx.cfg.scheduler.replication:
        engines = [router.pick() for _ in range(n)]  # each sample to the least-loaded engine
    else:
        first = router.pick()
        for _ in range(n - 1):
            router.take(first)
        engines = [first] * n
    loop = asyncio.get_running_loop()
    in_launch_order = ctx.cfg.rollout.redundant_keep == "launch_order" and extra > 0
    cut = ctx.cut_for(group)
    order = None
    if in_launch_order:
        order = sorted([*(t.index for t in resumes), *(t.index for t in finished),
                        *range(first_index, first_index + fresh)])
    state = _GroupState(need, n + len(finished), on_sample, loop.create_future(), order, cut)
    for t in finished:
        state.finish(t)
    tasks: list[asyncio.Task[None]] = []
    sids: list[str] = []
    for k, i in enumerate(engines):
        resume = resumes[k] if k < len(resumes) else None
        idx = resume.index if resume is not None else first_index + k - len(resumes)
        spec = RolloutSpec(
            task=task,
            group=group,
            index=idx,
            temperature=temperature,
            seed_key=seed_key(idx) if seed_key else (group, idx),
            sample_id=sample_ids(idx) if sample_ids else sample_id(group, idx),
            resume=resume,
        )
        if cut is not None:
            cut.started(spec.sample_id, group, idx, resume)
            sids.append(spec.sample_id)
        tasks.append(loop.create_task(_report(ctx, spec, i, state)))
    try:
        await state.decided
    finally:
        # Cancel the rest (their aborts are shielded) and wait for every one: the group never leaves
        # rollouts behind. A task cancelled before it ran never entered run_sample: release its count.
        await cancel_and_wait(tasks, lambda k: ctx.router.release(engines[k]))
        for sid in sids:  # the ones cancelled before they ran (_report unregisters the others)
            cut.settled(sid)  # type: ignore[union-attr]  # sids only with a cut
        state.release_held()  # samples still held back when the group decided: never handed over
    if state.error is not None:
        raise state.error
    if state.kept == need and state.done < state.n:
        ctx.counters["rollout/aborted_redundant"] += state.n - state.done
    return state.kept == need


class _GroupState:
    """One run_group's tally. Samples report into it from their own tasks, in the order they finish
    (no stream, no wake-up of the group task per sample); ``decided`` resolves once the group has
    ``need`` ok samples, can no longer get them, or a rollout raised.

    Which ``need`` are kept (``rollout.redundant_keep``):
      finish_order (``first_index`` None): the first ``need`` ok samples to finish. Fastest, but the kept
        set is selected on finishing time: trajectories that end early (few turns, fast env calls, an
        early win or an early give-up) are over-represented in what the policy trains on.
      launch_order (``order`` given: the group's ``n`` sample indices in launch order, ascending): the
        ``need`` ok samples of lowest launch position (a sample's slot is its index's place in ``order``:
        a resumed group's restored indices have gaps and lie below its fresh ones). A sample is delivered
        only once every sample launched before it has finished, so the kept set depends on which samples
        failed, never on how long any took: the extra rollouts stand in for failed (or timed-out) ones
        only. Invariant: the kept samples are exactly the first ``need`` ok ones in launch order among
        those decided. A finished ok sample waiting for an earlier one is in the cut's ``held`` (when
        there is a cut: cut.CheckpointCut.hold) from the step it finished to the step it is delivered
        or the group decides without it.
    """

    __slots__ = ("need", "n", "on_sample", "decided", "kept", "done", "error", "slots", "results", "cursor", "ok",
                 "cut")

    def __init__(self, need: int, n: int, on_sample: Callable[[Trajectory], object], decided: asyncio.Future[None],
                 order: Sequence[int] | None = None, cut: CheckpointCut | None = None) -> None:
        self.need = need
        self.n = n
        self.on_sample = on_sample
        self.decided = decided
        self.kept = 0
        self.done = 0
        self.error: BaseException | None = None
        self.slots: dict[int, int] | None = None  # launch_order: sample index -> launch position
        if order is not None:
            if len(order) != n or len(set(order)) != n:
                raise ValueError(f"launch order {list(order)}: {n} distinct sample indices expected")
            self.slots = {idx: k for k, idx in enumerate(order)}
        self.results: list[Trajectory | None] = [None] * n if order is not None else []
        self.cursor = 0  # launch_order: every position below it is finished and delivered (or failed)
        self.ok = 0  # ok samples finished, delivered or not
        self.cut = cut

    def finish(self, traj: Trajectory) -> None:
        if self.decided.done():
            return  # finished after the group had what it needed (counted as aborted)
        self.done += 1
        if traj.status == "ok":
            self.ok += 1
        if self.slots is None:
            if traj.status == "ok":
                self.kept += 1
                self.on_sample(traj)
        else:
            slot = self.slots.get(traj.index)
            if slot is None or self.results[slot] is not None:
                raise RuntimeError(f"sample {traj.sample_id}: index {traj.index} is not one launch position of its "
                                   f"group's ({sorted(self.slots)}) or finished twice")
            self.results[slot] = traj
            if self.cut is not None and slot > self.cursor and traj.status == "ok":
                self.cut.hold(traj)  # waits for an earlier launch (in the same step as its unregistering)
            while self.cursor < self.n and self.kept < self.need and (t := self.results[self.cursor]) is not None:
                if self.cut is not None:
                    self.cut.handed(t.sample_id)
                if t.status == "ok":
                    self.kept += 1
                    self.on_sample(t)
                self.cursor += 1
        if self.kept == self.need or self.ok + (self.n - self.done) < self.need:
            self.decided.set_result(None)  # redundant (or hopeless) rollouts: abort them now
            self.release_held()

    def release_held(self) -> None:
        """The group decided: none of its samples waits to be handed over any more."""
        if self.cut is not None:
            for t in self.results[self.cursor:]:
                if t is not None:
                    self.cut.handed(t.sample_id)

    def fail(self, e: BaseException) -> None:
        if self.error is None:  # a bug is raised even when it comes after the group was decided
            self.error = e
        if not self.decided.done():
            self.decided.set_result(None)


async def _report(ctx: RolloutContext, spec: RolloutSpec, i: int, state: _GroupState) -> None:
    try:
        state.finish(await run_sample(ctx, spec, i))
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - a bug (or on_sample's error): the group raises it
        state.fail(e)
    finally:
        # in the step that handed the sample to its group (buffer.add): a cut sees it there or here, never
        # in neither or both
        if (cut := ctx.cut_for(spec.group)) is not None:
            cut.settled(spec.sample_id)
