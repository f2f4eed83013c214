"""Scheduling decisions: data order, request seeds, admission modes, least-loaded routing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.controller.scheduler import (
    Admission,
    DataStream,
    Router,
    request_seed,
    sample_id,
)
from flashrl.core.meters import BusyMeter
from flashrl.env import Task


def tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"p{i}") for i in range(n)]


def test_data_stream_is_a_seeded_shuffle_epoch_after_epoch() -> None:
    ds = DataStream(tasks(5), seed=3)
    first = [ds.next() for _ in range(5)]
    second = [ds.next() for _ in range(5)]
    assert [uid for uid, _ in first + second] == list(range(10))
    # each epoch is a permutation of the split
    assert sorted(t.id for _, t in first) == [f"t{i}" for i in range(5)]
    assert sorted(t.id for _, t in second) == [f"t{i}" for i in range(5)]
    assert ds.epoch == 1
    # same seed -> same order; another seed -> another order (over 3 epochs of 5 tasks)
    again = DataStream(tasks(5), seed=3)
    assert [again.next()[1].id for _ in range(10)] == [t.id for _, t in first + second]
    other = DataStream(tasks(5), seed=4)
    assert [other.next()[1].id for _ in range(15)] != [DataStream(tasks(5), seed=3).next()[1].id for _ in range(15)]


def test_data_stream_rejects_empty_split() -> None:
    with pytest.raises(ValueError, match="train split is empty"):
        DataStream([], seed=0)


def test_request_seed_depends_only_on_position() -> None:
    s = request_seed(1, 2, 3, 0)
    assert s == request_seed(1, 2, 3, 0)
    assert 0 <= s < 2**63
    others = {request_seed(1, 2, 3, 1), request_seed(1, 2, 4, 0), request_seed(1, 3, 3, 0), request_seed(2, 2, 3, 0)}
    assert s not in others and len(others) == 4
    assert sample_id(7, 2) == "7-2"


def test_admission_queue_mode_refills_any_free_slot() -> None:
    a = Admission(queue_scheduling=True)
    assert a.admit_count(outstanding=0, capacity=6, generating=0) == 6
    assert a.admit_count(outstanding=5, capacity=6, generating=5) == 1
    assert a.admit_count(outstanding=6, capacity=6, generating=0) == 0


def test_admission_barrier_mode_waits_for_the_round_to_finish() -> None:
    a = Admission(queue_scheduling=False)
    assert a.admit_count(outstanding=0, capacity=4, generating=0) == 4
    # one group still generating: no new prompt even though slots are free
    assert a.admit_count(outstanding=2, capacity=4, generating=1) == 0
    # all generated (2 complete waiting for the trainer): fill up to capacity
    assert a.admit_count(outstanding=2, capacity=4, generating=0) == 2


def test_router_least_loaded_then_round_robin() -> None:
    r = Router(3, max_num_seqs=4)
    r.inflight[:] = [3, 1, 2]
    assert r.pick() == 1
    assert r.inflight == [3, 2, 2]
    # ties (1 and 2 at 2) go round-robin from the engine after the last pick
    assert r.pick() == 2
    assert r.pick() == 1
    assert r.inflight == [3, 3, 3]
    assert [r.pick() for _ in range(3)] == [2, 0, 1]
    r.release(0)
    r.release(0)
    assert r.pick() == 0


def test_router_spreads_a_burst_exactly_and_skips_dead_engines() -> None:
    r = Router(4, max_num_seqs=4)
    picks = [r.pick() for _ in range(10)]
    assert [picks.count(i) for i in range(4)] == [3, 3, 2, 2]
    r.mark_dead(1)
    picks = [r.pick() for _ in range(6)]
    assert 1 not in picks
    assert r.inflight == [5, 3, 4, 4]
    assert r.live == [0, 2, 3]
    for i in (0, 2, 3):
        r.mark_dead(i)
    with pytest.raises(RuntimeError, match="no live engine"):
        r.pick()


def test_busy_meter_is_a_sliding_window_of_overlapping_requests() -> None:
    m = BusyMeter(window_s=10.0, start=0.0)
    assert m.fraction(0.0) == 0.0
    m.enter(1.0)
    m.enter(2.0)  # overlapping requests count once
    m.exit(3.0)
    assert m.fraction(4.0) == pytest.approx(3.0 / 4.0)  # open period [1, 4] over the 4 s so far
    m.exit(5.0)
    assert m.fraction(5.0) == pytest.approx(4.0 / 5.0)
    m.enter(12.0)
    assert m.fraction(14.0) == pytest.approx((1.0 + 2.0) / 10.0)  # [4, 5] tail of [1, 5], and [12, 14]
    m.exit(14.0)
    assert m.fraction(25.0) == 0.0  # everything has left the window
    assert len(m._closed) == 0
    assert m.busy_s(25.0) == pytest.approx(4.0 + 2.0)  # busy seconds ever: [1, 5] and [12, 14], pruned or not
    m.enter(30.0)
    assert m.busy_s(31.5) == pytest.approx(7.5)  # the open period counts up to now
    m.exit(31.5)
    with pytest.raises(RuntimeError, match="without a matching enter"):
        m.exit(26.0)
    with pytest.raises(ValueError, match="window_s"):
        BusyMeter(window_s=0.0)


def test_busy_meter_prunes_without_being_read() -> None:
    """Nobody reads it in a headless benchmark: memory must still stay bounded by one window."""
    m = BusyMeter(window_s=1.0)
    for k in range(10_000):
        m.enter(k * 0.1)
        m.exit(k * 0.1 + 0.05)
    assert len(m._closed) <= 11
    assert m.fraction(10_000 * 0.1) == pytest.approx(0.5)


def _reference_pick(inflight: list[int], alive: list[bool], rr: int) -> int:
    """The routing rule spelled out: fewest inflight among live engines, ties from ``rr`` onwards."""
    n = len(inflight)
    order = [(rr + k) % n for k in range(n)]
    live = [i for i in order if alive[i]]
    return min(live, key=lambda i: (inflight[i], order.index(i)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=9), st.data())
def test_router_fast_path_matches_the_routing_rule(loads: list[int], data: st.DataObject) -> None:
    """pick() scans in C while every engine is live; the choice must be the rule's, dead or not."""
    n = len(loads)
    r = Router(n, max_num_seqs=4)
    r.inflight[:] = loads
    ref, rr = list(loads), 0
    alive = [True] * n
    for step in range(4 * n):
        if step == 2 * n:  # then some engines die: the slow path takes over
            for i in data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1)):
                r.mark_dead(i)
                alive[i] = False
        if data.draw(st.booleans()):
            want = _reference_pick(ref, alive, rr)
            assert r.pick() == want
            ref[want] += 1
            rr = (want + 1) % n
        else:
            i = data.draw(st.integers(0, n - 1))
            if ref[i] > 0:
                r.release(i)
                ref[i] -= 1
        assert r.inflight == ref
