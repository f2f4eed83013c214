"""The trainer, the parts that need no process group: how samples are dealt to ranks, mini- and micro-batches.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_trainer_process.py."""

from __future__ import annotations

from flashrl.trainer.worker import plan_micro_batches


# ---------------------------------------------------------------------- pure planning
def test_plan_covers_every_sample_once_with_equal_micro_counts() -> None:
    n, world = 15, 2
    plans = [plan_micro_batches(n, world, r, mini_batches=5, micro_batch=1) for r in range(world)]
    seen = sorted(int(i) for p in plans for _, micros in p for m in micros for i in m)
    assert seen == list(range(n))
    for (mini0, m0), (mini1, m1) in zip(*plans):
        assert mini0.tolist() == mini1.tolist()  # both ranks agree on the mini-batch
        assert len(m0) == len(m1) == 2  # 3 samples over 2 ranks, 1 per micro: the busiest rank's count
        assert [len(x) for x in m1] == [1, 0]  # rank 1 runs one masked (empty) micro-batch
    assert [mini.tolist() for mini, _ in plans[0]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]]


def test_shuffled_plan_deals_every_sample_once_in_a_seeded_order() -> None:
    """trainer.shuffle: the order is a function of (seed, step) only, so every rank (and a resumed run) deals
    the same mini-batches; another step or seed deals others; every sample still lands exactly once."""
    from flashrl.trainer.step import shuffle_order

    n, world = 16, 2
    order = shuffle_order(n, seed=3, step=7)
    assert sorted(order.tolist()) == list(range(n)) and order.tolist() != list(range(n))
    assert shuffle_order(n, 3, 7).tolist() == order.tolist()
    assert shuffle_order(n, 3, 8).tolist() != order.tolist() and shuffle_order(n, 4, 7).tolist() != order.tolist()
    plans = [plan_micro_batches(n, world, r, mini_batches=2, micro_batch=4, order=order) for r in range(world)]
    assert [mini.tolist() for mini, _ in plans[0]] == [order[:8].tolist(), order[8:].tolist()]
    seen = sorted(int(i) for p in plans for _, micros in p for m in micros for i in m)
    assert seen == list(range(n))
