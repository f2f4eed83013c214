"""``flashrl bench``: the ROLL Flash ablations as scenarios, each point async against the sync baseline.

    bench/<scenario>.toml --load_scenario--> Scenario (base config, sim model, baseline/flash overrides, points)
        for each point:  baseline config = base + point.set + baseline
                         flash config    = base + point.set + flash + point.flash
                         run_variant(cfg) x 2: the REAL controller (flashrl.controller) with SimEngine x
                         engine.count, SimTrainer and the "sim" environment, on a VirtualEventLoop
                         -> steady-state seconds per training step, engine busy fraction, bounds
        -> rich table, results.json, results.csv, <scenario>.png under --out

Speed-up = baseline seconds per step / flash seconds per step, over steps ``warmup+1 .. steps``
(both runs train the same number of samples per step). Every number is virtual time from the
latency model in the scenario file, so it is exact and repeatable for a seed; the CPU seconds the
simulation took are reported beside it.

Bounds (ALGORITHMS.md, end): ``bound`` is the capacity bound of the flash set-up: every engine full
(``max_num_seqs`` sequences) all the time and the trainer never waiting, so a step takes at least
max(generation work / engines + weight load, train + weight sync). ``formula`` is the paper's
queue-scheduling estimate T_async(alpha) = T_sync - L_gen * alpha / (alpha + 1), with L_gen (the
long-tail term) measured from the baseline as its generation time minus the capacity-bound
generation time. ``closeness`` = speed-up / bound.

Other modes: ``overhead`` scenarios (kind = "overhead") time the real controller's CPU per sample
against engines that answer at once, and the ZeroMQ path (transport.RpcClient -> RpcServer) in
requests per second. Real mode (scenarios with ``mode = "real"``, bench/real_*.toml, or ``--mode
real``) runs both variants of every point on real vLLM engines and the real trainer on this machine,
in wall-clock time: flashrl/benchmarks/real.py. ``flashrl bench all`` runs the scenarios of one mode
(``--mode``, default sim).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import csv
import inspect
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomllib
from msgspec import Meta

from flashrl.config import Config, ConfigError, from_dict
from flashrl.sim.clock import run_virtual
from flashrl.sim.engine import LatencyModel, LengthModel, SimEngine
from flashrl.sim.envs import SimTokenizer
from flashrl.sim.trainer import SimTrainer, TrainerModel

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


# --------------------------------------------------------------------------- scenario files
class SimModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The latency model of a scenario (``[sim]``): one engine, the response lengths, the trainer."""

    latency: LatencyModel = msgspec.field(default_factory=LatencyModel)
    lengths: LengthModel = msgspec.field(default_factory=LengthModel)
    trainer: TrainerModel = msgspec.field(default_factory=TrainerModel)


class PointSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    label: Annotated[str, Meta(min_length=1, description="the point's name in tables and plots")]
    x: Annotated[float | None, Meta(description="x value in the sweep plot (default: the point's position)")] = None
    set: Annotated[dict[str, Any], Meta(description="dotted overrides for both variants, e.g. {'rollout.group_size' = 8}")] = {}
    flash: Annotated[dict[str, Any], Meta(description="dotted overrides for the flash variant only")] = {}
    baseline: Annotated[dict[str, Any], Meta(description="dotted overrides for the baseline variant only (ablations: the baseline is flash minus one knob)")] = {}
    target: Annotated[float | None, Meta(description="the speed-up bar this point must reach (of ``gain`` when ``versus`` is set)")] = None
    versus: Annotated[str, Meta(description="label of an earlier point: also report gain = speed-up / that point's speed-up")] = ""


class Scenario(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    profile: Annotated[str, Meta(description="bench/profiles/<profile>.toml: [config] and [sim] tables this file overrides")] = ""
    title: str = ""
    description: str = ""
    kind: Literal["speedup", "throughput", "overhead"] = "speedup"
    mode: Annotated[Literal["sim", "real"], Meta(description="what the scenario is sized for: the simulator, or real engines and trainer on this machine")] = "sim"
    steps: Annotated[int, Meta(ge=2, description="training steps per run")] = 6
    warmup: Annotated[int, Meta(ge=0, description="steps left out of the steady-state time")] = 1
    x_label: str = "point"
    config: Annotated[dict[str, Any], Meta(description="flashrl config (partial, as config.toml) shared by every run")] = {}
    sim: SimModel = msgspec.field(default_factory=SimModel)
    baseline: Annotated[dict[str, Any], Meta(description="dotted overrides of the synchronous baseline")] = {}
    flash: Annotated[dict[str, Any], Meta(description="dotted overrides of the ROLL Flash variant")] = {}
    points: list[PointSpec] = []
    length_matched: Annotated[bool, Meta(description="also run the synchronous baseline capped at the longest response flash trained (speed-up scenarios with a sync baseline)")] = True
    steps_note: Annotated[str, Meta(description="why this many steps (steady state)")] = ""
    busy_target: Annotated[float | None, Meta(description="flash engine busy fraction to reach where the bound allows it")] = None
    zmq_requests: Annotated[int, Meta(ge=0, description="overhead: requests through the ZeroMQ echo path")] = 0


class BenchError(ValueError):
    """A scenario problem; the message names the file and the key."""


def find_scenario(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    q = BENCH_DIR / f"{name_or_path}.toml"
    if q.is_file():
        return q
    known = sorted(x.stem for x in BENCH_DIR.glob("*.toml"))
    raise BenchError(f"scenario {name_or_path!r} not found: give a .toml path or one of {known} (or 'all')")


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
        if data.get("profile"):
            prof_path = BENCH_DIR / "profiles" / f"{data['profile']}.toml"
            if not prof_path.is_file():
                raise BenchError(f"{p}: profile: {prof_path} not found")
            data = _deep_merge(tomllib.loads(prof_path.read_text()), data)
        scn = msgspec.convert(data, Scenario, strict=True)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise BenchError(f"{p}: {e}") from None
    if scn.warmup >= scn.steps:
        raise BenchError(f"{p}: warmup ({scn.warmup}) must be < steps ({scn.steps})")
    if not scn.points:
        raise BenchError(f"{p}: no [[points]]: add at least one point")
    for pt in scn.points if scn.kind != "overhead" else []:  # fail before running anything, naming the point
        for variant in ("baseline", "flash"):
            try:
                variant_config(scn, pt, variant)
            except (ConfigError, BenchError) as e:
                raise BenchError(f"{p}: point {pt.label!r} ({variant}): {e}") from None
    return scn


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for k in parts[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise BenchError(f"override {key!r}: {k!r} is a value, not a table")
        node = nxt
    node[parts[-1]] = value


def variant_config(scn: Scenario, pt: PointSpec, variant: Literal["baseline", "flash"]) -> tuple[Config, SimModel]:
    """The flashrl Config and sim model of one run. ``sim.*`` keys override the latency model."""
    tree: dict[str, Any] = {"config": copy.deepcopy(scn.config), "sim": msgspec.to_builtins(scn.sim)}
    layers = [pt.set, scn.baseline, pt.baseline] if variant == "baseline" else [pt.set, scn.flash, pt.flash]
    for layer in layers:
        for key, value in layer.items():
            _set_dotted(tree, key if key.startswith("sim.") else f"config.{key}", value)
    cfg_tree = tree["config"]
    run = cfg_tree.setdefault("run", {})
    run.setdefault("dashboard", "off")
    run["steps"] = scn.steps
    if scn.mode == "sim":
        cfg_tree.setdefault("env", {}).setdefault("name", "sim")
    try:
        sim = msgspec.convert(tree["sim"], SimModel, strict=True)
    except msgspec.ValidationError as e:
        raise BenchError(f"sim: {e}") from None
    cfg = from_dict(cfg_tree, source=f"{scn.name}/{pt.label}/{variant}")
    if scn.mode == "real":  # no latency model: the engines are real; the env must be too
        if cfg.env.name == "sim":
            raise BenchError('env.name = "sim" in a real-mode scenario: name a real environment (e.g. "arithmetic", "guess")')
        return cfg, sim
    if cfg.engine.max_num_seqs != sim.latency.max_num_seqs:
        raise BenchError(
            f"engine.max_num_seqs ({cfg.engine.max_num_seqs}) != sim.latency.max_num_seqs "
            f"({sim.latency.max_num_seqs}): the controller's permits must match the simulated engine"
        )
    return cfg, sim


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
                 redundancy: int = 0) -> TokenLedger:
    """Classify the tokens of every request answered in ``(t0, t1]`` (engine ledgers, ``SimEngine.ledger``).

    Request ids are ``<sample id>.<attempt>.<turn>`` (controller/rollout.py); attempts of one sample
    run one after another, so a trained sample trained its last attempt. An attempt (all its turns) is
      trained  -- its sample was trained and this is the sample's last attempt;
      stale    -- one of its requests was aborted and the sample has a later attempt (the stale early
                  abort restarts a trajectory on fresh weights), or it finished, was never trained,
                  and its first token is older than any step still to come allows
                  (version < final_version - async_ratio: buffer.take_batch's bound);
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
        elif first_turn[(sid, att)][1] < final_version - async_ratio:
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


def _controller_cls() -> Any:
    try:
        from flashrl.controller.controller import Controller
    except ImportError as e:  # pragma: no cover - until the controller lands
        raise BenchError(f"the controller is not available ({e}); the simulator needs flashrl.controller.controller.Controller") from e
    return Controller


def run_variant(cfg: Config, sim: SimModel, warmup: int, out_dir: Path) -> RunResult:
    """Run the real controller on simulated engines/trainer/envs, on virtual time."""
    from flashrl.plugins import make_suite

    Controller = _controller_cls()
    tok = SimTokenizer()
    n_eng = cfg.engine.count
    engines = [
        SimEngine(f"sim{i}", sim.latency, sim.lengths, seed=cfg.run.seed, vocab_size=tok.vocab_size,
                  sync_extra_s=sim.trainer.sync_extra_s(n_eng))
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
    suite = make_suite(cfg.env.name, dict(cfg.env.params), cfg.run.seed, cfg.env.eval_size)
    counters: dict[str, int] = {}

    async def main() -> None:
        ctrl = _make_controller(Controller, cfg, tok, suite, engines, trainer)
        try:
            await ctrl.run()
        finally:
            counters.update(_counters(ctrl))
            for e in engines:
                await e.close()

    loop_jumps: list[int] = []

    async def main_with_jumps() -> None:
        await main()
        loop_jumps.append(getattr(asyncio.get_running_loop(), "jumps", 0))

    _, virtual, cpu = run_virtual(main_with_jumps)
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
                          cfg.scheduler.async_ratio, t0 if warmup > 0 else -1.0, t1, cfg.rollout.redundancy)
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
        events=loop_jumps[0] if loop_jumps else 0,
        counters=counters,
        samples_per_s=samples / step_s if step_s > 0 else 0.0,
        tokens_per_s=resp / step_s if step_s > 0 else 0.0,
        generated_tokens_per_s=(gen_at[-1] - gen0) / (t1 - t0) if t1 > t0 else 0.0,
        response_len_max=max(h.response_len_max for h in window),
        ledger=ledger,
    )


def _make_controller(Controller: Any, cfg: Config, tok: Any, suite: Any, engines: list[SimEngine], trainer: SimTrainer) -> Any:
    params = inspect.signature(Controller).parameters
    kwargs: dict[str, Any] = {}
    if "on_step" in params:
        kwargs["on_step"] = None
    return Controller(cfg, tok, suite, engines, trainer, **kwargs)


def _counters(ctrl: Any) -> dict[str, int]:
    c = getattr(ctrl, "counters", None)
    try:
        return {str(k): int(v) for k, v in dict(c).items()} if c is not None else {}
    except (TypeError, ValueError):
        return {}


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
class PointResult(msgspec.Struct, kw_only=True):
    scenario: str
    label: str
    x: float
    speedup: float  # trained samples per second, flash / baseline (the paper's measure)
    gain: float | None  # speedup / speedup of point ``versus`` (None without one)
    target: float | None
    passed: bool | None
    base_step_s: float
    flash_step_s: float
    base_busy: float
    flash_busy: float
    bound: float  # capacity bound on the speed-up
    formula: float  # ALGORITHMS.md queue-scheduling estimate at the flash async ratio
    closeness: float  # speedup / bound
    flash_staleness_max: int
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
        scenario=scn.name,
        label=pt.label,
        x=pt.x if pt.x is not None else float(index),
        speedup=speedup,
        gain=None,
        target=pt.target,
        passed=None if pt.target is None else speedup >= pt.target,
        base_step_s=base.step_s,
        flash_step_s=flash.step_s,
        base_busy=base.busy,
        flash_busy=flash.busy,
        bound=bound,
        formula=formula,
        closeness=speedup / bound if bound > 0 else math.nan,
        flash_staleness_max=flash.staleness_max,
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


def check_mode(scn: Scenario, mode: str | None, path: str | Path) -> str:
    """The mode to run ``scn`` in: its own unless ``mode`` names it; a mismatch is an error that says why."""
    if mode is None or mode == scn.mode:
        return scn.mode
    if mode == "real":
        raise BenchError(
            f"{path}: scenario {scn.name!r} is sized for the simulator ({_engines(scn)} engines of the "
            f"{scn.profile or 'default'} latency profile); run its scaled-down real twin instead "
            "(bench/real_*.toml, e.g. `flashrl bench real_agentic`), or set mode = \"real\" in a copy sized for this machine"
        )
    raise BenchError(f"{path}: scenario {scn.name!r} has mode = \"real\": it runs real engines, not the simulator; drop --mode sim")


def _engines(scn: Scenario) -> int:
    return int(scn.config.get("engine", {}).get("count", 2))


def run_scenario(path: str | Path, out_dir: str | Path, mode: Literal["sim", "real"] | None = None, quiet: bool = False,
                 steps: int | None = None) -> list[Any]:
    """Run every point of one scenario; write results.json, results.csv and a PNG under ``out_dir/<name>/``.

    ``mode`` None runs the scenario in its own mode (``Scenario.mode``); ``steps`` overrides its step count
    (steady-state checks: compare the ratios at N and 2N steps).
    """
    scn = load_scenario(path)
    if steps is not None:
        if steps <= scn.warmup:
            raise BenchError(f"--steps {steps} must be > the scenario's warmup ({scn.warmup})")
        scn = msgspec.structs.replace(scn, steps=steps)
    if check_mode(scn, mode, path) == "real":
        from flashrl.benchmarks.real import run_real_scenarios

        return run_real_scenarios([(path, scn)], out_dir, quiet=quiet)[0]
    out = Path(out_dir) / scn.name
    out.mkdir(parents=True, exist_ok=True)
    if scn.kind == "overhead":
        from flashrl.benchmarks.overhead import run_overhead

        return run_overhead(scn, out, quiet=quiet)  # type: ignore[return-value]
    results: list[PointResult] = []
    cache: dict[bytes, RunResult] = {}
    with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
        for i, pt in enumerate(scn.points):
            res = run_point(scn, pt, i, Path(tmp), cache)
            if pt.versus:
                ref = next((r for r in results if r.label == pt.versus), None)
                if ref is None:
                    raise BenchError(f"{path}: point {pt.label!r}: versus = {pt.versus!r} names no earlier point")
                res.gain = res.speedup / ref.speedup
                res.passed = None if pt.target is None else res.gain >= pt.target
            results.append(res)
            if not quiet:
                lm = "" if res.lm_speedup is None else f", length-matched {res.lm_speedup:.2f}x"
                print(f"  {scn.name} {pt.label}: {res.speedup:.2f}x samples/s, {res.token_speedup:.2f}x tokens/s{lm}, "
                      f"flash waste {res.flash_waste:.1%} (bound {res.bound:.2f}x, busy {res.flash_busy:.0%}, "
                      f"drift {res.drift:+.1%}, cpu {res.cpu_s:.1f}s)", flush=True)
    write_results(scn, results, out)
    if not quiet:
        print_table(scn, results)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(len(results)))
    ax.plot(xs, [r.speedup for r in results], "o-", label="samples/s ratio")
    ax.plot(xs, [r.token_speedup for r in results], "s-", label="tokens/s ratio")
    if any(r.lm_speedup is not None for r in results):
        ax.plot(xs, [r.lm_speedup if r.lm_speedup is not None else math.nan for r in results], "^-",
                label="samples/s vs length-matched sync")
    ax.plot(xs, [r.bound for r in results], "k--", label="capacity bound")
    if scn.kind != "throughput":
        ax.plot(xs, [r.formula for r in results], ":", color="gray", label="paper formula")
    targets = [r.target for r in results]
    if any(t is not None for t in targets):
        ax.plot(xs, [t if t is not None else math.nan for t in targets], "r_", markersize=18, mew=2, label="bar")
    ax.set_xticks(xs, [r.label for r in results], rotation=30 if len(results) > 5 else 0)
    ax.set_xlabel(scn.x_label)
    ax.set_ylabel("throughput ratio" if scn.kind == "throughput" else "speed-up over sync")
    ax.set_title(scn.title or scn.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(scn: Scenario, results: list[PointResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{scn.name}: {scn.title}")
    for col in ("point", "sync s/step", "flash s/step", "samples/s x", "tokens/s x", "vs len-matched", "waste",
                "stale", "drift", "gain", "bar", "bound", "formula", "busy sync", "busy flash", "stale max", "cpu s"):
        t.add_column(col, justify="right")
    for r in results:
        bar = "" if r.target is None else (f"[green]>={r.target:g} ok[/]" if r.passed else f"[red]>={r.target:g} MISS[/]")
        t.add_row(
            r.label, f"{r.base_step_s:.1f}", f"{r.flash_step_s:.1f}", f"{r.speedup:.2f}x", f"{r.token_speedup:.2f}x",
            "" if r.lm_speedup is None else f"{r.lm_speedup:.2f}x (cap {r.lm_cap})",
            f"{r.flash_waste:.1%}", f"{r.flash_stale_share:.1%}", f"{r.drift:+.1%}",
            "" if r.gain is None else f"{r.gain - 1:+.1%}", bar, f"{r.bound:.2f}x",
            f"{r.formula:.2f}x", f"{r.base_busy:.0%}", f"{r.flash_busy:.0%}",
            str(r.flash_staleness_max), f"{r.cpu_s:.1f}",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)  # a log file gets every column


# --------------------------------------------------------------------------- CLI
def main(argv: list[str]) -> int:
    """``flashrl bench SCENARIO|all [--out DIR] [--mode sim|real]``, ``flashrl bench calibrate RUN_DIR`` and
    ``flashrl bench algorithms [--losses ...] [--ratios ...]`` (learning, not speed: flashrl/benchmarks/algorithms.py),
    ``flashrl bench chaos [CONFIG]`` (engines and the controller SIGKILLed during a run: flashrl/benchmarks/chaos.py)."""
    if argv and argv[0] == "calibrate":
        from flashrl.benchmarks.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "algorithms":
        from flashrl.benchmarks.algorithms import main as algorithms_main

        return algorithms_main(argv[1:])
    if argv and argv[0] == "chaos":
        from flashrl.benchmarks.chaos import main as chaos_main

        return chaos_main(argv[1:])
    ap = argparse.ArgumentParser(prog="flashrl bench", description=__doc__.split("\n")[0])
    ap.add_argument("scenario", help="a bench/*.toml name (e.g. queue_scheduling), a path, or 'all'")
    ap.add_argument("--out", default="bench/results", help="output folder (one subfolder per scenario)")
    ap.add_argument("--mode", choices=["sim", "real"], default=None,
                    help="sim (virtual time) or real (vLLM engines + trainer here); default: the scenario's own mode, sim for 'all'")
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's step count (sim mode; steady-state checks)")
    args = ap.parse_args(argv)
    return bench_main(args.scenario, args.out, args.mode, args.steps)


def scenarios_for(mode: Literal["sim", "real"]) -> list[Path]:
    """The shipped scenarios (bench/*.toml) sized for ``mode``: what ``flashrl bench all --mode MODE`` runs."""
    return [p for p in sorted(BENCH_DIR.glob("*.toml")) if load_scenario(p).mode == mode]


def bench_main(scenario: str, out: str = "bench/results", mode: str | None = None, steps: int | None = None) -> int:
    t0 = time.perf_counter()
    try:
        if scenario == "all":
            mode = mode or "sim"
            paths = scenarios_for(mode)  # type: ignore[arg-type]
        else:
            paths = [find_scenario(scenario)]
            mode = check_mode(load_scenario(paths[0]), mode, paths[0])
        if mode == "real":  # one process pool for every scenario: a cluster is reused while its config allows
            from flashrl.benchmarks.real import run_real_scenarios

            all_results = run_real_scenarios([(p, load_scenario(p)) for p in paths], out)
        else:
            all_results = [run_scenario(p, out, "sim", steps=steps) for p in paths]
    except (BenchError, ConfigError) as e:
        print(f"flashrl bench: {e}", file=sys.stderr)
        return 2
    failed = sum(1 for results in all_results for r in results if getattr(r, "passed", None) is False)
    print(f"bench: {len(paths)} scenario(s) in {time.perf_counter() - t0:.1f}s wall; results under {out}/")
    return 1 if failed else 0
