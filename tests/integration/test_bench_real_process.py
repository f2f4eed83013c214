"""flashrl bench real mode: scenario files, mode selection, the measuring wrappers, and one tiny real point.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_bench_real.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flashrl.bench.sweep import run_scenario


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tiny_real_point_runs_both_variants_on_one_cluster(tmp_path: Path) -> None:
    path = tmp_path / "real_tiny.toml"
    path.write_text(f"""
name = "real_tiny"
mode = "real"
steps = 3
warmup = 1
[config.run]
output_dir = "{tmp_path / 'runs'}"
[config.model]
max_model_len = 128
[config.env]
name = "arithmetic"
eval_size = 400
[config.env.params]
digits = 2
ops = ["+"]
[config.env.params.faults]
delay = {{kind = "lognormal", mean_s = 0.05, sigma = 1.0, max_s = 1.0}}
[config.rollout]
group_size = 4
batch_prompts = 2
max_new_tokens = 4
[config.engine]
count = 1
max_num_seqs = 4
kv_cache_gib = 0.25
[config.trainer]
ranks = 1
[config.algorithm]
loss = "decoupled_ppo"
[baseline]
"scheduler.async_ratio" = 0
"scheduler.queue_scheduling" = false
"rollout.env_async" = false
[flash]
"scheduler.async_ratio" = 2
# 3 steps of 2 prompts at ratio 2: with the run's drain (the default) all 6 groups are admitted at once and
# generated before the measured window (steps 2-3) begins, leaving the engine idle in it
"scheduler.drain" = false
[[points]]
label = "tiny"
""")
    (res,) = run_scenario(path, tmp_path / "out", quiet=True)
    assert res.cluster == "reused"  # both variants on one cluster, the version reset in between
    assert 0 < res.cluster_start_s <= res.setup_s < res.wall_s
    assert res.base.steps == 3 and res.flash.steps == 3
    for run in (res.base, res.flash):
        assert run.samples_per_s * run.step_s == pytest.approx(8.0)  # 2 prompts x 4 samples per step
        assert run.tokens_per_s > 0 and 0.0 < run.busy <= 1.0
        assert run.turns == 1.0
        assert run.counters["env/calls"] >= 2 * 8 * 3  # reset + reward step of every trained sample, all delayed
    assert res.base.staleness_max == 0  # the sync baseline trains only on-policy samples
    assert 0 <= res.flash.staleness_max  # versions restarted at 0
    assert res.flash.counters.get("stale/over_bound_groups", 0) == 0  # the default mode's bound held (core/staleness.py)
    assert math.isfinite(res.speedup) and math.isfinite(res.token_speedup)
    assert res.token_speedup == pytest.approx(res.flash.tokens_per_s / res.base.tokens_per_s)
    assert res.speedup == pytest.approx(res.flash.samples_per_s / res.base.samples_per_s)
    out = tmp_path / "out" / "real_tiny"
    doc = json.loads((out / "results.json").read_text())
    assert doc["mode"] == "real" and doc["points"][0]["base"]["steps"] == 3 and doc["points"][0]["flash"]["steps"] == 3
    assert (out / "results.csv").read_text().count("\n") == 2 and (out / "real_tiny.png").stat().st_size > 0
    assert list((tmp_path / "runs" / "bench_real" / "cluster0" / "logs").glob("engine0.log"))
