"""The knob table of bench/results/tools-knobs/README.md: python bench/results/tools-knobs/summary.py [RESULTS_JSON]

From the bench's results.json (every mode x seed): time to the 70% held-out target on the training clock,
steps/s (steps over the training clock), engine busy, env wait share, and the ratios against sync0 (the
plain synchronous loop) and against async2 (async ratio alone: each single knob's own contribution)."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

MODES = ["sync0", "async2", "envasync", "redundant", "queue", "all"]
TARGET = "70%"


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "seeds" / "results.json")
    runs = {(r["mode"], r["seed"]): r for r in json.loads(path.read_text())}
    seeds = sorted({s for _, s in runs})

    def ttt(m: str, s: int) -> float | None:
        r = runs.get((m, s))
        t = r and (r.get("time_to") or {}).get(TARGET)
        return t["train_s"] if t else None

    def cell(v: float | None, fmt: str = "{:.1f}") -> str:
        return fmt.format(v) if v is not None else "-"

    def pct(vals: Iterable[float], fmt: str = "{:.0%}") -> str:
        return ", ".join(fmt.format(v) for v in vals)

    out = [f"| mode | time to {TARGET}, training clock (s), seeds {', '.join(map(str, seeds))} | x vs sync0 | x vs async2 | "
           "steps/s | x vs sync0 (steps/s) | engine busy | env wait share | final held-out |",
           "|---|---|---|---|---|---|---|---|---|"]
    for m in MODES:
        t = [ttt(m, s) for s in seeds]
        vs_sync = [(ttt("sync0", s) or 0) / v if v else None for s, v in zip(seeds, t)]
        vs_async = [(ttt("async2", s) or 0) / v if v else None for s, v in zip(seeds, t)]
        rs = [runs[(m, s)] for s in seeds if (m, s) in runs]
        sps = [r["steps"] / r["train_s"] for r in rs]
        sps0 = [runs[("sync0", r["seed"])]["steps"] / runs[("sync0", r["seed"])]["train_s"] for r in rs if ("sync0", r["seed"]) in runs]
        out.append(
            f"| {m} | {', '.join(cell(v) for v in t)} | {', '.join(cell(v, '{:.2f}') for v in vs_sync)} | "
            f"{', '.join(cell(v, '{:.2f}') for v in vs_async)} | {', '.join(f'{v:.2f}' for v in sps)} | "
            f"{statistics.fmean(a / b for a, b in zip(sps, sps0)):.2f} | "
            f"{pct(r['engine_busy']['busy'] for r in rs)} | {pct(r['env_share'] for r in rs)} | "
            f"{pct((r['final_acc'] for r in rs), '{:.1%}')} |")
    print("\n".join(out))


if __name__ == "__main__":
    main()
