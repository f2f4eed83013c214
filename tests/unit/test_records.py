"""Typed step records (flashrl.core.records): the metrics.jsonl line keeps the keys, in the order,
that the benches and tools parse (flashrl/bench/steptime.py, peers.py, chaos.py), and a line
reads back into the same record (a checkpoint's pending record)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flashrl.config import Config
from flashrl.controller.controller import Controller
from flashrl.core.records import BatchStats, EvalStats, StepRecord
from flashrl.env import StepResult
from flashrl.metrics import MetricsWriter
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import (
    FakeEngine,
    FakeEnv,
    FakeSuite,
    FakeTokenizer,
    FakeTrainer,
    default_script,
)
from flashrl.wire.protocol import TrainBatch, TrainResult, WeightManifest

# The keys of the dict-built records before typed records (main at 313dd95, the same run as below), plus the
# lineage keys after response_len/mean (tokens/trained ... lineage/interrupted_frac), and since evals run off the
# training path, what an eval cost (time/eval_wait_s, time/eval/*, eval/engine_share) in place of the sync's wait
# for it (time/sync/quiesce_s).
EVAL_COST = ["time/eval_s", "time/eval/trainer_wait_s", "time/eval/gen_wait_s", "eval/engine_share"]
EVAL_ONLY = ["step", "version", "eval/accuracy", "eval/reward_mean", "eval/reward/format", "eval/reward/mean", *EVAL_COST]
TRAINED = [
    "loss", "train/samples", "train/reward/mean", "reward/std", "step_time_s", "mismatch/kl", "time/trainer/forward_s",
    "train/staleness/max", "step", "version", "reward/mean", "staleness/mean", "staleness/max", "time/step_s",
    "time/train_s", "time/weight_sync_s", "time/elapsed_s", "samples", "samples_per_s", "tokens_per_s",
    "run/samples_per_s", "run/tokens_per_s", "rate/samples_per_s", "rate/tokens_per_s", "turns/mean",
    "response_len/mean", "tokens/trained", "len/trained_mean", "dropped/samples", "dropped/tokens", "staleness/token_mean",
    "lineage/updates_spanned_mean", "lineage/interrupted_frac", "reward/format", "reward/extra_mean", "count/admitted/groups", "count/eval/failed",
    "count/trained/groups", "env/steps", "prompt_uids", "time/train/transport_s", "time/sync/wait_s",
    "time/sync/prepare_s", "time/sync/trainer/gather_s", "time/sync/send_s", "time/eval_wait_s", "rollout/env_share",
]
EVALUATED = TRAINED + ["eval/accuracy", "eval/reward_mean", "eval/reward/format", "eval/reward/mean", *EVAL_COST]


class RichTrainer(FakeTrainer):
    """Trainer metrics whose names collide with the record's own keys, phases and sync timings."""

    async def train_step(self, batch: TrainBatch) -> TrainResult:
        r = await super().train_step(batch)
        extra = {"reward/mean": 0.5, "reward/std": 0.1, "step_time_s": 0.01, "mismatch/kl": 1e-4,
                 "time/trainer/forward_s": 0.002, "staleness/max": 1.0}
        return TrainResult(step=r.step, metrics={**r.metrics, **extra})

    async def prepare_weights(self, version: int) -> WeightManifest:
        m = await super().prepare_weights(version)
        m.timings = {"gather_s": 0.001}
        return m


class MetricEnv(FakeEnv):
    async def step(self, action: str) -> StepResult:
        r = await super().step(action)
        if not r.done:
            return r
        # "mean" collides with reward/mean: it is written as reward/extra_mean
        return StepResult(reward=r.reward, done=True, info={**r.info, "metrics": {"format": 1.0, "mean": 0.3}})


class MetricSuite(FakeSuite):
    def make_env(self) -> MetricEnv:
        self.opened += 1
        return MetricEnv(self)


def _run(tmp_path: Path) -> tuple[list[StepRecord], list[dict[str, Any]]]:
    cfg = msgspec.convert({"run": {"steps": 4, "eval_every": 2, "checkpoint_every": 0, "output_dir": str(tmp_path)},
                           "rollout": {"group_size": 2, "batch_prompts": 2, "max_new_tokens": 4}}, Config)
    records: list[StepRecord] = []
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        def on_step(r: StepRecord) -> None:
            records.append(r)
            writer.write(r)

        c = Controller(cfg, FakeTokenizer(), MetricSuite(n_eval=2), [FakeEngine("e0", default_script(token_s=0.05))],
                       RichTrainer(train_s=0.5), on_step=on_step)
        run_virtual(c.run)
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    return records, lines


def test_metrics_lines_keep_their_keys_and_order(tmp_path: Path) -> None:
    records, lines = _run(tmp_path)
    assert [list(ln) for ln in lines] == [EVAL_ONLY, TRAINED, EVALUATED, TRAINED, EVALUATED]
    assert lines == [r.to_dict() for r in records]
    # typed fields are the line's values
    r2 = records[2]
    assert r2.batch is not None and r2.eval is not None
    assert lines[2]["staleness/max"] == r2.batch.staleness_max and lines[2]["eval/accuracy"] == r2.eval.accuracy
    assert lines[2]["train/samples"] == r2.batch.trainer["samples"] == 4.0
    assert lines[2]["reward/extra_mean"] == r2.batch.reward_metrics["mean"] == pytest.approx(0.3)
    assert lines[2]["time/sync/trainer/gather_s"] == r2.batch.sync["trainer/gather_s"] == 0.001


def test_a_line_reads_back_into_the_same_record(tmp_path: Path) -> None:
    records, lines = _run(tmp_path)
    for rec, line in zip(records, lines, strict=True):
        back = StepRecord.from_dict(line)
        assert back == rec
        assert list(back.to_dict().items()) == list(line.items())


def test_every_optional_part_has_its_key() -> None:
    batch = BatchStats(reward_mean=0.5, staleness_mean=0.25, staleness_max=1, step_s=1.0, train_s=0.5, weight_sync_s=0.1,
                       elapsed_s=10.0, samples=8, samples_per_s=8.0, tokens_per_s=80.0, run_samples_per_s=7.0,
                       run_tokens_per_s=70.0, rate_samples_per_s=9.0, rate_tokens_per_s=90.0, turns_mean=1.0,
                       response_len_mean=10.0, trainer={"loss": 0.1, "time/checkpoint_s": 3.0},
                       counters={"checkpoint/failed": 0}, env_counters={"delay_s": 0.5},
                       prompt_uids=[3, 4], sync={"quiesce_s": 0.0, "engine/load_s": 0.01},
                       engine={"stepping": 0.6, "commands": 0.3, "busy": 0.9}, checkpoint_s=1.5, eval_wait_s=0.25)
    rec = StepRecord(step=5, version=5, batch=batch, eval=EvalStats(accuracy=0.75, reward_mean=0.7, eval_s=2.0,
                                                                  trainer_wait_s=0.25, gen_wait_s=0.5, engine_share=0.4),
                     memory_gib=4.85, cpu_s=12.5)
    line = rec.to_dict()
    assert list(line) == [
        "loss", "train/time/checkpoint_s", "step", "version", "reward/mean", "staleness/mean", "staleness/max",
        "time/step_s", "time/train_s", "time/weight_sync_s", "time/elapsed_s", "samples", "samples_per_s",
        "tokens_per_s", "run/samples_per_s", "run/tokens_per_s", "rate/samples_per_s", "rate/tokens_per_s",
        "turns/mean", "response_len/mean", "tokens/trained", "len/trained_mean", "dropped/samples", "dropped/tokens",
        "staleness/token_mean", "lineage/updates_spanned_mean", "lineage/interrupted_frac", "count/checkpoint/failed", "env/delay_s", "prompt_uids",
        "time/sync/quiesce_s", "time/sync/engine/load_s", "engine/stepping", "engine/commands", "engine/busy",
        "time/checkpoint_s", "time/eval_wait_s", "rollout/env_share", "eval/accuracy", "eval/reward_mean",
        "time/eval_s", "time/eval/trainer_wait_s", "time/eval/gen_wait_s", "eval/engine_share", "mem/total_gib",
        "cpu/total_s",
    ]
    assert StepRecord.from_dict(msgspec.json.decode(msgspec.json.encode(line))) == rec


def test_a_line_that_is_no_step_record_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 'step' and 'version'"):
        StepRecord.from_dict({"loss": 1.0})
    with pytest.raises(ValueError, match="'bogus' after 'step'"):
        StepRecord.from_dict({"step": 1, "version": 1, "bogus": 2})
    with pytest.raises(ValueError, match=r"lacks \['reward/mean'"):
        StepRecord.from_dict({"loss": 1.0, "step": 1, "version": 1})


def test_env_share_is_env_time_over_trajectory_lifetimes() -> None:
    from flashrl.controller.types import Trajectory, env_share

    def traj(start: float, end: float, env: float) -> Trajectory:
        return Trajectory(sample_id="s", group=0, index=0, t_start=start, t_end=end, env_s=env)

    # 1 s of env in a 4 s life and 3 s in a 4 s life: 4 of 8 seconds
    assert env_share([traj(0.0, 4.0, 1.0), traj(10.0, 14.0, 3.0)]) == 0.5
    assert env_share([traj(0.0, 2.0, 0.0)]) == 0.0  # single-turn without env time
    assert env_share([]) == 0.0 and env_share([traj(5.0, 5.0, 0.0)]) == 0.0  # no lifetime: no share
