"""The one staleness rule (flashrl/core/staleness.py) and its users agreeing with it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashrl.controller.buffer import SampleBuffer
from flashrl.controller.types import Trajectory
from flashrl.core.staleness import Staleness, lag_stats
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
    assert repr(r) == "Staleness(async_ratio=1, next_step=2)"


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
