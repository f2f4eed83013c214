"""What held-out evals cost a run: ``flashrl run`` at several ``run.eval_every`` values, one after another.

    python bench/eval_cost.py [--config configs/tiny.toml] [--every 1,10,0] [--steps N] [--tree DIR]
                              [--out bench/results/evals/runs] [--label after] [--set KEY=VALUE ...]

For each eval_every (0 = off: only step 0 and the final eval) it runs
``python -m flashrl.cli run CONFIG --set run.eval_every=E --set run.name=<label>-every<E>`` with
``PYTHONPATH=TREE`` (``--tree``: another checkout, e.g. the commit before a change; default: this
one), then reads the run's metrics.jsonl and prints one table row per run:

    step_s          mean time/step_s after WARMUP steps (the trainer's wall clock per step)
    train_s         mean time/train_s (the trainer's own step: how loaded the machine was)
    evals           the evals' wall time summed (time/eval_s), per eval, and their mean share of the
                    tokens generated while they ran (eval/engine_share; newer trees)
    trainer_wait_s  what the train loop waited for evals: time/eval_wait_s (this tree) or
                    time/sync/quiesce_s (before evals ran off the training path), summed over steps
    gen_wait_s      seconds training generation sat idle while an eval ran (time/eval/gen_wait_s; newer trees)
    wall_s          the run's time/elapsed_s at its last step
    to80 wall/train the first eval at >= 80% held-out: its time/elapsed_s (wall clock) and the same
                    less every trainer wait for evals before it (training clock)
    final           the last eval's accuracy

Writes OUT/<label>.json (every row) and prints a markdown table. Timings on a shared machine are
noisy: compare rows of one invocation (or one host, back to back) only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WARMUP = 5  # steps left out of the mean step time (start-up transients)
WAIT_KEYS = ("time/eval_wait_s", "time/sync/quiesce_s")  # this tree's, and the one before it


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of one run from its metrics.jsonl records."""
    steps = sorted((r for r in records if int(r["step"]) >= 1 and "time/step_s" in r), key=lambda r: int(r["step"]))
    waited = 0.0
    train_clock: dict[int, float] = {0: 0.0}
    for r in steps:
        waited += sum(float(r.get(k, 0.0)) for k in WAIT_KEYS)
        train_clock[int(r["step"])] = float(r["time/elapsed_s"]) - waited
    evals = sorted((int(r["step"]), float(r["eval/accuracy"])) for r in records if "eval/accuracy" in r)
    to80 = next(((s, a) for s, a in evals if a >= 0.8 - 1e-9), None)
    wall = {int(r["step"]): float(r["time/elapsed_s"]) for r in steps}
    steady = [float(r["time/step_s"]) for r in steps if int(r["step"]) > WARMUP] or [float(r["time/step_s"]) for r in steps]
    return {
        "steps": len(steps),
        "evals": len(evals),
        "step_s": statistics.fmean(steady) if steady else None,
        "eval_s": sum(float(r.get("time/eval_s", 0.0)) for r in records),
        "trainer_wait_s": waited,
        "gen_wait_s": sum(float(r.get("time/eval/gen_wait_s", 0.0)) for r in records),
        "wall_s": float(steps[-1]["time/elapsed_s"]) if steps else None,
        "to80_step": to80[0] if to80 else None,
        "to80_wall_s": wall.get(to80[0], 0.0) if to80 else None,
        "to80_train_s": train_clock.get(to80[0], 0.0) if to80 else None,
        "final_acc": evals[-1][1] if evals else None,
        "eval_mean_s": statistics.fmean(float(r["time/eval_s"]) for r in records if "time/eval_s" in r)
        if any("time/eval_s" in r for r in records) else None,
        "engine_share": statistics.fmean(float(r["eval/engine_share"]) for r in records if "eval/engine_share" in r)
        if any("eval/engine_share" in r for r in records) else None,
        "train_s": statistics.fmean(float(r["time/train_s"]) for r in steps) if steps else None,
        # a multi-turn eval's second copies of its stragglers (newer trees): started, kept
        "hedged": max((int(r.get("count/eval/hedged", 0)) for r in records), default=0),
        "hedge_won": max((int(r.get("count/eval/hedge_won", 0)) for r in records), default=0),
    }


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| run | eval_every | steps | step_s | train_s | evals: sum s / mean s / engine share | trainer wait s (% wall) | "
           "gen wait s | wall s | 80% at step | 80% wall s | 80% train s | final acc |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = 100 * r["trainer_wait_s"] / r["wall_s"] if r["wall_s"] else 0.0
        evals = f"{r['eval_s']:.1f} / {fmt(r.get('eval_mean_s'), '.2f')} / {fmt(r.get('engine_share'), '.2f')}"
        out.append(f"| {r['label']} | {r['every']} | {r['steps']} | {fmt(r['step_s'], '.3f')} | "
                   f"{fmt(r.get('train_s'), '.3f')} | {evals} | "
                   f"{r['trainer_wait_s']:.2f} ({share:.1f}%) | {r['gen_wait_s']:.2f} | {fmt(r['wall_s'], '.1f')} | "
                   f"{fmt(r['to80_step'], 'd')} | {fmt(r['to80_wall_s'], '.1f')} | {fmt(r['to80_train_s'], '.1f')} | "
                   f"{fmt(r['final_acc'], '.3f')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--every", default="1,10,0", help="eval_every values, comma-separated (0 = off)")
    ap.add_argument("--steps", type=int, default=0, help="run.steps (0: the config's)")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="the flashrl checkout to run")
    ap.add_argument("--out", default="bench/results/evals/runs")
    ap.add_argument("--label", default="after")
    ap.add_argument("--set", action="append", default=[], help="more config overrides, KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run, at most")
    ap.add_argument("--collect", action="store_true",
                    help="run nothing: one row per run folder already in --out (<label>-every<E>/metrics.jsonl, or .jsonl.gz)")
    args = ap.parse_args(argv)
    if args.collect:
        rows = []
        for m in sorted([*Path(args.out).glob("*-every*/metrics.jsonl"), *Path(args.out).glob("*-every*/metrics.jsonl.gz")]):
            label, _, every_s = m.parent.name.rpartition("-every")
            text = gzip.decompress(m.read_bytes()).decode() if m.suffix == ".gz" else m.read_text()
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
            rows.append({"label": label, "every": int(every_s), **summarize(records)})
        rows.sort(key=lambda r: (r["every"] == 0, r["every"], r["label"]))
        print(json.dumps(rows, indent=1) if args.label == "json" else table(rows))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = Path(args.tree).resolve()
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    for every in [int(x) for x in args.every.split(",")]:
        name = f"{args.label}-every{every}"
        sets = [f"run.eval_every={every}", f"run.name={name}", f"run.output_dir={out}", "run.checkpoint_every=0",
                *([f"run.steps={args.steps}"] if args.steps else []), *args.set]
        cmd = [sys.executable, "-m", "flashrl.cli", "run", str(Path(args.config).resolve())]
        for s in sets:
            cmd += ["--set", s]
        print("+", " ".join(cmd), flush=True)
        t0 = time.time()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        metrics = out / name / "metrics.jsonl"
        if rc != 0 or not metrics.exists():
            print(f"run {name} failed (exit {rc}); see {out / (name + '.log')}", file=sys.stderr)
            return 1
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        row = {"label": args.label, "every": every, "process_s": time.time() - t0, **summarize(records)}
        rows.append(row)
        print(table([row]), flush=True)
    (out / f"{args.label}.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
