"""``flashrl bench calibrate runs/<name>``: fit the simulator to a real run, then check it predicts that run.

    runs/<name>/metrics.jsonl (one line per step) --fit--> a [sim] profile TOML on stdout (or --out FILE)
      trainer:  time/train_s = step_fixed_s + per_token_s * tokens        (least squares over steps;
                only when the tokens explain the times, R^2 >= MIN_R2, else a constant: on a shared
                machine with near-equal batches the noise would otherwise set the slope)
      sync:     time/weight_sync_s -> prepare_weights_s + send_weights_s (split evenly: the run
                does not time them apart)
      lengths:  response_len/mean -> lognormal median for the given sigma (mean = median e^(sigma^2/2))
    runs/<name>/config.toml + the fitted profile --simulate--> predicted seconds per step
      the REAL controller with the run's engine count, batch, scheduler and rollout settings on
      simulated engines/trainer/env (simulate.run_variant), compared with the measured time/step_s over
      the same steps -> "error" (predicted / measured - 1), printed and written as comments

Limits, stated: the engine's decode-step model (base, per sequence, per KV token) needs per-step
engine timings that metrics.jsonl does not hold; the prediction uses CPU_TINY_LATENCY below (the
built-in model on one CPU core, measured on the project's 2-core CPU machine: 256 prompts x 32 tokens in 0.8 s) or
``--latency FILE`` ([sim.latency] of a profile). Tokens per step are counted from samples x mean
response length (prompt tokens are not in the metrics). The engines' weight load is taken as part of
the fitted sync time (weight_load_s = 0). The simulated environment keeps the run's turns per
sample and its delay (``sim_delay``: a ``[env.params.faults]`` lognormal or constant delay, or a tool
env's ``[env.params.latency]``, also inside ``remote``), nothing else about the env.
Compared steps: 2..N, leaving out step 1 (vLLM's first batch, the trainer's first step) and every
step that ran beside an evaluation (the step after an eval record): the simulator runs no evals.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from flashrl.bench.scenario import SimModel
from flashrl.bench.simulate import RunResult, run_variant
from flashrl.config import Config, from_dict, load
from flashrl.metrics import read_jsonl
from flashrl.plugins import make_suite

# The built-in tiny model on one vLLM CPU engine (threads = 1). Measured on the project's 2-core CPU
# machine: 256 prompts x 32 tokens in 0.8 s after warm-up: ~25 ms per decode step at 256 sequences = 5 ms + 256 x 80 us.
CPU_TINY_LATENCY: dict[str, float] = {
    "decode_base_s": 5e-3, "decode_per_seq_s": 8e-5, "decode_per_kv_token_s": 0.0, "prefill_per_token_s": 1e-5,
    "weight_load_s": 0.0,
}


MIN_R2 = 0.5  # share of the train-time variance the token count must explain before a slope is fitted


def fit(records: list[dict], sigma: float = 1.0) -> dict[str, dict[str, float]]:
    rows = [r for r in records if "time/train_s" in r and "samples" in r and "response_len/mean" in r]
    if len(rows) < 2:
        raise ValueError(f"calibration needs at least 2 step records with time/train_s, samples and response_len/mean; found {len(rows)}")
    xs = [r["samples"] * r["response_len/mean"] for r in rows]
    ys = [r["time/train_s"] for r in rows]
    slope, intercept = 0.0, statistics.fmean(ys)  # one token count: no slope can be told apart from the fixed cost
    if len(set(xs)) > 1 and len(set(ys)) > 1 and statistics.correlation(xs, ys) ** 2 >= MIN_R2:
        slope, intercept = statistics.linear_regression(xs, ys)
        if intercept < 0:  # a per-token cost alone, through the origin
            slope, intercept = statistics.fmean(ys) / statistics.fmean(xs), 0.0
    sync = statistics.fmean(r.get("time/weight_sync_s", 0.0) for r in rows)
    mean_len = statistics.fmean(r["response_len/mean"] for r in rows)
    return {
        "trainer": {"step_fixed_s": max(0.0, intercept), "per_token_s": max(0.0, slope), "gpus": 1.0,
                    "prepare_weights_s": sync / 2, "send_weights_s": sync / 2},
        "lengths": {"median": mean_len / math.exp(sigma**2 / 2), "sigma": sigma},
    }


def to_toml(profile: dict[str, dict[str, float]]) -> str:
    out = ["# fitted by `flashrl bench calibrate` (see flashrl/bench/calibrate.py for what is and is not fitted)"]
    for table, values in profile.items():
        out.append(f"[sim.{table}]")
        out += [f"{k} = {v:.6g}" for k, v in values.items()]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- prediction
class Prediction(msgspec.Struct, kw_only=True):
    steps: list[int]  # the compared steps (1-based, as in metrics.jsonl)
    measured_s: float  # mean time/step_s of the real run over ``steps``
    predicted_s: float  # mean simulated step time over the same steps
    error: float  # predicted / measured - 1
    sim_cpu_s: float


def compared_steps(records: list[dict[str, Any]]) -> list[int]:
    """Steps 2..N that did not run beside an eval (an eval started at step s runs during step s+1)."""
    by_step = {int(r["step"]): r for r in records if "step" in r}
    eval_at = {s for s, r in by_step.items() if "eval/accuracy" in r}
    return [s for s, r in sorted(by_step.items()) if s >= 2 and "time/step_s" in r and s - 1 not in eval_at]


def _sim_env_params(cfg: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's environment as the simulator's: prompt length, turns per sample, injected delay."""
    suite = make_suite(*inner_env(cfg), cfg.run.seed, 1)
    prompts = [t.prompt for t in list(suite.train_tasks())[:256]]
    turns = [r["turns/mean"] for r in records if "turns/mean" in r]
    n_turns = max(1, round(statistics.fmean(turns))) if turns else 1
    params: dict[str, Any] = {
        "prompt_chars": max(1, round(statistics.fmean(len(p) for p in prompts))),  # char-level: 1 token per char
        "turns_min": n_turns, "turns_max": n_turns, "obs_chars": 8,
        "p_correct": min(1.0, max(0.0, statistics.fmean(r.get("reward/mean", 0.5) for r in records if "step" in r))),
    }
    delay = sim_delay(cfg)
    if delay.get("reset_delay"):  # a [faults] delay: as this prediction always drew it, on env.step, uncapped
        params["delay"] = {k: v for k, v in delay["delay"].items() if k != "max_s"}
    elif delay:  # a tool latency: tool calls only
        params |= delay
    return params


def inner_env(cfg: Any) -> tuple[str, dict[str, Any]]:
    """(name, params) of the environment that runs the episodes: ``cfg.env``, or what ``remote`` wraps
    (``[env.params] inner = ..., [env.params.params]``; nested wrappers unwrapped in turn)."""
    name, params = cfg.env.name, dict(cfg.env.params)
    while name == "remote":
        name, params = str(params.get("inner", "")), dict(params.get("params") or {})
    return name, params


def sim_delay(cfg: Any) -> dict[str, Any]:
    """The run's environment latency as the simulated env's ``delay``, ``reset_delay``, ``answer_delay``
    (``{}``: no delay). Two ways an environment says it waits, read from the env inside any ``remote``:
      ``[..faults] delay``   envs/faults.py: every call (reset and each step) waits a draw; a lognormal
                              given by its mean (-> median = mean e^(-sigma^2/2)) or a constant
      ``[..latency]``         an env whose Params has ``latency`` with median_s, sigma and max_s
                              (envs/tools.py: median_s and p99_s, sigma = ln(p99/median) / z_0.99): each
                              tool call waits a draw; reset and the final answer (a verifier) do not
    Both at once cannot be one simulated delay: a ValueError says so."""
    name, params = inner_env(cfg)
    out: dict[str, Any] = {}
    delay = (params.get("faults") or {}).get("delay")
    if isinstance(delay, dict) and delay.get("kind") == "lognormal":
        sig = float(delay.get("sigma", 1.0))
        out = {"delay": {"median_s": float(delay.get("mean_s", 1.0)) * math.exp(-sig**2 / 2), "sigma": sig,
                         "max_s": float(delay.get("max_s", 0.0))}, "reset_delay": True, "answer_delay": True}
    elif isinstance(delay, dict) and delay.get("kind") == "constant":
        out = {"delay": {"median_s": float(delay.get("seconds", 0.0)), "sigma": 0.0}, "reset_delay": True, "answer_delay": True}
    suite = make_suite(name, params, cfg.run.seed, 1) if name else None
    while suite is not None and not hasattr(suite.params, "latency") and hasattr(suite, "inner"):
        suite = suite.inner  # a [faults] table wraps the env in envs/faults.py's FaultySuite
    lat = getattr(suite.params, "latency", None) if suite is not None else None
    if lat is not None and float(getattr(lat, "median_s", 0.0)) > 0:
        if out and out["delay"]["median_s"] > 0:
            raise ValueError(f"env {name!r} has both a [faults] delay and a tool [latency]: the simulator models one "
                             "delay distribution; drop one of them for calibration")
        out = {"delay": {"median_s": float(lat.median_s), "sigma": float(lat.sigma), "max_s": float(lat.max_s)},
               "reset_delay": False, "answer_delay": False}
    return out


def predict(run_dir: Path, profile: dict[str, dict[str, float]], latency: dict[str, float] | None = None) -> Prediction:
    """Simulate the run in ``run_dir`` with ``profile`` and compare its step time with the measured one."""
    cfg = _as_measured(load(run_dir / "config.toml"), tomllib.loads((run_dir / "config.toml").read_text()))
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = compared_steps(records)
    if not steps:
        raise ValueError(f"{run_dir}: no step to compare (need steps >= 2 not beside an eval); run more steps")
    lat = dict(latency or CPU_TINY_LATENCY) | {"max_num_seqs": cfg.engine.max_num_seqs}
    params = _sim_env_params(cfg, records)
    # fit() counts response tokens only; the simulated trainer charges prompt + response tokens.
    trainer = dict(profile["trainer"])
    samples = statistics.fmean(r["samples"] for r in records if "samples" in r)
    trainer["step_fixed_s"] = max(0.0, trainer["step_fixed_s"] - trainer["per_token_s"] * samples * params["prompt_chars"])
    sim = msgspec.convert({"latency": lat, "lengths": profile["lengths"], "trainer": trainer}, SimModel)
    env = msgspec.structs.replace(cfg.env, name="sim", params=params)
    n = max(steps)
    sim_cfg = msgspec.structs.replace(
        cfg, env=env, run=msgspec.structs.replace(cfg.run, steps=n, dashboard="off", max_time_s=0.0))
    with tempfile.TemporaryDirectory(prefix="flashrl-calibrate-") as tmp:
        res = run_variant(sim_cfg, sim, 0, Path(tmp))
    ends = [0.0, *res.step_ends]
    by_step = {int(r["step"]): r for r in records if "step" in r}
    measured = statistics.fmean(by_step[s]["time/step_s"] for s in steps)
    predicted = statistics.fmean(ends[s] - ends[s - 1] for s in steps)
    return Prediction(steps=steps, measured_s=measured, predicted_s=predicted, error=predicted / measured - 1,
                      sim_cpu_s=res.cpu_s)


def calibrate_run(run_dir: Path, sigma: float = 1.0, out: str = "", latency_toml: str = "",
                  predict_run: bool = True) -> int:
    """``flashrl bench calibrate RUN_DIR``: fit a profile to the run's metrics.jsonl and (with its config.toml)
    simulate the run with it; print or write the profile with the prediction as a comment. Exit code: 0, or 2
    with the problem on stderr."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"flashrl bench calibrate: {path} not found: give a run directory from `flashrl run`", file=sys.stderr)
        return 2
    try:
        profile = fit(read_jsonl(path), sigma)
    except ValueError as e:
        print(f"flashrl bench calibrate: {e}", file=sys.stderr)
        return 2
    text = to_toml(profile)
    if predict_run and not (run_dir / "config.toml").is_file():
        text += f"# prediction skipped: {run_dir / 'config.toml'} not found (the simulator needs the run's config)\n"
    elif predict_run:
        latency = None
        if latency_toml:
            latency = tomllib.loads(Path(latency_toml).read_text()).get("sim", {}).get("latency")
            if not latency:
                print(f"flashrl bench calibrate: {latency_toml} has no [sim.latency] table", file=sys.stderr)
                return 2
        try:
            p = predict(run_dir, profile, latency)
        except ValueError as e:
            print(f"flashrl bench calibrate: {e}", file=sys.stderr)
            return 2
        text += (
            f"# prediction: the simulator with this profile predicts {p.predicted_s:.3f} s/step; the run measured "
            f"{p.measured_s:.3f} s/step over steps {_ranges(p.steps)}: error {p.error:+.1%}\n"
        )
    if out:
        Path(out).write_text(text)
        if predict_run:
            print(text.splitlines()[-1])  # the prediction line
    else:
        print(text, end="")
    return 0


def _ranges(steps: list[int]) -> str:
    """``2-10,12-20``; past 4 ranges just the count and the span (the rest is in the docstring's rule)."""
    out: list[str] = []
    for s in steps:
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    if len(out) > 4:
        return f"{steps[0]}-{steps[-1]} ({len(steps)} steps; step 1 and each step beside an eval left out)"
    return ",".join(out)


# --------------------------------------------------------------------------- out-of-sample prediction
# ``flashrl bench calibrate --cross RESULTS.json ...``: fit the timing on ONE variant of a committed
# real-mode result (bench/results/real_*/results.json), predict every OTHER variant (another scheduler
# config and/or another environment), report each prediction's error. What is fitted, from the fit run only:
#   engine   CPU_TINY_LATENCY's step costs x one scale k, bisected so that the simulated fit run's
#            s/step equals the measured one (k is clamped to [K_MIN, K_MAX]; clamped = the engine did
#            not set that run's step time)
#   trainer  per_token_s = train_s / tokens per step (through the origin: one batch size cannot
#            separate a fixed cost from a per-token one), step_fixed_s = 0
#   sync     prepare_weights_s = send_weights_s = sync_s / 2
#   judge    (a config with judge.model) tokens per verdict, pass rate and reused share from its counters; the
#            judge engines' scale kj to its busy time per verdict (in turn with k), then, both held,
#            sim.judge.overhead_s (time per verdict outside the judge's steps, >= 0) to its mean verdict latency
# What the predicted run contributes is its workload, never a timing: its config (engine count,
# batch, scheduler, env delay distribution, max_new_tokens) and its measured turns per sample and
# tokens per turn (the policy's behaviour). The env delay (sim_delay): the config's [env.params.faults]
# delay on every call (reset and step), as envs/faults.py does, or a tool env's [env.params.latency]
# (envs/tools.py) on its tool calls only; inside a ``remote`` wrapper, the wrapped env's tables.
K_MIN, K_MAX = 0.05, 50.0


class CrossRun(msgspec.Struct, kw_only=True):
    """One variant of a real-mode result, as calibration sees it."""

    name: str  # "<scenario>/<variant>"
    cfg: Any
    warmup: int
    steps: int
    step_s: float
    train_s: float
    sync_s: float
    samples_per_s: float
    tokens_per_s: float
    response_len: float
    turns: float
    # the judge stage (configs with judge.model), from the run's last env/judge_* counters: verdict_tokens,
    # p_pass (fitted from the fit run), latency_ms (what a prediction is compared with)
    judge: dict[str, float] = {}


def load_cross_runs(path: Path, config: str = "") -> list[CrossRun]:
    doc = msgspec.json.decode(Path(path).read_bytes())
    if isinstance(doc, list):  # `flashrl bench seeds` / `peers`: one row per (mode, seed), metrics/ beside it
        return load_seed_runs(Path(path), doc, config)
    if doc.get("mode") != "real":
        raise ValueError(f"{path}: not a real-mode result (mode = {doc.get('mode')!r}); give bench/results/real_*/results.json")
    scn = doc["scenario"]
    out = []
    for p in doc["points"]:
        for v, key in (("base", "base_config"), ("flash", "flash_config")):
            cfg_tree = _known_keys({k: val for k, val in p[key].items() if k != "sim"})
            cfg = _as_measured(from_dict(cfg_tree, source=f"{path}:{key}"), p[key])
            r = p[v]
            out.append(CrossRun(
                name=f"{scn['name']}/{v}", cfg=cfg, warmup=int(scn["warmup"]),
                steps=int(r["steps"]), step_s=r["step_s"], train_s=r["train_s"], sync_s=r["sync_s"],
                samples_per_s=r["samples_per_s"], tokens_per_s=r["tokens_per_s"], response_len=r["response_len"], turns=r["turns"]))
    return out


SEED_WARMUP = 5  # steps of a seeds run the cross fit leaves out (start-up), as real-mode scenarios do


def load_seed_runs(path: Path, rows: list[dict[str, Any]], config: str) -> list[CrossRun]:
    """The flashrl runs of a `flashrl bench seeds` results.json (modes async and sync; peers' rows are left
    out): ``config`` is the config they ran (not in the file), with run.seed and, for sync, the synchronous
    overrides set as the bench set them; each run's judge counters come from metrics/<name>.metrics.jsonl.xz (or .gz)."""
    from flashrl.bench.readme import read_jsonl

    if not config:
        raise ValueError(f"{path} is a `flashrl bench seeds` result: give the config its runs used with --config")
    base = tomllib.loads(Path(config).read_text())
    out = []
    for r in rows:
        if r.get("mode") not in ("async", "sync") or r.get("returncode", 0) != 0:
            continue
        tree = copy.deepcopy(base)
        tree.setdefault("run", {})["seed"] = int(r["seed"])
        if r["mode"] == "sync":
            tree.setdefault("scheduler", {}).update({"async_ratio": 0, "queue_scheduling": False})
        cfg = from_dict(tree, source=f"{config} ({r['name']})")
        judge: dict[str, float] = {}
        found = [p for p in (path.parent / "metrics" / f"{r['name']}.metrics.jsonl{x}" for x in (".xz", ".gz"))
                 if p.is_file()]
        if found:
            judge = judge_stats(read_jsonl(found[0]))
        parts = r.get("parts") or {}
        out.append(CrossRun(
            name=f"{path.parent.name}/{r['name']}", cfg=cfg, warmup=SEED_WARMUP, steps=int(r["steps"]),
            step_s=float(r["step_s"]), train_s=float(parts.get("train_s", 0.0)),
            sync_s=float(parts.get("weight_sync_s", 0.0)), samples_per_s=float(r["samples_per_s"]),
            tokens_per_s=float(r["tokens_per_s"]), response_len=float(r["mean_len"]), turns=1.0, judge=judge))
    if not out:
        raise ValueError(f"{path}: no async or sync flashrl run in it")
    return out


def judge_stats(records: list[dict[str, Any]]) -> dict[str, float]:
    """A run's judge stage from its records' cumulative ``env/judge_*`` counters ({} without a judge):
    verdict_tokens, p_pass (of the verdicts the engines gave) and reuse (the share of judged episodes given a
    verdict again, judge.cache_size) over the run; latency_ms and busy_per_verdict_s over the steps not beside an
    eval (compared_steps: the simulator runs no evals, and an eval's 400 verdicts at once queue longer)."""
    rows = [r for r in records if "step" in r and "env/judge_verdicts" in r]
    if not rows or not rows[-1]["env/judge_verdicts"]:
        return {}
    last = rows[-1]
    n = float(last["env/judge_verdicts"])
    keep = set(compared_steps(records))
    lat = busy = count = 0.0
    for prev, cur in zip(rows, rows[1:]):
        if int(cur["step"]) not in keep:
            continue
        dn = cur["env/judge_verdicts"] - prev["env/judge_verdicts"]
        if dn <= 0:
            continue
        lat += (cur.get("env/judge_latency_ms", 0.0) * cur["env/judge_verdicts"]
                - prev.get("env/judge_latency_ms", 0.0) * prev["env/judge_verdicts"])
        busy += cur.get("env/judge_busy_s", 0.0) - prev.get("env/judge_busy_s", 0.0)
        count += dn
    if not count:
        return {}
    cached = float(last.get("env/judge_cached", 0.0))  # verdicts given again (judge.cache_size), no engine time
    return {"verdict_tokens": last["env/judge_tokens"] / n, "p_pass": last["env/judge_pass"] / n,
            "latency_ms": lat / count, "busy_per_verdict_s": busy / count, "reuse": cached / (cached + n)}


def _as_measured(cfg: Config, tree: dict[str, Any]) -> Config:
    """``cfg`` as the run behind ``tree`` (its config as written) ran: one written before
    weight_sync.overlap existed synced the weights serially (train, sync, next step); one written before
    scheduler.stale existed dropped stale samples (stale = "drop")."""
    if "stale" not in (tree.get("scheduler") or {}):
        cfg = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(cfg.scheduler, stale="drop"))
    if "overlap" in (tree.get("weight_sync") or {}):
        return cfg
    return msgspec.structs.replace(cfg, weight_sync=msgspec.structs.replace(cfg.weight_sync, overlap=False))


def _known_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` without the keys today's Config no longer has (a result written by an older flashrl)."""
    out: dict[str, Any] = {}
    sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
    for sec, body in tree.items():
        typ = sections.get(sec)
        if typ is None:
            continue
        if isinstance(body, dict) and isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            names = {f.name for f in msgspec.structs.fields(typ)}
            body = {k: v for k, v in body.items() if k in names}
        out[sec] = body
    return out


def _prompt_chars(cfg: Any) -> int:
    suite = make_suite(*inner_env(cfg), cfg.run.seed, 1)  # the wrapped suite: a remote one would start workers
    prompts = [t.prompt for t in list(suite.train_tasks())[:256]]
    return max(1, round(statistics.fmean(len(p) for p in prompts)))


def _tokens_per_step(run: CrossRun, prompt_chars: int) -> float:
    samples = run.cfg.rollout.batch_prompts * run.cfg.rollout.group_size
    return samples * (prompt_chars + run.response_len)


def simulate_cross(run: CrossRun, k: float, fit: CrossRun, fit_prompt: int, kj: float = 1.0, jo: float = 0.0) -> RunResult:
    """``run`` simulated with the timing fitted on ``fit`` (engine scale ``k``; a judge stage, when ``run``
    has one, with ``fit``'s tokens per verdict and pass rate, the same engine costs x ``kj`` (the judge engines
    run the policy engines' model family here) and ``jo`` seconds per verdict outside the judge's steps); its
    ``step_s`` is the predicted steady s/step."""
    cfg = run.cfg
    prompt = _prompt_chars(cfg)
    turns = max(1, round(run.turns))
    gen_per_sample = run.tokens_per_s / run.samples_per_s if run.samples_per_s > 0 else run.response_len
    per_turn = max(1.0, min(float(cfg.rollout.max_new_tokens), gen_per_sample / run.turns))
    obs = max(0, round((run.response_len - gen_per_sample) / (run.turns - 1))) if run.turns > 1.05 else 0
    # turns_mean: the measured mean, not its rounding (1.66 turns of the tools task rounded to 2 would give
    # every episode a tool call: 64 latency draws per step where a third of the run's episodes made none,
    # so a later slowest call in the synchronous baseline)
    params: dict[str, Any] = {"prompt_chars": prompt, "turns_min": turns, "turns_max": turns, "turns_mean": max(1.0, run.turns),
                              "obs_chars": obs, "reset_delay": True}
    params |= sim_delay(cfg)
    lat = {key: v * k if key.endswith("_s") and key != "weight_load_s" else v for key, v in CPU_TINY_LATENCY.items()}
    lat["max_num_seqs"] = cfg.engine.max_num_seqs
    per_token = fit.train_s / _tokens_per_step(fit, fit_prompt)
    trainer = {"step_fixed_s": 0.0, "per_token_s": per_token, "gpus": 1.0,
               "prepare_weights_s": fit.sync_s / 2, "send_weights_s": fit.sync_s / 2}
    sim_tree: dict[str, Any] = {"latency": lat, "lengths": {"dist": "constant", "median": per_turn}, "trainer": trainer}
    if cfg.judge.model and fit.judge:
        sim_tree["judge"] = {"verdict_tokens": fit.judge["verdict_tokens"], "p_pass": fit.judge["p_pass"], "scale": kj,
                             "reuse": min(0.99, fit.judge.get("reuse", 0.0)), "overhead_s": jo}
    sim = msgspec.convert(sim_tree, SimModel)
    env = msgspec.structs.replace(cfg.env, name="sim", params=params)
    sim_cfg = msgspec.structs.replace(cfg, env=env, run=msgspec.structs.replace(cfg.run, steps=run.steps, dashboard="off", max_time_s=0.0))
    with tempfile.TemporaryDirectory(prefix="flashrl-cross-") as tmp:
        return run_variant(sim_cfg, sim, run.warmup, Path(tmp))


def fit_engine_scale(fit: CrossRun, kj: float = 1.0) -> tuple[float, bool]:
    """(k, clamped): the engine-cost scale that makes the simulated fit run's s/step the measured one
    (``kj``: the judge engines' own scale, when the run has a judge)."""
    prompt = _prompt_chars(fit.cfg)
    return _bisect(lambda k: simulate_cross(fit, k, fit, prompt, kj).step_s, fit.step_s)


def fit_judge_overhead(fit: CrossRun, k: float, kj: float) -> float:
    """The seconds per verdict outside the judge engine's steps (sim.judge.overhead_s) that make the simulated
    fit run's mean verdict latency the measured one: what the engine steps do not explain (a real verdict's
    request and answer cross a socket and wait for the judge process's engine thread, which a busy host
    schedules late). Never below 0: where the simulated engine alone is already slower than measured, 0 (the
    busy-time fit of ``kj`` then decides). A few fixed-point rounds from 0: the latency grows about one for
    one with the overhead (the verdicts' batches change a little)."""
    prompt = _prompt_chars(fit.cfg)
    want = fit.judge["latency_ms"] / 1000
    jo = 0.0
    for _ in range(3):
        got = simulate_cross(fit, k, fit, prompt, kj, jo).judge.get("judge_latency_ms", 0.0) / 1000
        nxt = max(0.0, jo + want - got)
        if abs(nxt - jo) < 1e-3 * want:
            return nxt
        jo = nxt
    return jo


def fit_judge_scale(fit: CrossRun, k: float) -> tuple[float, bool]:
    """(kj, clamped): the judge engines' cost scale (on the same CPU_TINY_LATENCY: the judge is a model of the
    policy's family here) that makes the simulated fit run's judge engine busy time per verdict the measured
    one. Busy time, not latency: it is the engine's work; the latency (queueing behind other verdicts,
    which the policy's pace decides) is what the fit then predicts."""
    prompt = _prompt_chars(fit.cfg)

    def busy(kj: float) -> float:
        j = simulate_cross(fit, k, fit, prompt, kj).judge
        return j.get("judge_busy_s", 0.0) / max(1.0, j.get("judge_verdicts", 0.0))

    return _bisect(busy, fit.judge["busy_per_verdict_s"])


def fit_scales(fit: CrossRun) -> tuple[float, bool, float, float]:
    """(k, clamped, kj, jo): the engine scale, and with a judge stage its own scale (to its busy time per verdict),
    fitted in turn (each moves the other's target a little: the judge's verdicts hold episodes, its engine shares
    nothing with the policy's); then, those held, its per-verdict overhead (to its latency; 0 where the engine
    steps alone already take as long as measured), last and alone: in the same loop it traded off against k and
    kj and did not settle (bench/results/judge/sim-calibration-overhead). kj = 1.0, jo = 0 without a judge."""
    k, clamped = fit_engine_scale(fit)
    if not fit.judge:
        return k, clamped, 1.0, 0.0
    kj = 1.0
    for _ in range(2):
        kj, _ = fit_judge_scale(fit, k)
        k, clamped = fit_engine_scale(fit, kj)
    return k, clamped, kj, fit_judge_overhead(fit, k, kj)


def _bisect(f: Callable[[float], float], target: float) -> tuple[float, bool]:
    """(x, clamped): x in [K_MIN, K_MAX] with f(x) = target, f rising in x (bisected on log x, to ~0.3%)."""
    lo, hi = math.log(K_MIN), math.log(K_MAX)
    if f(K_MIN) >= target:
        return K_MIN, True
    if f(K_MAX) <= target:
        return K_MAX, True
    for _ in range(12):
        mid = (lo + hi) / 2
        if f(math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2), False


class CrossRow(msgspec.Struct, kw_only=True):
    fit: str
    target: str
    measured_s: float
    predicted_s: float
    error: float  # predicted / measured - 1
    in_sample: bool
    # the judge stage (runs with one): mean latency from an episode's end to its verdict, measured / predicted
    judge_measured_ms: float = 0.0
    judge_predicted_ms: float = 0.0


def cross_validate(runs: list[CrossRun], fit_names: list[str] | None = None
                   ) -> tuple[list[CrossRow], dict[str, tuple[float, bool]], dict[str, tuple[float, float]]]:
    """Fit on each of ``fit_names`` (default: every run) in turn; predict every run. Also returns each fit's
    judge stage (kj, jo) where it has one."""
    rows: list[CrossRow] = []
    scales: dict[str, tuple[float, bool]] = {}
    judge_fits: dict[str, tuple[float, float]] = {}
    by_name = {r.name: r for r in runs}
    for name in fit_names or list(by_name):
        if name not in by_name:
            raise ValueError(f"--fit {name!r}: not one of {sorted(by_name)}")
        fit = by_name[name]
        k, clamped, kj, jo = fit_scales(fit)
        scales[name] = (k, clamped)
        if fit.judge:
            judge_fits[name] = (kj, jo)
        fp = _prompt_chars(fit.cfg)
        for r in runs:
            res = simulate_cross(r, k, fit, fp, kj, jo)
            pred = res.step_s
            rows.append(CrossRow(fit=name, target=r.name, measured_s=r.step_s, predicted_s=pred,
                                 error=pred / r.step_s - 1, in_sample=r.name == name,
                                 judge_measured_ms=r.judge.get("latency_ms", 0.0),
                                 judge_predicted_ms=float(res.judge.get("judge_latency_ms", 0.0))))
    return rows, scales, judge_fits


def ratio_rows(rows: list[CrossRow]) -> list[dict[str, Any]]:
    """Per fit and scenario with both variants predicted: the flash speed-up, measured and predicted."""
    out = []
    cell = {(r.fit, r.target): r for r in rows}
    for fit in dict.fromkeys(r.fit for r in rows):
        for scn in dict.fromkeys(r.target.rsplit("/", 1)[0] for r in rows):
            b, f = cell.get((fit, f"{scn}/base")), cell.get((fit, f"{scn}/flash"))
            if b and f:
                m, p = b.measured_s / f.measured_s, b.predicted_s / f.predicted_s
                out.append({"fit": fit, "scenario": scn, "measured": m, "predicted": p, "error": p / m - 1})
    return out


def cross_main(paths: list[str], fit_names: list[str], out: str, config: str = "") -> int:
    runs = [r for p in paths for r in load_cross_runs(Path(p), config)]
    rows, scales, judge_fits = cross_validate(runs, fit_names or None)
    oos = [abs(r.error) for r in rows if not r.in_sample]
    lines = ["fit run -> predicted run: measured / predicted s/step, error (out of sample unless marked)"]
    lines += [f"  fit {n}: judge engine scale {kj:.3g}, per-verdict overhead outside its steps {1000 * jo:.0f} ms"
              for n, (kj, jo) in judge_fits.items()]
    for r in rows:
        k, clamped = scales[r.fit]
        tag = " (in sample)" if r.in_sample else ""
        judge = (f"; judge latency {r.judge_measured_ms:.0f} / {r.judge_predicted_ms:.0f} ms, "
                 f"{r.judge_predicted_ms / r.judge_measured_ms - 1:+.1%}" if r.judge_measured_ms else "")
        lines.append(f"  {r.fit} (k={k:.3g}{', clamped' if clamped else ''}) -> {r.target}: "
                     f"{r.measured_s:.3f} / {r.predicted_s:.3f} s, {r.error:+.1%}{judge}{tag}")
    if oos:
        lines.append(f"out-of-sample |error|: mean {statistics.fmean(oos):.1%}, max {max(oos):.1%} over {len(oos)} predictions")
    joos = [abs(r.judge_predicted_ms / r.judge_measured_ms - 1) for r in rows if not r.in_sample and r.judge_measured_ms]
    if joos:
        lines.append(f"out-of-sample judge latency |error|: mean {statistics.fmean(joos):.1%}, max {max(joos):.1%} "
                     f"over {len(joos)} predictions")
    ratios = ratio_rows(rows)
    if ratios:
        lines.append("flash speed-up (base s/step / flash s/step), measured vs predicted:")
        lines += [f"  fit {r['fit']}: {r['scenario']}: {r['measured']:.2f}x measured, {r['predicted']:.2f}x predicted ({r['error']:+.1%})"
                  for r in ratios]
    print("\n".join(lines))
    if out:
        o = Path(out)
        o.mkdir(parents=True, exist_ok=True)
        doc = {"sources": paths, "scales": {n: {"k": k, "clamped": c} for n, (k, c) in scales.items()},
               "judge": {n: {"scale": kj, "overhead_s": jo} for n, (kj, jo) in judge_fits.items()}, "rows": rows, "ratios": ratios,
               "oos_mean_abs_error": statistics.fmean(oos) if oos else None, "oos_max_abs_error": max(oos) if oos else None,
               "oos_judge_mean_abs_error": statistics.fmean(joos) if joos else None,
               "oos_judge_max_abs_error": max(joos) if joos else None}
        (o / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
        (o / "results.txt").write_text("\n".join(lines) + "\n")
    return 0
