"""The simulator's judge stage (flashrl/sim/judge.py) and its calibration (flashrl/bench/calibrate.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from flashrl.bench.calibrate import CPU_TINY_LATENCY, judge_stats
from flashrl.sim.clock import run_virtual
from flashrl.sim.engine import LatencyModel
from flashrl.sim.envs import SimTokenizer
from flashrl.sim.judge import judge_engines

ROOT = Path(__file__).resolve().parents[2]


def _latency(**kw: float) -> LatencyModel:
    return msgspec.convert(CPU_TINY_LATENCY | {"max_num_seqs": 256} | kw, LatencyModel)


def test_a_verdict_takes_its_prefill_and_decode_steps_and_queues_behind_others() -> None:
    tok = SimTokenizer()
    lat = _latency()
    prompt = tok.encode("12+34=46?")

    async def main() -> tuple[float, float, list[str], dict[str, float], float]:
        je = judge_engines(1, lat, 9, tok, p_pass=0.7, seed=3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await je.generate(prompt, max_tokens=12, temperature=0.0, seed=0)
        one = loop.time() - t0
        t0 = loop.time()
        outs = await asyncio.gather(*[je.generate(prompt, max_tokens=12, temperature=0.0, seed=i) for i in range(400)])
        many = loop.time() - t0
        await je.aclose()
        return one, many, [tok.decode(o.token_ids) for o in outs], dict(je.counts), je.busy.busy_s

    one, many, texts, counts, busy = run_virtual(main).result
    # prefill of the prompt, then 9 decode steps of one sequence
    want = len(prompt) * lat.prefill_per_token_s + 9 * lat.step_time(1, 0)
    assert one == pytest.approx(want, rel=0.2)
    assert many > 5 * one  # 400 at once: bigger decode steps, and queued past max_num_seqs
    assert all(len(t) == 9 and t.strip() in ("0", "1") for t in texts)
    assert 0.6 < sum(t.strip() == "1" for t in texts) / len(texts) < 0.8
    assert busy == pytest.approx(one + many, rel=0.01) and counts == {}


def test_judge_stats_leave_out_the_steps_beside_an_eval() -> None:
    """Latency and busy time per verdict come from the intervals of steps the simulator also runs."""
    recs = []
    verdicts = lat_sum = busy = 0.0
    for step in range(0, 7):
        rec: dict[str, float] = {"step": step, "time/step_s": 0.2}
        if step in (0, 4):
            rec["eval/accuracy"] = 0.5
        n, ms = (400, 900.0) if step == 5 else (100, 200.0)  # step 5 ran beside step 4's eval
        if step:
            verdicts += n
            lat_sum += n * ms
            busy += n * (0.004 if step == 5 else 0.001)
        rec |= {"env/judge_verdicts": verdicts, "env/judge_tokens": 9 * verdicts, "env/judge_pass": verdicts / 2,
                "env/judge_latency_ms": lat_sum / verdicts if verdicts else 0.0, "env/judge_busy_s": busy}
        recs.append(rec)
    got = judge_stats(recs)
    assert got["latency_ms"] == pytest.approx(200.0) and got["busy_per_verdict_s"] == pytest.approx(0.001)
    assert got["verdict_tokens"] == pytest.approx(9.0) and got["p_pass"] == pytest.approx(0.5)
    assert got["reuse"] == 0.0  # no env/judge_cached (a run before judge.cache_size): every episode asked
    recs[-1]["env/judge_cached"] = 3 * recs[-1]["env/judge_verdicts"]
    assert judge_stats(recs)["reuse"] == pytest.approx(0.75)
    assert judge_stats([{"step": 1, "time/step_s": 0.1}]) == {}


def test_reused_verdicts_take_no_engine_time() -> None:
    """sim.judge.reuse: that share of the episodes is answered without a request to the judge's engines
    and counted as judge_cached; the rest go to the client as before."""
    from flashrl.config import JudgeConfig
    from flashrl.judge.client import JudgeClient
    from flashrl.judge.fake import FakeJudgeEngines
    from flashrl.sim.judge import ReusedVerdicts, SimJudgeTokenizer

    tok = SimTokenizer()
    fake = FakeJudgeEngines(lambda ids: tok.encode(" 1"))
    client = ReusedVerdicts(JudgeClient(JudgeConfig(model="x", cache_size=0), fake, SimJudgeTokenizer(tok)), 0.6,
                            p_pass=0.0, seed=1)

    async def main() -> list[float]:
        return [await client.score(("12+34=", str(i))) for i in range(1000)]

    got = asyncio.run(main())
    c = client.counters
    assert 550 < c["judge_cached"] < 650 and c["judge_cached"] + len(fake.requests) == 1000
    assert c["judge_verdicts"] == len(fake.requests) and sum(got) == len(fake.requests)  # reused: p_pass 0


def test_cross_calibration_recovers_a_known_judge_scale() -> None:
    """The committed judge runs (bench/results/judge/async-vs-sync) load with their judge counters; a fit run
    whose judge busy time we made at judge scale 0.5 gives back ~0.5, and the fitted stage then predicts
    the verdict latency it was made with."""
    from flashrl.bench.calibrate import _prompt_chars, fit_judge_scale, load_cross_runs, simulate_cross

    runs = load_cross_runs(ROOT / "bench" / "results" / "judge" / "async-vs-sync" / "results.json",
                           str(ROOT / "configs" / "judge.toml"))
    assert [r.name.split("/")[1] for r in runs] == [f"{m}-seed{s}" for s in range(3) for m in ("async", "sync")]
    assert all(r.judge and 8 < r.judge["verdict_tokens"] < 10 for r in runs)
    sync = runs[1]
    assert sync.cfg.scheduler.async_ratio == 0 and not sync.cfg.scheduler.queue_scheduling and sync.cfg.run.seed == 0
    fit = msgspec.structs.replace(runs[0], steps=8, warmup=2)
    prompt = _prompt_chars(fit.cfg)
    made = simulate_cross(fit, 2.0, fit, prompt, 0.5).judge
    fit.judge = {**fit.judge, "busy_per_verdict_s": made["judge_busy_s"] / made["judge_verdicts"]}
    kj, clamped = fit_judge_scale(fit, 2.0)
    assert not clamped and kj == pytest.approx(0.5, rel=0.1)
    again = simulate_cross(fit, 2.0, fit, prompt, kj).judge
    assert again["judge_latency_ms"] == pytest.approx(made["judge_latency_ms"], rel=0.1)


def test_a_verdicts_overhead_adds_to_its_latency_not_to_the_engines_busy_time() -> None:
    """sim.judge.overhead_s: each request spends that long before the engine takes it, not counted as the
    engine's busy time (which calibrate fits the engine's scale to: the two stay apart)."""
    tok = SimTokenizer()
    lat = _latency()
    prompt = tok.encode("12+34=46?")

    async def one(overhead: float) -> tuple[float, float]:
        je = judge_engines(1, lat, 9, tok, p_pass=0.5, seed=3, overhead_s=overhead)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await je.generate(prompt, max_tokens=12, temperature=0.0, seed=0)
        took = loop.time() - t0
        await je.aclose()
        return took, je.busy.busy_s

    base, base_busy = run_virtual(lambda: one(0.0)).result
    slow, slow_busy = run_virtual(lambda: one(0.05)).result
    assert slow == pytest.approx(base + 0.05, rel=1e-6) and slow_busy == pytest.approx(base_busy, rel=1e-6)
    with pytest.raises(ValueError, match="overhead_s"):
        judge_engines(1, lat, 9, tok, p_pass=0.5, overhead_s=-0.01)


def test_cross_calibration_recovers_a_known_judge_overhead() -> None:
    """A fit run whose verdict latency we made with 40 ms per verdict outside the judge's steps gives back
    ~40 ms; one whose measured latency is below what the engine steps alone take gives 0, never less."""
    from flashrl.bench.calibrate import _prompt_chars, fit_judge_overhead, load_cross_runs, simulate_cross

    runs = load_cross_runs(ROOT / "bench" / "results" / "judge" / "async-vs-sync" / "results.json",
                           str(ROOT / "configs" / "judge.toml"))
    fit = msgspec.structs.replace(runs[0], steps=8, warmup=2)
    prompt = _prompt_chars(fit.cfg)
    made = simulate_cross(fit, 2.0, fit, prompt, 0.5, 0.04).judge
    bare = simulate_cross(fit, 2.0, fit, prompt, 0.5, 0.0).judge
    assert made["judge_latency_ms"] > bare["judge_latency_ms"] + 30
    fit.judge = {**fit.judge, "latency_ms": made["judge_latency_ms"]}
    assert fit_judge_overhead(fit, 2.0, 0.5) == pytest.approx(0.04, rel=0.15)
    fit.judge = {**fit.judge, "latency_ms": 0.5 * bare["judge_latency_ms"]}
    assert fit_judge_overhead(fit, 2.0, 0.5) == 0.0
