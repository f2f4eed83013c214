"""The one staleness rule (flashrl/core/staleness.py) and its users agreeing with it."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashrl.controller.buffer import Group, GroupState, SampleBuffer
from flashrl.controller.types import Trajectory
from flashrl.core.staleness import Staleness, lag_stats, wait_ok
from flashrl.env import Task

ints = st.integers(min_value=-5, max_value=50)


def test_bound_at_the_edges() -> None:
    r = Staleness(2)
    # trained at step 5, i.e. by the update that makes version 6: versions 3, 4, 5 pass, 2 does not
    assert [r.fresh(5, v) for v in (2, 3, 4, 5)] == [False, True, True, True]
    assert r.oldest(5) == 3 and Staleness.lag(5, 3) == 2
    sync = Staleness(0)
    assert sync.fresh(4, 4) and not sync.fresh(4, 3)  # async_ratio 0: exactly on-policy
    assert r.capacity(8) == 24 and sync.capacity(8) == 8  # (async_ratio + 1) * batch_prompts
    with pytest.raises(ValueError, match="scheduler.async_ratio"):
        Staleness(-1)


def test_next_step_only_grows_and_dooms() -> None:
    r = Staleness(1)
    assert r.next_step == 0 and not r.doomed(0)
    r.taken(0)
    assert r.next_step == 1 and not r.doomed(0)  # step 1 may still train version 0
    r.taken(1)
    assert r.next_step == 2 and r.doomed(0) and not r.doomed(1)
    r.taken(0)  # an older step reported late never moves it back
    assert r.next_step == 2
    assert repr(r) == "Staleness(async_ratio=1, next_step=2, mode='drop')"
    # wait and partial never give a sample up for its age
    assert not Staleness(1, next_step=9, mode="wait").doomed(0) and not Staleness(1, next_step=9, mode="partial").doomed(0)
    with pytest.raises(ValueError, match="scheduler.stale"):
        Staleness(1, mode="keep")  # type: ignore[arg-type]


@given(ratio=st.integers(min_value=0, max_value=8), step=ints, v=ints)
def test_fresh_oldest_doomed_are_one_inequality(ratio: int, step: int, v: int) -> None:
    r = Staleness(ratio, next_step=step)
    assert r.fresh(step, v) == (v >= r.oldest(step)) == (Staleness.lag(step, v) <= ratio)
    assert r.doomed(v) == (not r.fresh(step, v))
    # doomed at the next step means fresh at no later step either (the early abort loses nothing)
    if r.doomed(v):
        assert not any(r.fresh(s, v) for s in range(step, step + 10))


def test_lag_stats() -> None:
    assert lag_stats(5, [5, 4, 3]) == (1.0, 2)
    assert lag_stats(3, []) == (0.0, 0)
    assert lag_stats(2, iter([2])) == (0.0, 0)


def _traj(uid: int, index: int, version: int) -> Trajectory:
    return Trajectory(sample_id=f"{uid}-{index}", group=uid, index=index, response_ids=[1], loss_mask=[1],
                      behav_logp=[-0.1], versions=[version])


@given(ratio=st.integers(min_value=0, max_value=3), step=st.integers(min_value=0, max_value=6),
       versions=st.lists(st.integers(min_value=0, max_value=6), min_size=2, max_size=2))
def test_buffer_keeps_exactly_what_the_rule_calls_fresh(ratio: int, step: int, versions: list[int]) -> None:
    rule = Staleness(ratio)
    buf = SampleBuffer(group_size=2, batch_prompts=1, staleness=rule)
    g = buf.admit(0, Task(id="0", prompt=""))
    buf.start(g, 2)
    for k, v in enumerate(versions):
        buf.add(_traj(0, k, v))
    batch, refills = buf.take_batch(step)
    kept = [v for v in versions if rule.fresh(step, v)]
    if len(kept) == 2:
        assert batch is not None and refills == [] and rule.next_step == step + 1
    else:
        assert batch is None and refills == [g] and rule.next_step == 0
        assert [t.version_start for t in g.samples] == kept
        assert buf.counters["stale/dropped_samples"] == 2 - len(kept)


# --------------------------------------------------------------------------- wait and partial: the proofs
@given(step=st.integers(0, 5), batch=st.integers(1, 4), deadlines=st.lists(st.integers(-1, 12), max_size=12))
def test_wait_ok_is_the_counting_condition(step: int, batch: int, deadlines: list[int]) -> None:
    """wait_ok(s, D, B) iff for every k >= 0 at most k * B deadlines are <= s + k."""
    brute = all(sum(d <= step + k for d in deadlines) <= k * batch for k in range(0, 20))
    assert wait_ok(step, deadlines, batch) == brute


@given(step=st.integers(0, 5), batch=st.integers(1, 4), deadlines=st.lists(st.integers(0, 14), max_size=16))
def test_an_earliest_deadline_batch_restores_the_invariant(step: int, batch: int, deadlines: list[int]) -> None:
    """The first half of why a wait ends: before a batch, at most (k + 1) * B groups due by s + k for
    every k; once every group is complete, the B earliest deadlines taken leave wait_ok true."""
    assume(len(deadlines) >= batch)
    assume(all(sum(d <= step + k for d in deadlines) <= (k + 1) * batch for k in range(0, 20)))
    assert wait_ok(step, sorted(deadlines)[batch:], batch)


def _schedule(mode: str, ratio: int, batch: int, group: int, steps: int, seed: int, ordered: bool = False,
              evals: bool = False) -> tuple[SampleBuffer, list[tuple[int, list[Group]]]]:
    """The controller's protocol on one SampleBuffer, events in a random order (a random long tail):
    admit while there is capacity (the admitted version is the published one); a running group
    completes with each sample's first token at a version between its admitted one and the engines'
    newest; the train loop takes the batch of step s, trains it once version s is published, then
    starts the sync of s + 1 (overlap: the next batch may be taken meanwhile); a sync lands, the
    batch it trained is marked trained. Returns the buffer and every (step, batch) trained.

    ``evals``: evals come and go too (publisher.hold/unhold): while one holds the engines at the
    published version, every version the trainer makes is deferred (its batch's slots stay taken and
    the buffer may lend them, invariant 6) and the trainer goes on; when it ends, the newest version
    loads and frees every deferred batch, in order."""
    rng = random.Random(seed)
    published = [0]
    held: list[int] = []  # the version an eval holds, while one runs
    deferred: list[list[Group]] = []  # batches whose versions the eval defers (publisher: carried)
    rule = Staleness(ratio, mode=mode)  # type: ignore[arg-type]
    buf = SampleBuffer(group_size=group, batch_prompts=batch, staleness=rule, ordered=ordered,
                       version=lambda: published[0], lending=lambda: held[0] if held else None)
    uid = 0
    step = 0
    training: list[Group] | None = None
    syncing: list[Group] | None = None  # the batch whose update is being published
    trained: list[tuple[int, list[Group]]] = []
    for _ in range(20_000):
        if step >= steps and training is None:
            break
        events = []
        if buf.can_admit():
            events.append("admit")
        running = [g for g in buf.groups.values() if g.state is GroupState.RUNNING]
        if running:
            events += ["complete"] * 3
        if training is None and step < steps:
            events.append("take")
        if training is not None and (published[0] >= step - 1 or held) and syncing is None:
            events.append("train")
        if syncing is not None:
            events.append("sync")
        if evals and not held and syncing is None and not deferred and published[0] == step:
            events.append("eval")
        if held:
            events.append("end")
        assert events, "the schedule is stuck: nothing can happen (a wait that never ends)"
        ev = rng.choice(events)
        if ev == "end" and rng.random() < 0.85:  # evals last: several steps, often past the bound
            continue
        if ev == "admit":
            g = buf.admit(uid, Task(id=str(uid), prompt=""))
            buf.start(g, group)
            uid += 1
        elif ev == "complete":
            # the long tail: half the time the newest group finishes first, old ones linger; a first token
            # often comes at once (the admitted version), else at any version the engines held since
            g = running[-1] if rng.random() < 0.5 else rng.choice(running)
            newest = published[0] + (syncing is not None)  # an engine may hold the version being synced
            for k in range(group):
                v = g.admitted_version if rng.random() < 0.7 else rng.randint(g.admitted_version, newest)
                buf.add(_traj(g.uid, k, v))
        elif ev == "take":
            got, refills = buf.take_batch(step)
            assert refills == [] or mode == "drop"
            if got is not None:
                for g in got:  # a borrower still in its lent slot: only by the steps after the hold's own
                    assert g.lender is None or (held and held[0] + ratio < step <= g.lent_hold + 2 * ratio + 1
                                                and g.admitted_version >= g.lent_hold), (step, held, g.uid)
                training = got
                trained.append((step, got))
        elif ev == "train":  # the trainer is done with step `step`; the sync of step + 1 starts
            assert training is not None
            step += 1
            if held:  # deferred until the eval ends
                deferred.append(training)
            else:
                syncing = training
            training = None
        elif ev == "eval":
            held.append(published[0])
        elif ev == "end":  # the newest version made loads; every batch it carries frees its slots
            held.clear()
            if deferred:
                published[0] = step
                for got in deferred:
                    buf.mark_trained(got)
                deferred.clear()
        else:  # the sync of `step` lands: every engine holds it, the batch's slots are freed
            assert syncing is not None
            published[0] += 1
            buf.mark_trained(syncing)
            syncing = None
        # invariant 1 as partial's proof counts it: lent slots are their lenders' until those are freed
        assert buf.outstanding - buf.unsettled <= buf.capacity
        assert buf.unsettled == sum(g.lender is not None for g in buf.groups.values())
    assert len(trained) == steps, "the schedule did not finish its steps"
    return buf, trained


@settings(max_examples=60, deadline=None)
@given(ratio=st.integers(0, 3), batch=st.integers(1, 3), group=st.integers(1, 2), seed=st.integers(0, 10**6),
       ordered=st.booleans())
def test_wait_never_trains_past_the_bound_never_drops_never_stalls(ratio: int, batch: int, group: int, seed: int,
                                                                 ordered: bool) -> None:
    buf, trained = _schedule("wait", ratio, batch, group, steps=12, seed=seed, ordered=ordered)
    for step, groups in trained:
        for g in groups:
            assert all(step - t.version_start <= ratio for t in g.samples), (step, [t.version_start for t in g.samples])
    assert buf.counters["stale/dropped_samples"] == 0 and buf.counters["stale/over_bound_groups"] == 0
    assert [len(gs) for _, gs in trained] == [batch] * 12


@settings(max_examples=60, deadline=None)
@given(ratio=st.integers(0, 3), batch=st.integers(1, 3), group=st.integers(1, 2), seed=st.integers(0, 10**6))
def test_partial_trains_each_group_within_the_bound_of_its_completion(ratio: int, batch: int, group: int,
                                                                      seed: int) -> None:
    buf, trained = _schedule("partial", ratio, batch, group, steps=12, seed=seed)
    for step, groups in trained:
        assert all(step - g.completed_version <= ratio for g in groups)
    assert buf.counters["stale/dropped_samples"] == 0 and buf.counters["stale/over_bound_groups"] == 0


@settings(max_examples=80, deadline=None)
@given(ratio=st.integers(1, 3), batch=st.integers(1, 3), group=st.integers(1, 2), seed=st.integers(0, 10**6))
def test_partial_keeps_its_bound_with_slots_lent_during_evals(ratio: int, batch: int, group: int, seed: int) -> None:
    """Evals hold the engines while the trainer goes on, and the buffer lends the deferred batches' slots
    (invariant 6): every group is still trained within the bound of the version it joined the order
    at, never before it joined, and that version is one the engines held when it was complete."""
    buf, trained = _schedule("partial", ratio, batch, group, steps=14, seed=seed, evals=True)
    for step, groups in trained:
        assert all(step - g.completed_version <= ratio for g in groups), (step, [g.completed_version for g in groups])
    assert buf.counters["stale/over_bound_groups"] == 0


def test_slots_are_lent_during_evals_and_the_borrowers_wait_for_them() -> None:
    """The evals schedule does lend (the test above is not vacuous). A borrower that completes during the
    eval is parked: not taken by the steps the groups completing during the hold may be in (held + R at
    most), taken after them (as completed at held + R + 1), or, once its lender's version loads, joining
    the completion order at the version loaded then."""
    lent = sum(_schedule("partial", 2, 2, 2, steps=14, seed=s, evals=True)[0].counters["admitted/lent_slots"]
               for s in range(20))
    assert lent > 0
    published = [3]
    held: list[int | None] = [3]
    buf = SampleBuffer(group_size=1, batch_prompts=1, staleness=Staleness(1, mode="partial"),
                       version=lambda: published[0], lending=lambda: held[0])

    def complete(uid: int) -> None:
        buf.start(buf.groups[uid], 1)
        buf.add(_traj(uid, 0, 3))

    for uid in range(2):
        buf.admit(uid, Task(id=str(uid), prompt=""))
        complete(uid)
    assert not buf.can_admit()
    got, _ = buf.take_batch(3)  # trains step 3 -> version 4, deferred by the eval: its slot may be lent
    assert got is not None and buf.can_admit()
    b = buf.admit(2, Task(id="2", prompt=""))
    assert b.lender is got[0] and not buf.can_admit() and buf.counters["admitted/lent_slots"] == 1
    complete(2)
    assert buf.parked == [b] and buf.complete == [buf.groups[1]]
    nxt, _ = buf.take_batch(4)  # held + R: the group completed during the hold, not the parked one
    assert nxt is not None and nxt[0].uid == 1
    c = buf.admit(3, Task(id="3", prompt=""))  # step 4's slot, lent too
    assert c.lender is nxt[0] and not buf.can_admit()
    third, _ = buf.take_batch(5)  # held + R + 1: the parked borrower, as completed at version 5
    assert third == [b] and b.completed_version == 5 and not buf.parked
    assert not buf.can_admit()  # a borrower taken during the hold lends nothing (steps h..h+R only)
    complete(3)
    assert buf.parked == [c]
    held[0] = None  # the eval ends: the newest version (steps 3, 4 and 5 made 4, 5, 6) loads, in order
    published[0] = 6
    buf.mark_trained(got)
    buf.mark_trained(nxt)
    assert buf.parked == [] and buf.complete == [c] and c.completed_version == 6 and buf.unsettled == 0
    buf.mark_trained(third)
    assert buf.admit_room() == 1  # c holds step 4's slot now, no more


def test_drop_breaks_what_wait_keeps() -> None:
    """The same random schedules in drop mode do drop samples: the wait test is not vacuous."""
    dropped = sum(_schedule("drop", 1, 2, 2, steps=12, seed=s)[0].counters["stale/dropped_samples"] for s in range(20))
    assert dropped > 0
