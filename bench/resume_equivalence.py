"""Resume equivalence on the embedded default, synchronous (async_ratio 0): N uninterrupted steps vs
K steps + `flashrl run --resume` to N. Compares the prompts trained at every step and the held-out accuracy.

    python bench/resume_equivalence.py [--steps 60] [--stop 30] [--out bench/results/resume]

Writes <out>/results.json (and the two runs' metrics.jsonl / summary.json under <out>/runs/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, name: str, steps: int, *extra: str) -> float:
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"),
           "--set", f"run.output_dir={out / 'runs'}", "--set", f"run.name={name}", "--set", f"run.steps={steps}",
           "--set", "run.max_time_s=0", "--set", f"run.eval_every={steps // 2 if name == 'full' else 0}",
           "--set", "scheduler.async_ratio=0", "--set", "run.dashboard=plain", *extra]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - t0
    (out / f"{name}{'-resume' if '--resume' in extra else ''}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return took


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--stop", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "resume")
    a = ap.parse_args()
    shutil.rmtree(a.out / "runs", ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    t_full = run(a.out, "full", a.steps)
    # the split run evaluates where the full one does: at the stop (its final eval) and at the end
    t_first = run(a.out, "split", a.stop, "--set", f"run.eval_every={a.stop}")
    t_second = run(a.out, "split", a.steps, "--set", f"run.eval_every={a.stop}", "--resume")
    full, split = rows(a.out / "runs" / "full" / "metrics.jsonl"), rows(a.out / "runs" / "split" / "metrics.jsonl")
    steps_full, steps_split = [r["step"] for r in full], [r["step"] for r in split]
    same = [sorted(x["prompt_uids"]) == sorted(y["prompt_uids"]) for x, y in zip(full[1:], split[1:])]
    acc = lambda rs: {r["step"]: r["eval/accuracy"] for r in rs if "eval/accuracy" in r}  # noqa: E731
    summary = json.loads((a.out / "runs" / "split" / "summary.json").read_text())
    res = {
        "command": f"python bench/resume_equivalence.py --steps {a.steps} --stop {a.stop}",
        "steps": a.steps, "stop": a.stop,
        "metrics_steps_full": steps_full == list(range(a.steps + 1)),
        "metrics_steps_split_no_dup_no_gap": steps_split == list(range(a.steps + 1)),
        "same_prompts_every_step": all(same) and len(same) == a.steps,
        "eval_full": acc(full), "eval_split": acc(split),
        "wall_s": {"full": round(t_full, 1), "split_first": round(t_first, 1), "split_resumed": round(t_second, 1)},
        "resumed_checkpoint_s": summary.get("checkpoint_s"), "resumed_checkpoint_share": summary.get("checkpoint_share"),
        # what the resume kept of the untrained work (partial mode: the rollouts in flight at the stop, continued)
        # and generated again; and whether the first step after it trained the uninterrupted run's very samples
        # (it does when they were re-admitted and regenerated with the same seeds, not when continued)
        "resume_counters": {k: v for k, v in (summary.get("result") or {}).get("counters", {}).items()
                            if k.startswith("resume/")},
        "reward_after_stop": {"full": full[a.stop + 1].get("reward/mean"), "split": split[a.stop + 1].get("reward/mean")},
    }
    (a.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    for d in (a.out / "runs").iterdir():  # keep the records, not the weights
        for sub in ("checkpoints", "logs"):
            shutil.rmtree(d / sub, ignore_errors=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
