"""The tables of README.md: python bench/results/moe/bf16-sensitive/summarize.py OUT_DIR [--json FILE].

Per run, the means over its training steps of the routing and mismatch metrics (docs/algorithms.md, routing
replay), and step 1's values alone: at step 1 both arms of a seed sample the same tokens from the same weights
(same seed, same engine), so off and r3 are compared on identical tokens there (mismatch/tokens says so)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEYS = ("moe/disagree", "moe/disagree_all", "mismatch/mean_abs", "mismatch/max_abs", "mismatch/kl", "mismatch/ratio_std",
        "mismatch/tokens", "moe/replayed", "reward/mean")


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "grad_norm" in r]
    out: dict = {"run": run.name, "evals": evals, "steps": len(train)}
    layers = sorted({k for r in train for k in r if k.startswith("moe/disagree/layer")})
    for k in (*KEYS, *layers):
        v = [r[k] for r in train if k in r]
        out[k] = statistics.mean(v) if v else None
        out[k + " (steps)"] = len(v)
        out[k + " @1"] = train[0].get(k) if train else None
    return out


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def main() -> None:
    root = Path(sys.argv[1])
    runs = [summary(d) for d in sorted(root.iterdir()) if (d / "metrics.jsonl").is_file()]
    print("| run | held-out 0 -> end | moe/disagree | per layer | mismatch/mean_abs | ratio_std | max_abs | "
          "step 1: disagree, mean_abs (tokens) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        ev = r["evals"]
        per = " / ".join(fmt(r[k]) for k in sorted(k for k in r if k.startswith("moe/disagree/layer") and
                                                     k[len("moe/disagree/layer"):].isdigit()))
        print(f"| {r['run']} | {ev[0][1]:.1%} -> {ev[-1][1]:.1%} | {fmt(r['moe/disagree'])} | {per} | "
              f"{fmt(r['mismatch/mean_abs'])} | {fmt(r['mismatch/ratio_std'])} | {fmt(r['mismatch/max_abs'])} | "
              f"{fmt(r['moe/disagree @1'])}, {fmt(r['mismatch/mean_abs @1'])} ({fmt(r['mismatch/tokens @1'])}) |")
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
