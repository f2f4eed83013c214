"""Step profile of every run of the knob comparison: python bench/results/tools-knobs/profile.py [SEEDS_DIR]

Means over steps 6..N (after the warm-up steps, as the bench's own table) of each run's metrics.jsonl:
step time, the trainer's train_s (the same work in every mode: 64 samples of ~16 tokens, so its spread
is the host's load), weight sync, what of the step the trainer does not cover (step - train; the async modes sync the weights beside
the next step),
engine busy and the env wait share. Writes profile.md beside the runs' folder and prints it."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

MODES = ["sync0", "async2", "envasync", "redundant", "queue", "all"]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "seeds")
    rows = ["| run | s/step | train_s | weight sync | step - train | step / train | engine busy | env share | aborted redundant / step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in sorted((root / "runs").glob("*-seed*"), key=lambda p: (p.name.split("-seed")[1], MODES.index(p.name.split("-seed")[0]))):
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        recs_steps = [r for r in recs if "time/step_s" in r]
        st = recs_steps[5:]
        if not st:
            continue

        def m(key: str, st: list[dict] = st) -> float:
            vals = [r[key] for r in st if key in r]
            return statistics.fmean(vals) if vals else 0.0

        step, train, sync = m("time/step_s"), m("time/train_s"), m("time/weight_sync_s")
        rows.append(f"| {run.name} | {step:.2f} | {train:.2f} | {sync:.2f} | {step - train:+.2f} | {step / train:.2f} | "
                    f"{m('engine/busy'):.0%} | {m('rollout/env_share'):.0%} | {recs[-1].get('count/rollout/aborted_redundant', 0) / len(recs_steps):.1f} |")
    text = "\n".join(rows) + "\n"
    (root / "profile.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
