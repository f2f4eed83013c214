"""flashrl bench real mode: scenario files, mode selection, the measuring wrappers, and one tiny real point."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashrl.bench.real import BusyProbe, TrainOnlySuite, process_key
from flashrl.bench.scenario import (
    BenchError,
    check_mode,
    find_scenario,
    load_scenario,
    shipped_scenarios,
    variant_config,
)
from flashrl.sim.clock import run_virtual
from flashrl.wire.protocol import Generate, Generated


def test_real_scenarios_are_sync_vs_flash_on_one_process_config() -> None:
    real = shipped_scenarios("real")
    names = {"real_rlvr", "real_agentic", "real_tools", "real_tools_fast"}
    assert {p.stem for p in real} == names
    assert not {p.stem for p in shipped_scenarios("sim")} & names
    for path in real:
        scn = load_scenario(path)
        assert scn.mode == "real" and scn.warmup < scn.steps
        for pt in scn.points:
            base, _ = variant_config(scn, pt, "baseline")
            flash, _ = variant_config(scn, pt, "flash")
            assert (base.scheduler.async_ratio, base.scheduler.queue_scheduling, base.rollout.env_async) == (0, False, False)
            assert (flash.scheduler.async_ratio, flash.scheduler.queue_scheduling, flash.rollout.env_async) == (2, True, True)
            # the env delay that async hides: a [faults] delay, or the tool env's latency (inside remote)
            if base.env.name == "remote":
                assert base.env.params["params"]["latency"]["p99_s"] >= 10 * base.env.params["params"]["latency"]["median_s"] > 0
            else:
                assert base.env.params["faults"]["delay"]["kind"] == "lognormal"
            # One cluster serves both variants: their processes are started the same way.
            assert process_key(base, "m") == process_key(flash, "m")
            assert base.engine.count == 1 and base.run.steps == scn.steps


def test_mode_mismatch_names_the_fix() -> None:
    sim = load_scenario(find_scenario("queue_scheduling"))
    with pytest.raises(BenchError, match=r"real_\*\.toml"):
        check_mode(sim, "real", "queue_scheduling.toml")
    real = load_scenario(find_scenario("real_rlvr"))
    with pytest.raises(BenchError, match="drop --mode sim"):
        check_mode(real, "sim", "real_rlvr.toml")
    assert check_mode(real, None, "x") == "real" and check_mode(sim, None, "x") == "sim"


def test_real_scenario_rejects_the_sim_env(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "r"\nmode = "real"\n[config.env]\nname = "sim"\n[[points]]\nlabel = "a"\n')
    with pytest.raises(BenchError, match='env.name = "sim"'):
        load_scenario(p)


class _SlowEngine:
    """Answers each request after ``req.max_tokens`` seconds of loop time."""

    name = "slow"

    def __init__(self) -> None:
        self.inflight = 0
        self.dead = None

    async def generate(self, req: Generate) -> Generated:
        self.inflight += 1
        try:
            await asyncio.sleep(req.max_tokens)
        finally:
            self.inflight -= 1
        return Generated(request_id=req.request_id, token_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")


def test_busy_probe_counts_time_with_a_request_in_flight() -> None:
    async def main() -> tuple[float, float, float, int]:
        probe = BusyProbe(_SlowEngine())
        loop = asyncio.get_running_loop()

        async def at(t: float, dur: int) -> None:
            await asyncio.sleep(t - loop.time())
            await probe.generate(Generate(request_id=f"r{t}", max_tokens=dur))

        # busy [0, 3] (two overlapping requests), idle [3, 5], busy [5, 6]
        task = asyncio.gather(at(0, 2), at(1, 2), at(5, 1))
        await asyncio.sleep(1.5)
        mid = probe.busy_s(loop.time())  # an open busy period counts up to now
        inflight = probe.inflight
        await task
        return mid, probe.busy_s(loop.time()), probe.busy_s(10.0), inflight

    run = run_virtual(main)
    mid, end, later, inflight = run.result
    virtual = run.virtual_s
    assert virtual == pytest.approx(6.0)
    assert mid == pytest.approx(1.5) and inflight == 2
    assert end == pytest.approx(4.0) and later == pytest.approx(4.0)  # idle time after the last request is not busy


def test_train_only_suite_hides_the_eval_split() -> None:
    from envs import make_suite

    inner = make_suite("arithmetic", {"faults": {"delay": {"kind": "constant", "seconds": 0.0}}}, 0, 7)
    suite = TrainOnlySuite(inner)
    assert list(inner.eval_tasks()) and list(suite.eval_tasks()) == []
    assert suite.train_tasks()[:3] == inner.train_tasks()[:3]
    assert suite.counters is inner.counters  # the controller reports the faults' counters as env/*


def test_calibrate_predicts_a_sync_run_from_its_own_fit(tmp_path: Path) -> None:
    """A synchronous run whose steps are train 1.0 s + sync 0.2 s + a short generation: the fitted
    simulator must predict ~1.2 s/step, and the comparison must skip step 1 and steps beside an eval."""
    import msgspec
    from typer.testing import CliRunner

    from flashrl.bench.calibrate import compared_steps, fit, predict
    from flashrl.bench.cli import bench_app
    from flashrl.config import load, to_toml

    cfg = load(None, ["run.steps=6", "rollout.batch_prompts=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
                      "scheduler.async_ratio=0", "scheduler.queue_scheduling=false", "engine.count=1", "env.name=arithmetic"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    recs: list[dict[str, object]] = [{"step": 0, "eval/accuracy": 0.5}]
    for s in range(1, 7):
        rec: dict[str, object] = {"step": s, "samples": 8, "response_len/mean": 4.0, "turns/mean": 1.0, "reward/mean": 0.5,
                                  "time/train_s": 1.0, "time/weight_sync_s": 0.2, "time/step_s": 9.0 if s in (1, 4) else 1.25}
        if s == 3:
            rec["eval/accuracy"] = 0.6  # step 4 ran beside this eval: slow, and left out
        recs.append(rec)
    (tmp_path / "metrics.jsonl").write_text("\n".join(msgspec.json.encode(r).decode() for r in recs))
    assert compared_steps(recs) == [2, 3, 5, 6]
    p = predict(tmp_path, fit(recs))
    assert p.steps == [2, 3, 5, 6] and p.measured_s == pytest.approx(1.25)
    assert 1.2 < p.predicted_s < 1.3  # train + sync, plus a few CPU decode steps of 8 short samples
    assert p.error == pytest.approx(p.predicted_s / 1.25 - 1)
    result = CliRunner().invoke(bench_app, ["calibrate", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "steps 2-3,5-6: error" in result.output


def test_calibrate_fits_no_slope_that_noise_would_set() -> None:
    """Near-equal batches on a noisy machine: the token count does not explain the train time, so the
    fit is a constant (a slope fitted to noise would make the simulator charge every token wrongly)."""
    from flashrl.bench.calibrate import fit

    times = [1.1, 0.9, 1.3, 0.8, 1.2, 0.95, 1.05, 1.0]
    tokens = [440, 450, 445, 452, 441, 447, 449, 443]
    recs = [{"samples": 64, "response_len/mean": t / 64, "time/train_s": y} for t, y in zip(tokens, times)]
    prof = fit(recs)
    assert prof["trainer"]["per_token_s"] == 0.0
    assert prof["trainer"]["step_fixed_s"] == pytest.approx(sum(times) / len(times))
