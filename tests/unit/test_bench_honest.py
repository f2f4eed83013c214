"""The honest bench measures: token ledger (stale-drop share), length-matched baseline, weight-sync
cost that grows with the engine count, steady-state drift, per-point baselines (ablations)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashrl.bench.scenario import PointSpec, Scenario, SimModel, variant_config
from flashrl.bench.simulate import length_matched, run_point, run_variant, token_ledger
from flashrl.sim.clock import run_virtual
from flashrl.sim.engine import LatencyModel, LedgerEntry, LengthModel, SimEngine
from flashrl.sim.trainer import SimTrainer, TrainerModel
from flashrl.wire.protocol import Generate, WeightManifest

TRAINER = TrainerModel(step_fixed_s=2.0, per_token_s=0.0, prepare_weights_s=0.5, send_weights_s=0.25)
LAT = LatencyModel(decode_base_s=0.01, decode_per_seq_s=1e-4, prefill_per_token_s=0.0, max_num_seqs=64, weight_load_s=0.2)


def scenario(lengths: LengthModel, trainer: TrainerModel = TRAINER, steps: int = 6, **cfg: object) -> Scenario:
    return Scenario(
        name="t",
        steps=steps,
        warmup=1,
        config={
            "rollout": {"batch_prompts": 4, "group_size": 4, "max_new_tokens": 4000},
            "engine": {"count": 2, "max_num_seqs": LAT.max_num_seqs},
            "model": {"max_model_len": 8192},
            "env": {"params": {"prompt_chars": 16}},
            **cfg,
        },
        sim=SimModel(latency=LAT, lengths=lengths, trainer=trainer),
        baseline={"scheduler.async_ratio": 0, "scheduler.queue_scheduling": False},
        flash={"scheduler.async_ratio": 1, "scheduler.queue_scheduling": True},
        points=[PointSpec(label="p")],
    )


def E(rid: str, tokens: int, finish: str = "stop", version: int = 0, t: float = 5.0) -> LedgerEntry:
    return LedgerEntry(rid, tokens, finish, version, t)


def test_token_ledger_classifies_a_hand_built_run() -> None:
    entries = [
        E("0-0.0.0", 100),  # trained
        E("0-1.0.0", 40, "abort"),  # stale early abort: restarted as attempt 1 ...
        E("0-1.1.0", 60),  # ... which was trained
        E("1-0.0.0", 500, version=1),  # finished, never trained, version 1 < 4 - 2: stale (dropped by the buffer)
        E("1-1.0.0", 30, "abort"),  # cancelled with no later attempt: a redundant rollout
        E("2-0.0.0", 20),  # env failure after generating: retried ...
        E("2-0.1.0", 25),  # ... the retry trained
        E("3-0.0.0", 70, version=3),  # finished, not trained, fresh (3 >= 4 - 2): pending, left out
        E("4-0.0.0", 999, t=0.5),  # answered before the window: left out
        E("5-0.0.0", 10, t=9.5),  # multi-turn trained sample, two turns
        E("5-0.0.1", 15, t=9.6),
        E("6-0.0.0", 35, version=0),  # a redundant multi-turn rollout: its first turn finished ...
        E("6-0.0.1", 5, "abort"),  # ... its second was cancelled: all of it is "aborted", none "stale"
    ]
    led = token_ledger(entries, {"0-0", "0-1", "2-0", "5-0"}, final_version=4, async_ratio=2, t0=1.0, t1=10.0)
    assert (led.trained, led.stale, led.aborted, led.unused, led.pending) == (100 + 60 + 25 + 10 + 15, 40 + 500, 30 + 40, 20, 70)
    assert led.generated == 210 + 540 + 70 + 20
    assert led.waste_share == pytest.approx(630 / 840)
    assert led.stale_share == pytest.approx(540 / 840)
    assert led.longest_trained == 100
    # With redundancy, a multi-turn rollout cancelled between turns leaves only finished turns: its
    # tokens cannot be told from a stale drop, so they go to "dropped" (single-turn ones stay stale).
    multi = [E("7-0.0.0", 50, version=0), E("7-0.0.1", 60, version=0), E("8-0.0.0", 80, version=0)]
    led = token_ledger(multi, set(), final_version=4, async_ratio=2, t0=1.0, t1=10.0, redundancy=2)
    assert (led.dropped, led.stale, led.generated) == (110, 80, 190)
    assert led.waste_share == 1.0 and led.stale_share == pytest.approx(80 / 190)


def test_sync_wastes_nothing_and_flash_counts_its_stale_drops(tmp_path: Path) -> None:
    scn = scenario(LengthModel(dist="lognormal", median=200, sigma=1.5), steps=8, scheduler={"stale": "drop"})
    res = run_point(scn, scn.points[0], 0, tmp_path)
    assert res.base.ledger.waste_share == 0.0 and res.base.ledger.generated > 0
    # Every token the sync baseline generated in the window was trained (window accounting is exact here).
    assert res.base.ledger.trained == pytest.approx(res.base.response_tokens_per_step * (scn.steps - scn.warmup))
    led = res.flash.ledger
    assert res.flash.counters.get("stale/dropped_samples", 0) > 0
    assert led.stale > 0 and res.flash_waste == pytest.approx(led.stale_share)  # no redundancy, no env failures
    assert res.token_speedup == pytest.approx(res.flash.tokens_per_s / res.base.tokens_per_s)
    assert res.token_speedup < res.speedup  # flash trains shorter samples per step (long ones went stale)


def test_length_matched_baseline_caps_sync_at_flash_longest(tmp_path: Path) -> None:
    scn = scenario(LengthModel(dist="lognormal", median=200, sigma=1.5), steps=8, scheduler={"stale": "drop"})
    res = run_point(scn, scn.points[0], 0, tmp_path)
    assert res.lm is not None and res.lm_cap == res.flash.ledger.longest_trained
    assert res.lm_cap < res.base.ledger.longest_trained  # flash never trained the longest sync responses
    assert res.lm.ledger.longest_trained <= res.lm_cap  # the cap holds in the baseline it makes
    assert res.lm.step_s < res.base.step_s  # capping the tail speeds sync up ...
    assert res.lm_speedup == pytest.approx(res.flash.samples_per_s / res.lm.samples_per_s)
    assert res.lm_speedup < res.speedup  # ... so flash gains less against it
    cfg, _ = variant_config(scn, scn.points[0], "baseline")
    assert length_matched(cfg, 123).rollout.max_new_tokens == 123
    # partial (the default) drops nothing: flash trains the longest responses too, no length bias to match
    part = run_point(scenario(LengthModel(dist="lognormal", median=200, sigma=1.5), steps=8), scn.points[0], 0, tmp_path)
    assert part.flash_longest == part.base_longest and part.lm is part.base and part.flash_waste == 0.0


def test_weight_sync_cost_rises_with_engine_count() -> None:
    tm = TrainerModel(send_weights_s=0.3, broadcast_hop_s=0.4, sync_per_engine_s=0.01)
    assert tm.sync_extra_s(1) == pytest.approx(0.01)  # one engine: the one transfer only
    assert tm.sync_extra_s(16) == pytest.approx(0.4 * 4 + 0.16)  # ceil(log2 17) = 5 rounds
    assert tm.sync_extra_s(128) == pytest.approx(0.4 * 7 + 1.28)  # ceil(log2 129) = 8 rounds
    assert TrainerModel().sync_extra_s(128) == 0.0  # default: constant (old behaviour)

    async def sync(n: int) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        tr = SimTrainer(tm, engines=n)
        eng = SimEngine("e0", LAT, sync_extra_s=tm.sync_extra_s(n))
        t = loop.time()
        await tr.send_weights(1)
        sent = loop.time() - t
        r = await eng.update_weights(WeightManifest(version=1))
        await eng.close()
        return sent, r.seconds

    s1, l1 = run_virtual(lambda: sync(1)).result
    s64, l64 = run_virtual(lambda: sync(64)).result
    assert s64 - s1 == pytest.approx(0.4 * 6 + 0.63)  # 7 rounds vs 1, 63 more handshakes
    assert l64 - l1 == pytest.approx(s64 - s1)  # the engines sit in the same broadcast


def test_scaling_no_longer_linear_by_construction(tmp_path: Path) -> None:
    """Same per-engine work at 2 and 8 engines: a constant sync cost scales 4x exactly; a growing one does not."""
    lengths = LengthModel(dist="constant", median=100)
    ratios = []
    for hop in (0.0, 0.5):
        tm = TrainerModel(step_fixed_s=0.5, per_token_s=0.0, prepare_weights_s=0.1, send_weights_s=0.1, broadcast_hop_s=hop)
        runs = []
        for eng in (2, 8):
            scn = scenario(lengths, tm, **{"scheduler": {"async_ratio": 1}})
            cfg, sim = variant_config(scn, PointSpec(label="p", set={"engine.count": eng, "rollout.batch_prompts": 2 * eng}), "flash")
            runs.append(run_variant(cfg, sim, 1, tmp_path))
        ratios.append(runs[1].samples_per_s / runs[0].samples_per_s)
    assert ratios[0] == pytest.approx(4.0, rel=1e-6)  # the old model: linear by construction
    assert 2.0 < ratios[1] < 3.0  # 2 more tree rounds per step at 8 engines (0.5 s each on a ~1.9 s step)


def test_point_baseline_overrides_and_drift(tmp_path: Path) -> None:
    scn = scenario(LengthModel(dist="constant", median=50))
    pt = PointSpec(label="flash-queue", baseline={"scheduler.async_ratio": 1, "scheduler.queue_scheduling": False})
    cfg, _ = variant_config(scn, pt, "baseline")
    assert cfg.scheduler.async_ratio == 1 and not cfg.scheduler.queue_scheduling
    res = run_point(scn, pt, 0, tmp_path)
    assert res.lm is None  # no length-matched run against an asynchronous baseline
    # Constant lengths: every step alike once warm, so the ratio over half the window equals the full one.
    assert res.drift == pytest.approx(0.0, abs=0.02)


def test_engine_ledger_records_cancelled_requests() -> None:
    async def main() -> list[LedgerEntry]:
        eng = SimEngine("e0", LAT, LengthModel(dist="constant", median=1000))
        t = asyncio.ensure_future(eng.generate(Generate(request_id="7-0.0.0", prompt_ids=[5] * 4, max_tokens=2000, seed=1)))
        await asyncio.sleep(0.5)
        t.cancel()
        await asyncio.sleep(0.1)
        await eng.close()
        return eng.ledger

    ledger = run_virtual(main).result
    assert len(ledger) == 1 and ledger[0].finish == "abort" and ledger[0].request_id == "7-0.0.0"
    assert 0 < ledger[0].tokens < 1000


def test_cross_calibration_recovers_a_known_engine_scale() -> None:
    """Fit on one variant of a committed real result, whose step time we made with a known engine scale."""
    from flashrl.bench.calibrate import (
        _prompt_chars,
        cross_validate,
        fit_engine_scale,
        load_cross_runs,
        simulate_cross,
    )

    runs = load_cross_runs(Path(__file__).resolve().parents[2] / "bench" / "results" / "real_agentic" / "results.json")
    assert [r.name for r in runs] == ["real_agentic/base", "real_agentic/flash"]
    fit = runs[1]
    prompt = _prompt_chars(fit.cfg)
    fit.step_s = simulate_cross(fit, 3.0, fit, prompt).step_s  # a run the simulator explains exactly at k = 3
    k, clamped = fit_engine_scale(fit)
    # s/step is a step function of k, not strictly monotone at the 0.5% level (3.33 turns per episode on
    # average: which episodes take the 4th turn shifts each step's batch), so the bisection lands on a k
    # that reproduces the step time, near 3, not on 3 exactly
    assert not clamped and k == pytest.approx(3.0, rel=0.05)
    assert simulate_cross(fit, k, fit, prompt).step_s == pytest.approx(fit.step_s, rel=0.01)
    rows, _, _ = cross_validate(runs, [fit.name])
    assert [(r.target, r.in_sample) for r in rows] == [("real_agentic/base", False), ("real_agentic/flash", True)]
    assert abs(rows[1].error) < 0.02
    assert rows[0].error == pytest.approx(rows[0].predicted_s / rows[0].measured_s - 1)
