"""Simulator mode of ``flashrl bench``: each point's sync baseline and flash variant through the REAL controller.

    for each point:  baseline config = base + point.set + baseline      (flashrl/bench/scenario.py)
                     flash config    = base + point.set + flash + point.flash
                     run_variant(cfg) x 2: the REAL controller (flashrl.controller) with SimEngine x
                     engine.count, SimTrainer and the "sim" environment, on a VirtualEventLoop
                     -> steady-state seconds per training step, engine busy fraction, bounds
    -> rich table, results.json, results.csv, <scenario>.png under --out

Speed-up = baseline seconds per step / flash seconds per step, over steps ``warmup+1 .. steps``
(both runs train the same number of samples per step). Every number is virtual time from the
latency model in the scenario file, so it is exact and repeatable for a seed; the CPU seconds the
simulation took are reported beside it.

Bounds (docs/algorithms.md, "Throughput bounds"): ``bound`` is the capacity bound of the flash set-up: every engine full
(``max_num_seqs`` sequences) all the time and the trainer never waiting, so a step takes at least
max(generation work / engines + weight load, train + weight sync). ``formula`` is the paper's
queue-scheduling estimate T_async(alpha) = T_sync - L_gen * alpha / (alpha + 1), with L_gen (the
long-tail term) measured from the baseline as its generation time minus the capacity-bound
generation time. ``closeness`` = speed-up / bound.
"""

from __future__ import annotations

import asyncio
import csv
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from flashrl.bench.scenario import (
    BenchError,
    PointOutcome,
    PointSpec,
    Scenario,
    SimModel,
    bar_cell,
    gain_versus,
    new_figure,
    plot_targets,
    point_outcome,
    print_table,
    save_figure,
    variant_config,
)
from flashrl.config import Config
from flashrl.controller.controller import Controller
from flashrl.plugins import make_suite
from flashrl.sim.clock import run_virtual
from flashrl.sim.engine import LengthModel, SimEngine
from flashrl.sim.envs import SimTokenizer
from flashrl.sim.trainer import SimTrainer

__all__ = [
    "PointResult", "RunResult", "TokenLedger", "capacity_times", "length_matched", "run_point", "run_sim_scenario",
    "run_variant", "tail_ratio", "token_ledger",
]


# --------------------------------------------------------------------------- one run
class TokenLedger(msgspec.Struct, kw_only=True):
    """Where the generated tokens of the requests answered in the steady window went.

    ``generated`` = trained + stale + aborted + unused + dropped; ``pending`` (could still have been trained
    when the run stopped) is left out of every share. See ``token_ledger`` for the rules.
    """

    generated: int = 0  # trained + stale + aborted + unused + dropped
    trained: int = 0
    stale: int = 0  # too stale to ever be trained: dropped by the buffer, or a multi-turn stale abort
    aborted: int = 0  # cancelled mid-generation for another reason (redundant rollouts, deadlines)
    unused: int = 0  # finished but never trained: an attempt retried after an environment failure
    dropped: int = 0  # multi-turn with redundancy: finished turns of a never-trained sample, stale or cancelled between turns (not told apart)
    pending: int = 0
    longest_trained: int = 0  # the longest trained request (one turn), tokens

    @property
    def waste_share(self) -> float:
        """Generated tokens thrown away / generated."""
        return (self.generated - self.trained) / self.generated if self.generated else 0.0

    @property
    def stale_share(self) -> float:
        """Generated tokens thrown away because they went stale / generated."""
        return self.stale / self.generated if self.generated else 0.0


def token_ledger(entries: list[Any], trained_ids: set[str], final_version: int, async_ratio: int, t0: float, t1: float,
                 redundancy: int = 0, stale_mode: str = "drop") -> TokenLedger:
    """Classify the tokens of every request answered in ``(t0, t1]`` (engine ledgers, ``SimEngine.ledger``).

    Request ids are ``<sample id>.<attempt>.<turn>`` (controller/rollout.py); attempts of one sample
    run one after another, so a trained sample trained its last attempt. An attempt (all its turns) is
      trained  -- its sample was trained and this is the sample's last attempt;
      stale    -- one of its requests was aborted and the sample has a later attempt (the stale early
                  abort restarts a trajectory on fresh weights), or it finished, was never trained,
                  and its first token is older than any step still to come allows
                  (version < final_version - async_ratio: buffer.take_batch's bound; scheduler.stale =
                  "drop" only: wait and partial never drop a sample for its age, so it is pending);
      aborted  -- one of its requests was aborted and no later attempt exists (a redundant rollout
                  cancelled, a deadline): its finished earlier turns count here too;
      unused   -- finished, an earlier attempt of a trained sample (retried after an env failure);
      dropped  -- instead of stale, with ``redundancy`` > 0 and several turns: a redundant rollout
                  cancelled while its environment stepped leaves no aborted request either, so
                  these tokens are stale drops or redundant ones, not told apart (thrown away);
      pending  -- finished, not trained, still fresh enough to be trained had the run gone on.
    Tokens count in the window by their request's answer time.
    """
    last: dict[str, int] = {}
    first_turn: dict[tuple[str, int], tuple[int, int]] = {}  # (sample, attempt) -> (turn, first_version)
    cut: set[tuple[str, int]] = set()  # attempts with an aborted request
    multi: set[tuple[str, int]] = set()  # attempts with more than one turn
    parsed = []
    for e in entries:
        sid, att_s, turn_s = e.request_id.rsplit(".", 2)
        att, turn = int(att_s), int(turn_s)
        parsed.append((e, sid, att))
        last[sid] = max(last.get(sid, -1), att)
        prev = first_turn.get((sid, att))
        if prev is None or turn < prev[0]:
            first_turn[(sid, att)] = (turn, e.first_version)
        if e.finish == "abort":
            cut.add((sid, att))
        if turn > 0:
            multi.add((sid, att))
    led = TokenLedger()
    for e, sid, att in parsed:
        if not t0 < e.t <= t1:
            continue
        n = e.tokens
        if sid in trained_ids and att == last[sid]:
            led.trained += n
            led.longest_trained = max(led.longest_trained, n)
        elif (sid, att) in cut:
            if att < last[sid]:
                led.stale += n
            else:
                led.aborted += n
        elif sid in trained_ids:
            led.unused += n
        elif stale_mode == "drop" and first_turn[(sid, att)][1] < final_version - async_ratio:
            if redundancy > 0 and (sid, att) in multi:
                led.dropped += n
            else:
                led.stale += n
        else:
            led.pending += n
            continue
        led.generated += n
    return led


class RunResult(msgspec.Struct, kw_only=True):
    step_s: float  # steady-state seconds per training step
    step_ends: list[float]
    busy: float  # mean engine busy fraction over the steady window
    samples_per_step: float
    response_tokens_per_step: float
    prompt_tokens_per_step: float
    train_s: float  # mean train_step time
    gen_s: float  # mean time from a step's end to the next step's start (sync: generation time)
    staleness_max: int
    virtual_s: float
    cpu_s: float
    events: int
    counters: dict[str, int] = {}
    samples_per_s: float = 0.0  # trained samples per second (steady window)
    tokens_per_s: float = 0.0  # trained response tokens per second (steady window)
    generated_tokens_per_s: float = 0.0  # every token the engines generated, trained or not
    response_len_max: int = 0  # the longest trained sample (all its turns' generated tokens)
    ledger: TokenLedger = msgspec.field(default_factory=TokenLedger)
    judge: dict[str, float] = {}  # the judge stage's counters at the end (judge.model set): verdicts, latency, busy


def moe_routes(cfg: Config) -> Any:
    """The route shape (flashrl/moe/routes.py) simulated engines answer with: builtin:moe's (``[moe.builtin]``), or a model
    folder's MoE shape (its config.json), unless [moe] capture is off; None for a dense model."""
    if cfg.moe.capture == "off":
        return None
    from flashrl.moe.routes import RouteShape, route_shape

    if cfg.model.path == "builtin:moe":
        spec = cfg.moe.builtin
        return RouteShape(spec.layers, spec.experts, spec.top_k)
    folder = Path(cfg.model.path).expanduser()
    return route_shape(folder) if folder.is_dir() else None


def run_variant(cfg: Config, sim: SimModel, warmup: int, out_dir: Path) -> RunResult:
    """Run the real controller on simulated engines/trainer/envs, on virtual time."""
    tok = SimTokenizer()
    n_eng = cfg.engine.count
    routes = moe_routes(cfg)  # builtin:moe: the engines answer with routes, as a MoE engine does
    engines = [
        SimEngine(f"sim{i}", sim.latency, sim.lengths, seed=cfg.run.seed, vocab_size=tok.vocab_size,
                  sync_extra_s=sim.trainer.sync_extra_s(n_eng), routes=routes)
        for i in range(n_eng)
    ]
    trainer = SimTrainer(sim.trainer, engines=n_eng)
    busy_at: list[float] = []  # total engine busy seconds at each step's end
    gen_at: list[int] = []  # total generated tokens at each step's end

    def on_step_end(_rec: Any) -> None:
        now = asyncio.get_running_loop().time()
        busy_at.append(sum(e.busy_until(now) for e in engines))
        gen_at.append(sum(e.generated_until(now) for e in engines))

    trainer.on_step_end = on_step_end
    suite: Any = make_suite(cfg.env.name, dict(cfg.env.params), cfg.run.seed, cfg.env.eval_size)
    counters: dict[str, int] = {}
    judged: dict[str, float] = {}
    if cfg.judge.model:
        suite = _judged(cfg, sim, tok, suite)

    async def main() -> None:
        if cfg.judge.model:
            await suite.client.start()
        ctrl = Controller(cfg, tok, suite, engines, trainer)
        ctrl.route_shape = routes
        try:
            await ctrl.run()
        finally:
            counters.update(ctrl.counters)
            for e in engines:
                await e.close()
            if cfg.judge.model:
                judged.update(suite.client.counters)
                await suite.aclose()

    loop_jumps: list[int] = []

    async def main_with_jumps() -> None:
        await main()
        loop_jumps.append(getattr(asyncio.get_running_loop(), "jumps", 0))

    run = run_virtual(main_with_jumps)
    return _result(cfg, run, trainer, engines, warmup, (busy_at, gen_at), loop_jumps[0] if loop_jumps else 0,
                   counters, judged)


def _judged(cfg: Config, sim: SimModel, tok: SimTokenizer, suite: Any) -> Any:
    """The judge stage: the real JudgeClient and suite wrapper on simulated judge engines."""
    from flashrl.judge.client import JudgeClient
    from flashrl.rewardmodel.suite import RewardModelSuite
    from flashrl.sim.judge import ReusedVerdicts, SimJudgeTokenizer, judge_engines

    jlat = msgspec.structs.replace(sim.latency, max_num_seqs=cfg.judge.max_num_seqs, **{
        f: getattr(sim.latency, f) * sim.judge.scale
        for f in ("decode_base_s", "decode_per_seq_s", "decode_per_kv_token_s", "prefill_per_token_s")})
    jengines = judge_engines(cfg.judge.engines, jlat, sim.judge.verdict_tokens, tok,
                             p_pass=sim.judge.p_pass, seed=cfg.run.seed, overhead_s=sim.judge.overhead_s)
    # the simulator's answers are not the policy's, so which texts repeat is not simulated: the client's
    # cache is off and a fitted share of episodes (sim.judge.reuse) is answered without the engines instead
    jc = msgspec.structs.replace(cfg.judge, cache_size=0)
    client: Any = JudgeClient(jc, jengines, SimJudgeTokenizer(tok))
    if sim.judge.reuse:
        client = ReusedVerdicts(client, sim.judge.reuse, p_pass=sim.judge.p_pass, seed=cfg.run.seed)
    return RewardModelSuite(suite, client, cfg.reward, kind="judge")


def _result(cfg: Config, run: Any, trainer: SimTrainer, engines: list[SimEngine], warmup: int,
            at: tuple[list[float], list[int]], events: int, counters: dict[str, int],
            judged: dict[str, float]) -> RunResult:
    """The measured window (steps after ``warmup``) of a finished simulated run."""
    busy_at, gen_at = at
    virtual = run.virtual_s
    cpu = run.cpu_s
    hist = trainer.history
    if len(hist) <= warmup:
        raise BenchError(f"the run trained {len(hist)} steps, fewer than warmup+1 ({warmup + 1}); raise steps")
    window = hist[warmup:]
    t0 = hist[warmup - 1].end_s if warmup > 0 else 0.0
    t1 = hist[-1].end_s
    n = len(window)
    step_s = (t1 - t0) / n
    busy0 = busy_at[warmup - 1] if warmup > 0 else 0.0
    busy = (busy_at[-1] - busy0) / (len(engines) * (t1 - t0)) if t1 > t0 else 0.0
    gen0 = gen_at[warmup - 1] if warmup > 0 else 0
    gaps = [hist[i].start_s - hist[i - 1].end_s for i in range(max(1, warmup), len(hist))]
    samples = statistics.fmean(h.samples for h in window)
    resp = statistics.fmean(h.response_tokens for h in window)
    ledger = token_ledger([x for e in engines for x in e.ledger], trainer.trained_ids, trainer.version,
                          cfg.scheduler.async_ratio, t0 if warmup > 0 else -1.0, t1, cfg.rollout.redundancy,
                          cfg.scheduler.stale)
    return RunResult(
        step_s=step_s,
        step_ends=[h.end_s for h in hist],
        busy=busy,
        samples_per_step=samples,
        response_tokens_per_step=resp,
        prompt_tokens_per_step=statistics.fmean(h.tokens - h.response_tokens for h in window),
        train_s=statistics.fmean(h.end_s - h.start_s for h in window),
        gen_s=statistics.fmean(gaps) if gaps else 0.0,
        staleness_max=max(h.staleness_max for h in window),
        virtual_s=virtual,
        cpu_s=cpu,
        events=events,
        counters=counters,
        samples_per_s=samples / step_s if step_s > 0 else 0.0,
        tokens_per_s=resp / step_s if step_s > 0 else 0.0,
        generated_tokens_per_s=(gen_at[-1] - gen0) / (t1 - t0) if t1 > t0 else 0.0,
        response_len_max=max(h.response_len_max for h in window),
        ledger=ledger,
        judge=judged,
    )


# --------------------------------------------------------------------------- bounds
def capacity_times(cfg: Config, sim: SimModel, run: RunResult) -> tuple[float, float]:
    """(generation, training) seconds per step of ``cfg``'s set-up at full capacity.

    Generation: every engine holds ``max_num_seqs`` sequences all the time (plus prefill and the
    weight load). Training: the trainer never waits (train step + weight gather and broadcast).
    A step can never take less than the larger of the two.
    """
    lat = sim.latency
    c = lat.max_num_seqs
    per_sample_resp = run.response_tokens_per_step / max(run.samples_per_step, 1.0)
    per_sample_prompt = run.prompt_tokens_per_step / max(run.samples_per_step, 1.0)
    mean_ctx = per_sample_prompt + per_sample_resp / 2  # average context over a sample's decode
    step = lat.step_time(c, int(c * mean_ctx))
    gen = run.response_tokens_per_step * step / c / cfg.engine.count
    gen += run.prompt_tokens_per_step * lat.prefill_per_token_s / cfg.engine.count
    tm = sim.trainer
    extra = tm.sync_extra_s(cfg.engine.count)  # the broadcast's growth with the engine count
    gen += lat.weight_load_s + extra
    train = tm.step_time(int(run.response_tokens_per_step + run.prompt_tokens_per_step)) + tm.prepare_weights_s + tm.send_weights_s + extra
    return gen, train


# --------------------------------------------------------------------------- one point, one scenario
class PointResult(PointOutcome, kw_only=True):
    """speedup: baseline s/step / flash s/step (kind "throughput": trained samples per second, flash / baseline)."""

    bound: float  # capacity bound on the speed-up
    formula: float  # the queue-scheduling estimate (docs/algorithms.md, "Throughput bounds") at the flash async ratio
    closeness: float  # speedup / bound
    token_ratio: float  # flash / baseline response tokens per step (< 1: stale long samples were dropped and redrawn)
    tail_ratio: float  # longest / median response of the length model at this max_tokens
    cpu_s: float
    base_config: dict[str, Any]
    flash_config: dict[str, Any]
    base: RunResult
    flash: RunResult
    token_speedup: float = math.nan  # trained response tokens per second, flash / baseline
    base_waste: float = 0.0  # generated tokens thrown away / generated, baseline
    flash_waste: float = 0.0  # the same for flash (stale drops, stale aborts, redundant rollouts, retried attempts)
    flash_stale_share: float = 0.0  # generated tokens thrown away because they went stale / generated, flash (a lower bound when the ledger has ``dropped`` tokens)
    base_longest: int = 0  # longest trained request (one turn) in the steady window, tokens
    flash_longest: int = 0
    lm_cap: int | None = None  # the length-matched baseline's max_new_tokens (= flash_longest); None: not run
    lm_step_s: float | None = None
    lm_speedup: float | None = None  # samples/s, flash / length-matched baseline
    lm_token_speedup: float | None = None  # tokens/s, flash / length-matched baseline
    half_speedup: float = math.nan  # the same ratio over the first half of the steady window
    drift: float = math.nan  # speedup / half_speedup - 1: how far from steady state the ratio still moves
    lm: RunResult | None = None


def tail_ratio(lengths: LengthModel, max_tokens: int, n: int = 4096) -> float:
    from flashrl.sim.engine import uniform

    xs = sorted(lengths.length(uniform(0, str(i).encode()), max_tokens) for i in range(n))
    return xs[-1] / xs[n // 2]


def _window_step_s(run: RunResult, warmup: int, k: int) -> float:
    """Mean seconds per step over steps ``warmup+1 .. warmup+k``."""
    t0 = run.step_ends[warmup - 1] if warmup > 0 else 0.0
    return (run.step_ends[warmup + k - 1] - t0) / k


def _run_cached(cache: dict[bytes, RunResult] | None, cfg: Config, sim: SimModel, warmup: int, out_dir: Path) -> RunResult:
    """run_variant, once per distinct (config, sim model, warmup) within a scenario: a run is deterministic."""
    key = msgspec.json.encode([msgspec.to_builtins(cfg), msgspec.to_builtins(sim), warmup])
    if cache is not None and key in cache:
        return cache[key]
    res = run_variant(cfg, sim, warmup, out_dir)
    if cache is not None:
        cache[key] = res
    return res


def length_matched(cfg: Config, cap: int) -> Config:
    """``cfg`` with the response-length cap ``cap`` (rollout.max_new_tokens): the length-matched baseline."""
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, max_new_tokens=cap))


def run_point(scn: Scenario, pt: PointSpec, index: int, out_dir: Path, cache: dict[bytes, RunResult] | None = None) -> PointResult:
    base_cfg, base_sim = variant_config(scn, pt, "baseline")
    flash_cfg, flash_sim = variant_config(scn, pt, "flash")
    base = _run_cached(cache, base_cfg, base_sim, scn.warmup, out_dir)
    flash = _run_cached(cache, flash_cfg, flash_sim, scn.warmup, out_dir)
    n = scn.steps - scn.warmup
    half = max(1, n // 2)
    if scn.kind == "throughput":  # scaling: samples per second relative to the first point's baseline
        speedup = flash.samples_per_s / base.samples_per_s
        per = flash.samples_per_step / base.samples_per_step
        half_speedup = per * _window_step_s(base, scn.warmup, half) / _window_step_s(flash, scn.warmup, half)
    else:
        speedup = base.step_s / flash.step_s
        half_speedup = _window_step_s(base, scn.warmup, half) / _window_step_s(flash, scn.warmup, half)
    gen_cap, train_cap = capacity_times(flash_cfg, flash_sim, flash)
    cap = max(gen_cap, train_cap)
    if scn.kind == "throughput":  # ideal: linear in the engines (and everything scaled with them)
        bound = flash_cfg.engine.count / base_cfg.engine.count
    else:
        bound = base.step_s / cap
    # The paper's long-tail term, measured: the baseline's generation phase minus its full-capacity time.
    base_gen_cap, _ = capacity_times(base_cfg, base_sim, base)
    l_gen = max(0.0, base.gen_s - base_gen_cap)
    alpha = flash_cfg.scheduler.async_ratio
    formula = base.step_s / max(cap, base.step_s - l_gen * alpha / (alpha + 1))
    # Length-matched baseline: the synchronous baseline capped at the longest response flash trained.
    lm: RunResult | None = None
    lm_cap: int | None = None
    if scn.kind == "speedup" and scn.length_matched and base_cfg.scheduler.async_ratio == 0 and flash.ledger.longest_trained > 0:
        lm_cap = min(flash.ledger.longest_trained, base_cfg.rollout.max_new_tokens)
        lm = base if lm_cap >= base_cfg.rollout.max_new_tokens else _run_cached(
            cache, length_matched(base_cfg, lm_cap), base_sim, scn.warmup, out_dir)
    return PointResult(
        **point_outcome(scn, pt, index, speedup, base, flash),
        bound=bound,
        formula=formula,
        closeness=speedup / bound if bound > 0 else math.nan,
        token_ratio=flash.response_tokens_per_step / base.response_tokens_per_step * (
            base.samples_per_step / flash.samples_per_step if scn.kind == "throughput" else 1.0),
        tail_ratio=tail_ratio(flash_sim.lengths, flash_cfg.rollout.max_new_tokens),
        cpu_s=base.cpu_s + flash.cpu_s + (lm.cpu_s if lm is not None and lm is not base else 0.0),
        base_config=msgspec.to_builtins(base_cfg) | {"sim": msgspec.to_builtins(base_sim)},
        flash_config=msgspec.to_builtins(flash_cfg) | {"sim": msgspec.to_builtins(flash_sim)},
        base=base,
        flash=flash,
        token_speedup=flash.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else math.nan,
        base_waste=base.ledger.waste_share,
        flash_waste=flash.ledger.waste_share,
        flash_stale_share=flash.ledger.stale_share,
        base_longest=base.ledger.longest_trained,
        flash_longest=flash.ledger.longest_trained,
        lm_cap=lm_cap,
        lm_step_s=lm.step_s if lm is not None else None,
        lm_speedup=(flash.samples_per_s / lm.samples_per_s) if lm is not None else None,
        lm_token_speedup=(flash.tokens_per_s / lm.tokens_per_s) if lm is not None and lm.tokens_per_s > 0 else None,
        half_speedup=half_speedup,
        drift=speedup / half_speedup - 1 if half_speedup > 0 else math.nan,
        lm=lm,
    )


# --------------------------------------------------------------------------- one scenario
def run_sim_scenario(scn: Scenario, path: str | Path, out: Path, quiet: bool = False) -> list[PointResult]:
    """Every point of a simulator scenario; results.json, results.csv and a PNG under ``out``."""
    results: list[PointResult] = []
    cache: dict[bytes, RunResult] = {}
    with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
        for i, pt in enumerate(scn.points):
            res = run_point(scn, pt, i, Path(tmp), cache)
            gain_versus(results, res, pt, path)
            results.append(res)
            if not quiet:
                lm = "" if res.lm_speedup is None else f", length-matched {res.lm_speedup:.2f}x"
                print(f"  {scn.name} {pt.label}: {res.speedup:.2f}x samples/s, {res.token_speedup:.2f}x tokens/s{lm}, "
                      f"flash waste {res.flash_waste:.1%} (bound {res.bound:.2f}x, busy {res.flash_busy:.0%}, "
                      f"drift {res.drift:+.1%}, cpu {res.cpu_s:.1f}s)", flush=True)
    write_results(scn, results, out)
    if not quiet:
        print_results(scn, results)
    return results


# --------------------------------------------------------------------------- outputs
CSV_FIELDS = [
    "scenario", "label", "x", "speedup", "token_speedup", "lm_speedup", "lm_token_speedup", "lm_cap", "base_waste",
    "flash_waste", "flash_stale_share", "base_longest", "flash_longest", "half_speedup", "drift", "gain", "target",
    "passed", "base_step_s", "flash_step_s", "lm_step_s", "base_busy", "flash_busy", "bound", "formula", "closeness",
    "flash_staleness_max", "token_ratio", "tail_ratio", "cpu_s",
]


def write_results(scn: Scenario, results: list[PointResult], out: Path) -> None:
    (out / "results.json").write_bytes(
        msgspec.json.format(msgspec.json.encode({"scenario": msgspec.to_builtins(scn), "points": results}), indent=2)
    )
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*CSV_FIELDS, "base_config", "flash_config"])
        for r in results:
            row = [getattr(r, k) for k in CSV_FIELDS]
            w.writerow([*row, msgspec.json.encode(r.base_config).decode(), msgspec.json.encode(r.flash_config).decode()])
    plot(scn, results, out / f"{scn.name}.png")


def plot(scn: Scenario, results: list[PointResult], path: Path) -> None:
    fig, ax = new_figure()
    xs = list(range(len(results)))
    ax.plot(xs, [r.speedup for r in results], "o-", label="samples/s ratio")
    ax.plot(xs, [r.token_speedup for r in results], "s-", label="tokens/s ratio")
    if any(r.lm_speedup is not None for r in results):
        ax.plot(xs, [r.lm_speedup if r.lm_speedup is not None else math.nan for r in results], "^-",
                label="samples/s vs length-matched sync")
    ax.plot(xs, [r.bound for r in results], "k--", label="capacity bound")
    if scn.kind != "throughput":
        ax.plot(xs, [r.formula for r in results], ":", color="gray", label="paper formula")
    plot_targets(ax, xs, results, markersize=18)
    ax.set_xticks(xs, [r.label for r in results], rotation=30 if len(results) > 5 else 0)
    save_figure(fig, ax, path, scn, "throughput ratio" if scn.kind == "throughput" else "speed-up over sync")


def print_results(scn: Scenario, results: list[PointResult]) -> None:
    from rich.table import Table

    t = Table(title=f"{scn.name}: {scn.title}")
    for col in ("point", "sync s/step", "flash s/step", "samples/s x", "tokens/s x", "vs len-matched", "waste",
                "stale", "drift", "gain", "bar", "bound", "formula", "busy sync", "busy flash", "stale max", "cpu s"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            r.label, f"{r.base_step_s:.1f}", f"{r.flash_step_s:.1f}", f"{r.speedup:.2f}x", f"{r.token_speedup:.2f}x",
            "" if r.lm_speedup is None else f"{r.lm_speedup:.2f}x (cap {r.lm_cap})",
            f"{r.flash_waste:.1%}", f"{r.flash_stale_share:.1%}", f"{r.drift:+.1%}",
            "" if r.gain is None else f"{r.gain - 1:+.1%}", bar_cell(r.target, r.passed), f"{r.bound:.2f}x",
            f"{r.formula:.2f}x", f"{r.base_busy:.0%}", f"{r.flash_busy:.0%}",
            str(r.flash_staleness_max), f"{r.cpu_s:.1f}",
        )
    print_table(t)
