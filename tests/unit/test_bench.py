"""flashrl bench on the simulator: analytic times through the REAL controller, determinism, scenario files."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from flashrl.bench.scenario import (
    BenchError,
    PointSpec,
    Scenario,
    SimModel,
    load_scenario,
    scenario_dir,
    variant_config,
)
from flashrl.bench.simulate import run_variant
from flashrl.bench.sweep import run_scenario
from flashrl.controller.scheduler import request_seed
from flashrl.sim.engine import LatencyModel, LengthModel, uniform
from flashrl.sim.trainer import TrainerModel

TRAINER = TrainerModel(step_fixed_s=2.0, per_token_s=0.0, prepare_weights_s=0.5, send_weights_s=0.25)


def scenario(lengths: LengthModel, latency: LatencyModel, **cfg_set: object) -> tuple[Scenario, PointSpec]:
    scn = Scenario(
        name="t",
        steps=3,
        warmup=0,
        config={
            "rollout": {"batch_prompts": 2, "group_size": 4, "max_new_tokens": 4000},
            "engine": {"count": 2, "max_num_seqs": latency.max_num_seqs},
            "model": {"max_model_len": 8192},
            "env": {"params": {"prompt_chars": 16}},
        },
        sim=SimModel(latency=latency, lengths=lengths, trainer=TRAINER),
        baseline={"scheduler.async_ratio": 0, "scheduler.queue_scheduling": False},
        flash={"scheduler.async_ratio": 2, "scheduler.queue_scheduling": True},
        points=[PointSpec(label="p")],
    )
    return scn, PointSpec(label="p", set=dict(cfg_set))


def test_constant_latency_sync_step_is_analytic(tmp_path: Path) -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.001, prefill_per_token_s=0.0, max_num_seqs=64, weight_load_s=0.4)
    scn, pt = scenario(LengthModel(dist="constant", median=100), lat)
    cfg, sim = variant_config(scn, pt, "baseline")
    run = run_variant(cfg, sim, 0, tmp_path)
    # 8 samples over 2 engines (4 each, replication): 100 steps at batch 4, then train (step_ends are
    # the train steps' ends), then the weight sync: gather, then max(send, load), before the next batch.
    gen_train = 100 * (0.01 + 0.001 * 4) + 2.0
    sync = 0.5 + max(0.25, 0.4)
    assert run.step_ends == pytest.approx([gen_train + s * (sync + gen_train) for s in range(3)])
    assert run.step_s == pytest.approx((run.step_ends[-1]) / 3)
    assert run.samples_per_step == 8


def test_sync_baseline_is_the_sum_of_its_batch_maxima(tmp_path: Path) -> None:
    # Step time independent of the batch (per_seq = 0): each batch takes its longest sample.
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0, max_num_seqs=64, weight_load_s=0.0)
    lengths = LengthModel(dist="lognormal", median=200, sigma=1.0)
    scn, pt = scenario(lengths, lat)
    cfg, sim = variant_config(scn, pt, "baseline")
    run = run_variant(cfg, sim, 0, tmp_path)
    expected = 0.0
    for step in range(3):
        longest = max(
            lengths.length(uniform(cfg.run.seed, f"s{request_seed(cfg.run.seed, uid, k, 0)}".encode()), 4000)
            for uid in range(2 * step, 2 * step + 2)
            for k in range(4)
        )
        expected += longest * 0.01 + 2.0 + (0.5 + 0.25 if step > 0 else 0.0)
    assert run.step_ends[-1] == pytest.approx(expected)


def test_virtual_time_is_deterministic_for_a_seed_and_flash_beats_sync(tmp_path: Path) -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=1e-4, prefill_per_token_s=1e-5, max_num_seqs=64, weight_load_s=0.2)
    scn, pt = scenario(LengthModel(dist="lognormal", median=200, sigma=1.0), lat)
    cfg, sim = variant_config(scn, pt, "flash")
    a = run_variant(cfg, sim, 1, tmp_path)
    b = run_variant(cfg, sim, 1, tmp_path)
    assert a.step_ends == b.step_ends
    assert a.busy == b.busy
    base_cfg, base_sim = variant_config(scn, pt, "baseline")
    base = run_variant(base_cfg, base_sim, 1, tmp_path)
    assert base.step_s / a.step_s > 1.2  # the long tail no longer stalls every step
    # the default mode (scheduler.stale = partial) dropped nothing and kept its bound (core/staleness.py)
    assert cfg.scheduler.stale == "partial" and a.counters.get("stale/dropped_samples", 0) == 0
    assert a.counters.get("stale/over_bound_groups", 0) == 0


def test_every_shipped_scenario_loads() -> None:
    files = sorted(scenario_dir().glob("*.toml"))
    names = {f.stem for f in files}
    assert {"queue_scheduling", "prompt_replication", "agentic_env", "whole_system", "async_ratio", "scaling", "controller_overhead"} <= names
    for f in files:
        scn = load_scenario(f)
        assert scn.points, f


def test_scenario_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[[points]]\nlabel = "a"\nset = {"rollout.group_sise" = 3}\n')
    with pytest.raises(BenchError, match="group_sise"):
        load_scenario(bad)
    mismatch = tmp_path / "mm.toml"
    mismatch.write_text('name = "mm"\n[config.engine]\nmax_num_seqs = 8\n[[points]]\nlabel = "a"\n')
    with pytest.raises(BenchError, match="max_num_seqs"):
        load_scenario(mismatch)


def test_run_scenario_writes_json_csv_png(tmp_path: Path) -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=1e-4, prefill_per_token_s=0.0, max_num_seqs=32, weight_load_s=0.1)
    scn, _ = scenario(LengthModel(dist="lognormal", median=100, sigma=1.0), lat)
    scn = msgspec.structs.replace(scn, points=[PointSpec(label="a", target=1.0), PointSpec(label="b", flash={"rollout.redundancy": 1}, versus="a")])
    path = tmp_path / "t.toml"
    import tomllib  # noqa: F401 - the writer below only emits what tomllib reads back

    path.write_text(_to_toml(msgspec.to_builtins(scn)))
    results = run_scenario(path, tmp_path / "out", quiet=True)
    out = tmp_path / "out" / "t"
    assert [r.label for r in results] == ["a", "b"]
    assert results[1].gain == pytest.approx(results[1].speedup / results[0].speedup)
    data = msgspec.json.decode((out / "results.json").read_bytes())
    assert [p["label"] for p in data["points"]] == ["a", "b"]
    assert data["points"][0]["flash_config"]["scheduler"]["async_ratio"] == 2
    assert (out / "results.csv").read_text().count("\n") == 3
    assert (out / "t.png").stat().st_size > 1000


def _to_toml(d: dict) -> str:
    """A minimal TOML writer for the test's scenario (tables, arrays of tables, inline dicts)."""
    import json

    def val(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {val(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return json.dumps(v)

    lines = [f"{k} = {val(v)}" for k, v in d.items() if v is not None and not isinstance(v, (dict, list))]
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"{k} = {val(v)}")
    for p in d["points"]:
        lines.append("[[points]]")
        lines += [f"{k} = {val(x)}" for k, x in p.items() if x is not None]
    return "\n".join(lines) + "\n"


def test_calibrate_recovers_a_linear_trainer(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flashrl.bench.calibrate import fit
    from flashrl.bench.cli import bench_app

    recs = [{"step": i, "samples": 64, "response_len/mean": m, "time/train_s": 3.0 + 2e-4 * 64 * m, "time/weight_sync_s": 2.0} for i, m in enumerate([500, 800, 1200])]
    prof = fit(recs, sigma=1.0)
    assert prof["trainer"]["step_fixed_s"] == pytest.approx(3.0)
    assert prof["trainer"]["per_token_s"] == pytest.approx(2e-4)
    assert prof["lengths"]["median"] == pytest.approx(833.33 / 1.6487, rel=1e-3)
    (tmp_path / "metrics.jsonl").write_text("\n".join(msgspec.json.encode(r).decode() for r in recs))
    runner = CliRunner()
    assert runner.invoke(bench_app, ["calibrate", str(tmp_path), "--out", str(tmp_path / "p.toml")]).exit_code == 0
    assert "per_token_s = 0.0002" in (tmp_path / "p.toml").read_text()
    missing = runner.invoke(bench_app, ["calibrate", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "metrics.jsonl not found" in missing.output


def test_a_scenario_by_path_takes_its_profile_from_beside_it_else_the_shipped_one(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "mine.toml").write_text("[config.rollout]\ngroup_size = 3\n")
    (tmp_path / "a.toml").write_text('name = "a"\nprofile = "mine"\n[[points]]\nlabel = "p"\n')
    assert load_scenario(tmp_path / "a.toml").config["rollout"]["group_size"] == 3
    (tmp_path / "b.toml").write_text('name = "b"\nprofile = "h100_qwen3_8b"\n[[points]]\nlabel = "p"\n')
    assert load_scenario(tmp_path / "b.toml").profile == "h100_qwen3_8b"
    (tmp_path / "c.toml").write_text('name = "c"\nprofile = "nope"\n[[points]]\nlabel = "p"\n')
    with pytest.raises(BenchError, match="profile: nope.toml not found"):
        load_scenario(tmp_path / "c.toml")
