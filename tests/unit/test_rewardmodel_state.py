"""flashrl/rewardmodel/suite.py's combination and its state: a verifier pass always ranks above a fail, the split
is the rollout's (never the task id), the normalization's first episode is not a forced 0, and its statistics
go into checkpoints and come back on resume (in-process controller on fakes, virtual clock)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.config import ConfigError, RewardModelConfig, from_dict
from flashrl.env import Task
from flashrl.resuming import prepare_resume
from flashrl.rewardmodel.client import RewardModelClient
from flashrl.rewardmodel.fake import FakeScorer
from flashrl.rewardmodel.suite import Combiner, RewardModelSuite, RunningStats
from flashrl.sim.fake import FakeSuite
from tests.unit.test_checkpoint import Run, sync_cfg, with_run


def _rewards(c: Combiner, episodes: list[tuple[float, bool, bool]]) -> tuple[list[float], list[float]]:
    """The rewards of (score, verifier passed, training) episodes scored in order: (passed ones, failed ones)."""
    ok: list[float] = []
    bad: list[float] = []
    for score, passed, train in episodes:
        r = c.combine(c.model_reward(score, train), 1.0 if passed else 0.0)
        (ok if passed else bad).append(r)
    return ok, bad


def test_gate_with_normalization_never_ranks_a_correct_answer_below_a_wrong_one() -> None:
    """7feef93: the gate gave a pass model_weight x z, and z is negative for any pass the model likes less than
    its average (-0.51 there) while a fail got gate_reward = 0. Now a pass is at least gate_reward's floor."""
    c = Combiner(RewardModelConfig(model="x", combine="gate", normalize=True))
    episodes = [(3.0, True, True), (2.5, True, True), (-1.0, False, True), (0.5, True, True), (-4.0, False, True),
                (-0.5, True, True)]  # a pass the model doubts: below the running mean
    ok, bad = _rewards(c, episodes)
    assert min(ok) > max(bad) == 0.0
    assert ok[-1] < ok[0]  # the model still orders the passes among themselves


@settings(max_examples=300, deadline=None)
@given(
    transform=st.sampled_from(["sigmoid", "raw"]),
    normalize=st.booleans(),
    verdicts=st.booleans(),
    model_weight=st.floats(1e-3, 100.0),
    gate_reward=st.floats(-10.0, 10.0),
    episodes=st.lists(st.tuples(st.floats(-60.0, 60.0), st.booleans(), st.booleans()), min_size=2, max_size=40),
)
def test_gate_orders_every_pass_above_every_fail(transform: str, normalize: bool, verdicts: bool, model_weight: float,
                                                 gate_reward: float, episodes: list[tuple[float, bool, bool]]) -> None:
    rc = RewardModelConfig(model="x", combine="gate", transform=transform, normalize=normalize,  # type: ignore[arg-type]
                           model_weight=model_weight, gate_reward=gate_reward)
    if verdicts:  # a judge's verdicts are in [0, 1]
        episodes = [(1 / (1 + math.exp(-s)), p, t) for s, p, t in episodes]
    ok, bad = _rewards(Combiner(rc, verdicts=verdicts), episodes)
    if ok and bad:
        if verdicts and not normalize:
            assert min(ok) >= max(bad)  # a verdict of 0 on a pass: level with a fail, never below
        else:
            assert min(ok) > max(bad)
    assert all(r == gate_reward for r in bad) and all(math.isfinite(r) for r in ok)


def test_the_gate_needs_a_positive_model_weight() -> None:
    with pytest.raises(ConfigError, match="reward.model_weight: must be > 0 with combine = \"gate\""):
        from_dict({"reward": {"model": "builtin:rm", "combine": "gate", "model_weight": -1.0}})
    from_dict({"reward": {"model": "builtin:rm", "combine": "sum", "model_weight": -1.0}})  # a sum may subtract


def test_the_first_training_episode_keeps_its_reward() -> None:
    """7feef93 added an episode to the statistics before normalizing it: the first came out (r - r) = 0 whatever
    its score. Now it is normalized by the episodes before it (none: r itself), then joins them."""
    c = Combiner(RewardModelConfig(model="x", transform="raw", normalize=True))
    assert c.model_reward(2.0, True) == 2.0 and c.stats.n == 1
    assert c.model_reward(5.0, True) == 3.0  # against the first: centred, no std yet
    assert c.model_reward(4.0, True) == pytest.approx((4.0 - 3.5) / 1.5)
    a, b = (Combiner(RewardModelConfig(model="x", normalize=True)) for _ in range(2))
    assert a.model_reward(3.0, True) != b.model_reward(-3.0, True)  # a good first answer is told from a bad one


def test_running_stats_state_round_trips_and_refuses_garbage() -> None:
    rs = RunningStats()
    for x in (1.0, 2.0, 4.0):
        rs.add(x)
    back = RunningStats()
    back.load(rs.state())
    assert (back.n, back.mean, back.std) == (rs.n, rs.mean, rs.std)
    with pytest.raises(ValueError, match="not a Welford state"):
        back.load({"n": 3, "mean": 1.0, "m2": -1.0})


# ----------------------------------------------------------------------------- in the controller
def _score(text: str) -> float:
    return (zlib.crc32(text.encode()) % 1000) / 250.0 - 2.0  # deterministic, spread over [-2, 2)


class SameIdsSuite(FakeSuite):
    """Held-out tasks named like training ones, as a dataset read twice from one folder names its rows."""

    def eval_tasks(self) -> list[Task]:
        return self._tasks("t", self.n_eval)


def _suite(inner: FakeSuite) -> RewardModelSuite:
    rc = RewardModelConfig(model="x", normalize=True)
    return RewardModelSuite(inner, RewardModelClient(FakeScorer(_score), batch_wait_s=0.0), rc)


def _trained(records: list[dict[str, Any]]) -> int:
    return sum(int(r["samples"]) for r in records if r["step"] > 0)


@pytest.mark.parametrize("inner", [FakeSuite, SameIdsSuite], ids=["own-ids", "shared-ids"])
def test_training_episodes_alone_feed_the_statistics_whatever_the_ids(tmp_path: Path, inner: type[FakeSuite]) -> None:
    """7feef93 took every episode whose task id is a held-out id for a held-out one: with shared ids the
    training prompts t0..t2 never reached the statistics (and were scored as evals). The split is the rollout's."""
    suite = _suite(inner(n_train=5, n_eval=3))
    run = Run(sync_cfg(tmp_path, checkpoint_every=0), suite)
    run.go()
    evals = [r for r in run.records if "eval/accuracy" in r]
    assert len(evals) >= 2  # held-out episodes were scored beside training (score_evals)
    assert suite.combiner.stats.n == _trained(run.records) == 6 * 2 * 3


def test_statistics_are_checkpointed_and_restored_and_their_mean_is_not_summed(tmp_path: Path) -> None:
    """7feef93 kept the statistics in the process only: a resumed run started them again from nothing, and
    env/rm_norm_mean_x1000 (a gauge) was added to the checkpoint's. Both are checked against one
    uninterrupted run of the same steps."""
    ref_suite = _suite(FakeSuite(n_train=5, n_eval=3))
    ref = Run(sync_cfg(tmp_path / "a"), ref_suite)
    ref.go()
    cfg = sync_cfg(tmp_path / "b", steps=3)
    first_suite = _suite(FakeSuite(n_train=5, n_eval=3))
    Run(cfg, first_suite).go()
    r = prepare_resume(with_run(cfg, steps=6))
    assert r.state.env_state == {"norm": first_suite.combiner.stats.state()} and first_suite.combiner.stats.n > 0
    suite = _suite(FakeSuite(n_train=5, n_eval=3))
    second = Run(with_run(cfg, steps=6), suite, resume=r)
    assert suite.combiner.stats.state() == first_suite.combiner.stats.state()  # restored before any episode
    second.go()
    assert suite.combiner.stats.n == ref_suite.combiner.stats.n == _trained(ref.records)
    assert suite.combiner.stats.mean == pytest.approx(ref_suite.combiner.stats.mean)
    assert suite.combiner.stats.std == pytest.approx(ref_suite.combiner.stats.std)
    last = second.records[-1]["env/rm_norm_mean_x1000"]
    assert last == pytest.approx(1000 * suite.combiner.stats.mean, abs=1)  # the run's mean, once
    assert last == pytest.approx(ref.records[-1]["env/rm_norm_mean_x1000"], abs=1)
