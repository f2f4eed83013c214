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
      simulated engines/trainer/env (bench.run_variant), compared with the measured time/step_s over
      the same steps -> "error" (predicted / measured - 1), printed and written as comments

Limits, stated: the engine's decode-step model (base, per sequence, per KV token) needs per-step
engine timings that metrics.jsonl does not hold; the prediction uses CPU_TINY_LATENCY below (the
built-in model on one CPU core, from PLATFORM.md's measured 256 prompts x 32 tokens in 0.8 s) or
``--latency FILE`` ([sim.latency] of a profile). Tokens per step are counted from samples x mean
response length (prompt tokens are not in the metrics). The engines' weight load is taken as part of
the fitted sync time (weight_load_s = 0). The simulated environment keeps the run's turns per
sample and its ``[env.params.faults]`` lognormal or constant delay, nothing else about the env.
Compared steps: 2..N, leaving out step 1 (vLLM's first batch, the trainer's first step) and every
step that ran beside an evaluation (the step after an eval record): the simulator runs no evals.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import tomllib

from flashrl.metrics import read_jsonl

# The built-in tiny model on one vLLM CPU engine (threads = 1). PLATFORM.md measured 256 prompts x 32
# tokens in 0.8 s after warm-up: ~25 ms per decode step at 256 sequences = 5 ms + 256 x 80 us.
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
    out = ["# fitted by `flashrl bench calibrate` (see flashrl/benchmarks/calibrate.py for what is and is not fitted)"]
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
    from envs import make_suite

    suite = make_suite(cfg.env.name, dict(cfg.env.params), cfg.run.seed, 1)
    prompts = [t.prompt for t in list(suite.train_tasks())[:256]]
    turns = [r["turns/mean"] for r in records if "turns/mean" in r]
    n_turns = max(1, round(statistics.fmean(turns))) if turns else 1
    params: dict[str, Any] = {
        "prompt_chars": max(1, round(statistics.fmean(len(p) for p in prompts))),  # char-level: 1 token per char
        "turns_min": n_turns, "turns_max": n_turns, "obs_chars": 8,
        "p_correct": min(1.0, max(0.0, statistics.fmean(r.get("reward/mean", 0.5) for r in records if "step" in r))),
    }
    delay = (cfg.env.params.get("faults") or {}).get("delay")
    if isinstance(delay, dict) and delay.get("kind") == "lognormal":  # mean -> median of the same lognormal
        sig = float(delay.get("sigma", 1.0))
        params["delay"] = {"median_s": float(delay.get("mean_s", 1.0)) * math.exp(-sig**2 / 2), "sigma": sig}
    elif isinstance(delay, dict) and delay.get("kind") == "constant":
        params["delay"] = {"median_s": float(delay.get("seconds", 0.0)), "sigma": 0.0}
    return params


def predict(run_dir: Path, profile: dict[str, dict[str, float]], latency: dict[str, float] | None = None) -> Prediction:
    """Simulate the run in ``run_dir`` with ``profile`` and compare its step time with the measured one."""
    from flashrl.bench import SimModel, run_variant
    from flashrl.config import load

    cfg = load(run_dir / "config.toml")
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="flashrl bench calibrate")
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl (and config.toml for the prediction)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of response lengths (not identifiable from means)")
    ap.add_argument("--out", default="", help="write the profile here instead of stdout")
    ap.add_argument("--latency", default="", help="a profile TOML whose [sim.latency] the prediction uses (default: CPU_TINY_LATENCY)")
    ap.add_argument("--no-predict", action="store_true", help="only fit; do not simulate the run")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"flashrl bench calibrate: {path} not found: give a run directory from `flashrl run`")
        return 2
    try:
        profile = fit(read_jsonl(path), args.sigma)
    except ValueError as e:
        print(f"flashrl bench calibrate: {e}")
        return 2
    text = to_toml(profile)
    if not args.no_predict and not (run_dir / "config.toml").is_file():
        text += f"# prediction skipped: {run_dir / 'config.toml'} not found (the simulator needs the run's config)\n"
    elif not args.no_predict:
        latency = None
        if args.latency:
            latency = tomllib.loads(Path(args.latency).read_text()).get("sim", {}).get("latency")
            if not latency:
                print(f"flashrl bench calibrate: {args.latency} has no [sim.latency] table")
                return 2
        try:
            p = predict(run_dir, profile, latency)
        except ValueError as e:
            print(f"flashrl bench calibrate: {e}")
            return 2
        text += (
            f"# prediction: the simulator with this profile predicts {p.predicted_s:.3f} s/step; the run measured "
            f"{p.measured_s:.3f} s/step over steps {_ranges(p.steps)}: error {p.error:+.1%}\n"
        )
    if args.out:
        Path(args.out).write_text(text)
        if not args.no_predict:
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
