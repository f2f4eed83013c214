"""Summarise the make-run A/B: per run, median step time, elapsed, eval wait, when held-out reached 80%.

Usage: python abstat.py LABEL=RUN_DIR [LABEL=RUN_DIR ...]  (RUN_DIR holds metrics.jsonl)
"""

import json
import statistics
import sys
from pathlib import Path


def summarise(label: str, run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rows.sort(key=lambda r: r.get("step", 0))
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    step_s = statistics.median(r["time/step_s"] for r in steps)
    wait = sum(r.get("time/sync/quiesce_s", 0) + r.get("time/eval_wait_s", 0) for r in steps)
    reached = [r for r in rows if r.get("eval/accuracy", 0) >= 0.8]
    s80 = reached[0]["step"] if reached else None
    t80 = next((r["time/elapsed_s"] for r in reached if "time/elapsed_s" in r), float("nan"))
    elapsed = max(r.get("time/elapsed_s", 0) for r in rows)
    final = [r for r in rows if "eval/accuracy" in r][-1]["eval/accuracy"]
    return (
        f"{label}: median step {step_s * 1000:.0f} ms, elapsed {elapsed:.1f} s, eval wait {wait:.1f} s "
        f"({wait / elapsed:.1%}), 80% at step {s80} / {t80:.1f} s, final {final:.3f}"
    )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        label, _, path = arg.partition("=")
        print(summarise(label, Path(path)))
