"""Time to a held-out target with the evals' engine time taken out: the step at which a run of the learning
invocation first reached the target, read on the training clock of the same mode and seed in an invocation
run without held-out evals.

    python bench/peers_clock.py bench/results/longtail-peers/final bench/results/longtail-peers/noeval \
        --targets 0.5,0.45,0.55 [--out clock.md]

Why: flashrl evaluates on its training engines, beside training. On one busy engine an async run's eval takes
generation time from its rollouts, and that time is on its training clock. A sync run's eval fills the time its
engine would idle anyway, and TRL's evals run between its steps, off its clock. In the learning invocation each
run's held-out curve gives the step that first reached the target. In the timing invocation (``run.eval_every =
0``: evals at step 0 and the last step only) the same mode and seed give the training clock at that step. TRL
has no timing run: its own clock already leaves its evals out. Both clocks leave out what a step waited for an
eval, as ``flashrl bench peers`` does.

Caveat, printed with the table: the crossing step and the clock come from two runs. A sync run is deterministic
(the same held-out curve in every invocation of this bench), so for sync the number is what one run without the
evals' engine time would show. An async run's curve varies from run to run, so for async the number is the
clock of the step at which the learning run crossed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashrl.bench.peers.report import eval_wait, read_metrics  # noqa: E402


def training_clock(metrics: Path) -> dict[int, float]:
    """step -> seconds of training clock at its end (time/elapsed_s less the eval waits up to it)."""
    clock, waited = {0: 0.0}, 0.0
    steps = sorted((r for r in read_metrics(metrics) if int(r["step"]) >= 1 and "time/elapsed_s" in r),
                   key=lambda r: int(r["step"]))
    for r in steps:
        waited += eval_wait(r)
        clock[int(r["step"])] = float(r["time/elapsed_s"]) - waited
    return clock


def crossing(evals: list[list[float]], target: float) -> int | None:
    """The first evaluated step at or above ``target`` (evals: [step, accuracy, ...] rows)."""
    for row in evals:
        if row[1] >= target - 1e-9:
            return int(row[0])
    return None


def table(learn: Path, timing: Path, targets: list[float]) -> str:
    runs: list[dict[str, Any]] = json.loads((learn / "results.json").read_text())
    by = {(r["mode"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    # TRL, and the flashrl modes that have a timing run
    modes = [m for m in ("trl", "sync", "async", "wait", "drop") if any((m, s) in by for s in seeds)
             and (m == "trl" or any((timing / "runs" / f"{m}-seed{s}").exists() for s in seeds))]
    lines = ["| seed | target | " + " | ".join(modes) + " | sync / async | sync / async, sync's faster clock | TRL / async |",
             "|---|---:|" + "---:|" * (len(modes) + 3)]
    for s in seeds:
        for t in targets:
            cells: dict[str, float | None] = {}
            text = []
            for m in modes:
                r = by.get((m, s))
                step = crossing(r["evals"], t) if r else None
                if r is None or step is None:
                    cells[m] = None
                    text.append("not reached" if r else "-")
                    continue
                if m == "trl":
                    sec = dict((int(e[0]), e[2]) for e in r["evals"]).get(step)
                else:
                    metrics = timing / "runs" / f"{m}-seed{s}" / "metrics.jsonl"
                    sec = training_clock(metrics).get(step) if metrics.exists() else None
                cells[m] = sec
                text.append(f"{sec:.1f} s ({step})" if sec is not None else f"no timing run ({step})")

            # sync's own run in the learning invocation, evals inline, at the same step: the sync runs of two
            # invocations differ by up to ~20% in step time on a shared host, so the faster one is the
            # conservative comparison
            sync_run, sync_step = by.get(("sync", s)), None
            if sync_run is not None:
                sync_step = crossing(sync_run["evals"], t)
            own = dict((int(e[0]), e[2]) for e in sync_run["evals"]).get(sync_step) if sync_run and sync_step else None
            fast = min(x for x in (cells.get("sync"), own) if x is not None) if (cells.get("sync") or own) else None

            def ratio(x: float | None, y: float | None) -> str:
                return f"{x / y:.2f}x" if x and y else ""
            lines.append(f"| {s} | {t:.0%} | " + " | ".join(text) + f" | {ratio(cells.get('sync'), cells.get('async'))} | "
                         f"{ratio(fast, cells.get('async'))} | {ratio(cells.get('trl'), cells.get('async'))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("learn", type=Path, help="the invocation with held-out evals (its results.json, its runs)")
    ap.add_argument("timing", type=Path, help="the invocation without evals (run.eval_every = 0), same modes and seeds")
    ap.add_argument("--targets", default="0.5", help="comma-separated held-out accuracies")
    ap.add_argument("--out", type=Path, help="also write the table here")
    a = ap.parse_args()
    md = table(a.learn, a.timing, [float(x) for x in a.targets.split(",")])
    print(md)
    if a.out:
        a.out.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
