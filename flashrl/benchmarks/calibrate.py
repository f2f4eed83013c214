"""``flashrl bench calibrate runs/<name>``: fit the simulator's trainer and length models to a real run.

    runs/<name>/metrics.jsonl (one line per step) --fit--> a [sim] profile TOML on stdout (or --out FILE)
      trainer:  time/train_s = step_fixed_s + per_token_s * tokens        (least squares over steps)
      sync:     time/weight_sync_s -> prepare_weights_s + send_weights_s (split evenly: the run
                does not time them apart)
      lengths:  response_len/mean -> lognormal median for the given sigma (mean = median e^(sigma^2/2))

Limits, stated: the engine's decode-step model (base, per sequence, per KV token) needs per-step
engine timings that metrics.jsonl does not hold; it is left at the profile's values. Tokens per step
are counted from samples x mean response length (prompt tokens are not in the metrics).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from flashrl.metrics import read_jsonl


def fit(records: list[dict], sigma: float = 1.0) -> dict[str, dict[str, float]]:
    rows = [r for r in records if "time/train_s" in r and "samples" in r and "response_len/mean" in r]
    if len(rows) < 2:
        raise ValueError(f"calibration needs at least 2 step records with time/train_s, samples and response_len/mean; found {len(rows)}")
    xs = [r["samples"] * r["response_len/mean"] for r in rows]
    ys = [r["time/train_s"] for r in rows]
    if len(set(xs)) > 1:
        slope, intercept = statistics.linear_regression(xs, ys)
    else:  # one token count: no slope can be told apart from the fixed cost
        slope, intercept = 0.0, statistics.fmean(ys)
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="flashrl bench calibrate")
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of response lengths (not identifiable from means)")
    ap.add_argument("--out", default="", help="write the profile here instead of stdout")
    args = ap.parse_args(argv)
    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"flashrl bench calibrate: {path} not found: give a run directory from `flashrl run`")
        return 2
    try:
        text = to_toml(fit(read_jsonl(path), args.sigma))
    except ValueError as e:
        print(f"flashrl bench calibrate: {e}")
        return 2
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0
