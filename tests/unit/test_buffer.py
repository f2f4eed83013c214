"""SampleBuffer: capacity (the admission side of the staleness bound), per-sample staleness, order."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.controller.buffer import GroupState, SampleBuffer
from flashrl.controller.types import Trajectory
from flashrl.core.staleness import Staleness
from flashrl.env import Task
from flashrl.sim.clock import run_virtual


def traj(group: int, index: int, version: int, reward: float = 0.0) -> Trajectory:
    # two generated tokens, an observation token, one more generated token (versions may differ)
    return Trajectory(
        sample_id=f"{group}-{index}",
        group=group,
        index=index,
        prompt_ids=[1],
        response_ids=[5, 6, 7, 8],
        loss_mask=[1, 1, 0, 1],
        behav_logp=[-0.1, -0.2, 0.0, -0.3],
        versions=[version, version + 1, -1, version + 1],
        reward=reward,
    )


def make(ratio: int = 1, batch: int = 2, group: int = 2, **kw) -> SampleBuffer:
    return SampleBuffer(group_size=group, batch_prompts=batch, staleness=Staleness(ratio), **kw)


def fill(buf: SampleBuffer, uid: int, version: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> None:
    g = buf.groups[uid]
    first = buf.start(g, len(rewards))
    for k, r in enumerate(rewards):
        buf.add(traj(uid, first + k, version, r))


@pytest.mark.parametrize("ratio,batch", [(0, 1), (0, 3), (1, 2), (3, 4)])
def test_capacity_is_exact(ratio: int, batch: int) -> None:
    buf = make(ratio=ratio, batch=batch)
    n = 0
    while buf.can_admit():
        buf.admit(n, Task(id=str(n), prompt=""))
        n += 1
    assert n == (ratio + 1) * batch == buf.capacity
    with pytest.raises(RuntimeError, match="over capacity"):
        buf.admit(n, Task(id="x", prompt=""))
    # completing groups frees nothing; only publishing the update that trained them does
    for uid in range(batch):
        fill(buf, uid, version=0)
    assert not buf.can_admit()
    got, refills = buf.take_batch(step=0)
    assert got is not None and refills == []
    assert not buf.can_admit()
    buf.mark_trained(got)
    assert buf.outstanding == buf.capacity - batch
    assert [g.state for g in got] == [GroupState.TRAINED] * batch


def test_batches_are_whole_groups_in_completion_order_samples_by_index() -> None:
    buf = make(ratio=1, batch=2)
    for uid in range(4):
        buf.admit(uid, Task(id=str(uid), prompt=""))
    for uid in (2, 0, 3, 1):  # completion order
        g = buf.groups[uid]
        buf.start(g, 2)
        buf.add(traj(uid, 1, 0))
        buf.add(traj(uid, 0, 0))
    batch, _ = buf.take_batch(0)
    assert batch is not None
    assert [g.uid for g in batch] == [2, 0]
    assert [t.index for t in batch[0].samples] == [0, 1]
    batch2, _ = buf.take_batch(1)
    assert batch2 is not None and [g.uid for g in batch2] == [3, 1]


def test_ordered_mode_takes_admission_order() -> None:
    buf = make(ratio=1, batch=2, ordered=True)
    for uid in range(4):
        buf.admit(uid, Task(id=str(uid), prompt=""))
    for uid in (3, 1, 2, 0):
        fill(buf, uid, 0)
    batch, _ = buf.take_batch(0)
    assert batch is not None and [g.uid for g in batch] == [0, 1]


def test_stale_samples_are_dropped_counted_and_refilled() -> None:
    buf = make(ratio=1, batch=1, group=2)
    buf.admit(0, Task(id="0", prompt=""))
    g = buf.groups[0]
    buf.start(g, 2)
    buf.add(traj(0, 0, version=0))  # fresh until step 1
    buf.add(traj(0, 1, version=2))
    # at step 2 the version-0 sample lags 2 > async_ratio = 1
    batch, refills = buf.take_batch(step=2)
    assert batch is None
    assert refills == [g] and g.state is GroupState.RUNNING and g.missing == 1
    assert [t.index for t in g.samples] == [1]
    assert buf.counters["stale/dropped_samples"] == 1
    # the refill gets new sample indices (new seeds), never reuses the dropped one
    assert buf.start(g, 1) == 2
    buf.add(traj(0, 2, version=2))
    batch, refills = buf.take_batch(step=2)
    assert refills == [] and batch is not None
    assert all(2 - t.version_start <= 1 for t in batch[0].samples)
    # handing out the batch of step 2 tells the shared rule: no earlier step takes a sample now
    assert buf.staleness.next_step == 3 and buf.staleness.doomed(1) and not buf.staleness.doomed(2)


def test_version_start_is_first_generated_token() -> None:
    t = Trajectory(sample_id="0-0", group=0, index=0, loss_mask=[0, 1, 1], versions=[-1, 4, 5], version_sent=2)
    assert t.version_start == 4
    assert Trajectory(sample_id="0-0", group=0, index=0, version_sent=2).version_start == 2


def test_group_keeps_first_finishers_refuses_late_samples() -> None:
    buf = make(ratio=0, batch=1, group=2)
    buf.admit(0, Task(id="0", prompt=""))
    g = buf.groups[0]
    buf.start(g, 3)
    assert buf.add(traj(0, 2, 0))
    assert buf.add(traj(0, 0, 0))
    assert not buf.add(traj(0, 1, 0))
    assert buf.counters["buffer/late_samples"] == 1
    assert [t.index for t in g.samples] == [2, 0]


def test_filter_ties_drops_group_and_frees_slot() -> None:
    buf = make(ratio=0, batch=1, group=2, filter_ties=True)
    buf.admit(0, Task(id="0", prompt=""))
    fill(buf, 0, 0, rewards=(1.0, 1.0))
    assert buf.outstanding == 0 and buf.can_admit()
    assert buf.counters["dropped/groups_ties"] == 1
    assert buf.counters["dropped/samples"] == 2


def test_drop_unfillable_frees_slot_and_counts() -> None:
    buf = make(ratio=0, batch=1, group=2)
    buf.admit(0, Task(id="0", prompt=""))
    g = buf.groups[0]
    buf.start(g, 2)
    buf.add(traj(0, 0, 0))
    buf.drop(g, "unfillable")
    assert g.state is GroupState.DROPPED and buf.outstanding == 0
    assert buf.counters["dropped/groups_unfillable"] == 1 and buf.counters["dropped/samples"] == 1
    assert buf.dropped_uids == [0]  # checkpointed: the chaos report accounts for every uid


def _recount(buf: SampleBuffer) -> int:
    return sum(g.state in (GroupState.ADMITTED, GroupState.RUNNING) for g in buf.groups.values())


OPS = ["admit", "admit", "add", "add", "add", "add", "take", "take", "drop"]  # weighted: runs reach later steps


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(0, 3)), min_size=20, max_size=120),
       st.integers(0, 2), st.booleans())
def test_counters_and_incremental_staleness_checks_match_a_full_recount(
    ops: list[tuple[str, int, int]], ratio: int, ties: bool
) -> None:
    """``generating`` is a counter and take_batch re-checks only what can have changed: after any
    sequence of transitions both must agree with recounting / re-checking everything."""
    buf = make(ratio=ratio, batch=2, group=2, filter_ties=ties)
    step, uid = 0, 0
    for op, k, lag in ops:
        live = [g for g in buf.groups.values() if g.state in (GroupState.ADMITTED, GroupState.RUNNING)]
        if op == "admit" and buf.can_admit():
            buf.admit(uid, Task(id=str(uid), prompt=""))
            uid += 1
        elif op == "add" and live:
            g = live[k % len(live)]
            if g.state is GroupState.ADMITTED:
                buf.start(g, g.missing)
            buf.add(traj(g.uid, g.next_index, version=max(0, step - lag), reward=float(k % 2)))
            g.next_index += 1
        elif op == "drop":
            droppable = [g for g in buf.groups.values() if g.state is not GroupState.TRAINING]
            if droppable:
                buf.drop(droppable[k % len(droppable)], "unfillable")
        elif op == "take":
            batch, refills = buf.take_batch(step)
            for g in refills:
                buf.start(g, g.missing)
            # invariant 2 at this step, for everything still waiting and everything taken
            for g in buf.complete + (batch or []):
                assert all(step - t.version_start <= ratio for t in g.samples), (step, g.uid)
            if batch is not None:
                buf.mark_trained(batch)
                step += 1
        assert buf.generating == _recount(buf)
    assert buf.outstanding == len(buf.groups) <= buf.capacity


def test_waiters_wake_on_a_completed_group_not_on_every_sample() -> None:
    async def main() -> list[str]:
        buf = make(ratio=0, batch=1, group=2)
        seen: list[str] = []

        async def watch() -> None:
            await buf.changed()
            seen.append(f"woken with {len(buf.complete)} complete")

        buf.admit(0, Task(id="0", prompt=""))
        g = buf.groups[0]
        buf.start(g, 2)
        w = asyncio.get_running_loop().create_task(watch())
        await asyncio.sleep(0)
        buf.add(traj(0, 0, 0))  # the group is still one short: nothing a loop decides on changed
        await asyncio.sleep(0)
        assert seen == []
        buf.add(traj(0, 1, 0))
        await w
        return seen

    assert run_virtual(main).result == ["woken with 1 complete"]


@given(ratio=st.integers(0, 3), batch=st.integers(1, 3), steps=st.integers(1, 6), drops=st.integers(0, 3),
       order=st.randoms(use_true_random=False))
@settings(max_examples=120, deadline=None)
def test_a_run_admits_no_more_groups_than_it_trains(ratio: int, batch: int, steps: int, drops: int, order) -> None:
    """Invariant 5: with total_steps the run admits exactly the groups it trains (plus one per group
    dropped unfillable), whatever the completion order, so it ends with nothing outstanding."""
    buf = make(ratio=ratio, batch=batch, total_steps=steps)
    admitted: list[int] = []
    trained = 0
    step = 0
    while step < steps:
        for _ in range(buf.admit_room()):
            uid = len(admitted)
            buf.admit(uid, Task(id=str(uid), prompt=""))
            admitted.append(uid)
        assert buf.outstanding <= buf.capacity
        running = [g for g in buf.groups.values() if g.state is GroupState.ADMITTED]
        assert running, "the run must be able to go on: a batch is short and nothing generates"
        g = order.choice(running)
        if drops and len(running) > 1:
            drops -= 1
            buf.drop(g, "unfillable")
            continue
        fill(buf, g.uid, version=step)
        got, _ = buf.take_batch(step)
        if got is not None:
            buf.mark_trained(got)
            trained += len(got)
            step += 1
    assert trained == steps * batch
    assert buf.outstanding == 0 and buf.admit_room() == 0
    assert len(admitted) == trained + buf.counters["dropped/groups_unfillable"]


def test_admission_room_counts_a_training_batch_as_taken() -> None:
    """Invariant 5 while a batch trains: its groups are already counted against the steps left, so the
    room is what the later steps still need (the TRAINING count is kept, not scanned, per admission)."""
    buf = make(ratio=2, batch=2, total_steps=3)
    for uid in (0, 1):
        buf.admit(uid, Task(id=str(uid), prompt=""))
        fill(buf, uid, version=0)
    batch, _ = buf.take_batch(0)
    assert batch is not None
    assert buf.admit_room() == 4  # steps 1 and 2 need 4 groups; the 2 training are step 0's
    buf.mark_trained(batch)
    assert buf.admit_room() == 4
    buf.admit(2, Task(id="2", prompt=""))
    assert buf.admit_room() == 3


def test_admission_room_without_total_steps_is_the_capacity() -> None:
    buf = make(ratio=2, batch=2)
    assert buf.admit_room() == 6
    buf.admit(0, Task(id="0", prompt=""))
    assert buf.admit_room() == 5
