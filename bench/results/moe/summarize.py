"""The table of README.md from the runs of run.sh: python bench/results/moe/summarize.py OUT_DIR [--json FILE]."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEYS = ("moe/disagree", "moe/disagree_all", "mismatch/mean_abs", "mismatch/kl", "mismatch/ratio_std", "iw/max",
        "iw/clipped_frac", "moe/replayed")


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "grad_norm" in r]
    out: dict = {"run": run.name, "evals": evals, "steps": len(train)}
    for k in KEYS:
        v = [r[k] for r in train if k in r]
        out[k] = statistics.mean(v) if v else None
        out[k + " (steps)"] = len(v)
    return out


def main() -> None:
    root = Path(sys.argv[1])
    runs = [summary(d) for d in sorted(root.iterdir()) if (d / "metrics.jsonl").is_file()]
    print("| run | held-out step 0 -> 100 (best) | moe/disagree | moe/disagree_all | mismatch/mean_abs (steps) | "
          "mismatch/ratio_std | iw/max |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        ev = r["evals"]

        def f(k: str, r: dict = r) -> str:
            return "-" if r[k] is None else f"{r[k]:.3g}"

        print(f"| {r['run']} | {ev[0][1]:.1%} -> {ev[-1][1]:.1%} @{ev[-1][0]} ({max(a for _, a in ev):.1%}) | "
              f"{f('moe/disagree')} | {f('moe/disagree_all')} | {f('mismatch/mean_abs')} ({r['mismatch/mean_abs (steps)']}) | "
              f"{f('mismatch/ratio_std')} | {f('iw/max')} |")
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
