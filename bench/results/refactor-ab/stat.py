"""One line per run of the before/after: median step, elapsed, samples/s, when held-out first reached AT, final.

Usage: python stat.py AT LABEL=PATH [LABEL=PATH ...]   (AT: e.g. 0.8; PATH: a run folder holding metrics.jsonl,
or a metrics.jsonl.gz such as runs/*.metrics.jsonl.gz here)
"""

import gzip
import json
import statistics
import sys
from pathlib import Path


def summarise(label: str, run_dir: Path, at: float) -> str:
    text = gzip.open(run_dir, "rt").read() if run_dir.suffix == ".gz" else (run_dir / "metrics.jsonl").read_text()
    rows = sorted((json.loads(x) for x in text.splitlines() if x.strip()),
                  key=lambda r: r.get("step", 0))
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    step_s = statistics.median(r["time/step_s"] for r in steps)
    elapsed = max(r.get("time/elapsed_s", 0) for r in rows)
    samples = sum(r.get("samples", r.get("batch/samples", 0)) or 0 for r in steps)
    reached = [r for r in rows if r.get("eval/accuracy", 0) >= at]
    s_at = reached[0]["step"] if reached else None
    t_at = reached[0].get("time/elapsed_s", float("nan")) if reached else float("nan")
    evals = [r for r in rows if "eval/accuracy" in r]
    return (f"{label}: {len(steps)} steps, median step {step_s * 1000:.0f} ms, elapsed {elapsed:.1f} s, "
            f"{samples / elapsed if samples else float('nan'):.1f} samples/s, {at:.0%} at step {s_at} / {t_at:.1f} s, "
            f"held-out {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f}")


if __name__ == "__main__":
    at = float(sys.argv[1])
    for arg in sys.argv[2:]:
        label, _, path = arg.partition("=")
        print(summarise(label, Path(path), at))
