"""Off-policy algorithm sweep: final held-out accuracy and reward per (loss x async_ratio), vs sync.

    for loss in losses, ratio in ratios (ratio 0 = synchronous is always included: it is the baseline):
        flashrl run CONFIG --set algorithm.loss=L --set scheduler.async_ratio=R --set run.steps=N
                           --set run.name=alg-L-rR --set run.output_dir=OUT/runs     (one process, in turn)
        -> OUT/runs/<name>/metrics.jsonl (step, reward/mean, eval/accuracy) and OUT/logs/<name>.log
    then: OUT/results.json, results.csv, results.md (table), results.png (accuracy and reward vs step)

Runs are sequential on purpose: they share the machine, so running them side by side would change what
each one measures. A run that fails (non-zero exit, or no metrics file) is kept as a row with its exit
code and the log path, never dropped. "Final reward" is the mean of reward/mean over the last
``FINAL_WINDOW`` logged steps (one step's batch reward is noisy); "final accuracy" is the last
eval/accuracy logged.

    flashrl bench algorithms --losses ppo,decoupled_ppo,topr --ratios 0,2 --steps 60 --out runs/bench-alg
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

FINAL_WINDOW = 5  # steps averaged for the final training reward


@dataclass
class Curve:
    """One run's logged history."""

    steps: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)


@dataclass
class Point:
    """One (loss, async_ratio) run and its summary."""

    loss: str
    ratio: int
    run_name: str
    returncode: int | None = None
    wall_s: float | None = None
    log: str = ""
    final_accuracy: float | None = None
    final_reward: float | None = None
    acc_vs_sync: float | None = None
    reward_vs_sync: float | None = None
    curve: Curve = field(default_factory=Curve)


def run_name(prefix: str, loss: str, ratio: int) -> str:
    return f"{prefix}-{loss}-r{ratio}"


def read_curve(path: Path) -> Curve:
    """Parse metrics.jsonl (one JSON object per line); lines without a step are skipped."""
    curve = Curve()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "step" not in rec:
            continue
        step = int(rec["step"])
        if rec.get("reward/mean") is not None:
            curve.steps.append(step)
            curve.reward.append(float(rec["reward/mean"]))
        if rec.get("eval/accuracy") is not None:
            curve.eval_steps.append(step)
            curve.accuracy.append(float(rec["eval/accuracy"]))
    return curve


def summarize(points: list[Point]) -> None:
    """Fill final_* and the differences to the synchronous (ratio 0) run of the same loss, in place."""
    for p in points:
        p.final_accuracy = p.curve.accuracy[-1] if p.curve.accuracy else None
        tail = p.curve.reward[-FINAL_WINDOW:]
        p.final_reward = sum(tail) / len(tail) if tail else None
    sync = {p.loss: p for p in points if p.ratio == 0}
    for p in points:
        base = sync.get(p.loss)
        if base is None:
            continue
        if p.final_accuracy is not None and base.final_accuracy is not None:
            p.acc_vs_sync = p.final_accuracy - base.final_accuracy
        if p.final_reward is not None and base.final_reward is not None:
            p.reward_vs_sync = p.final_reward - base.final_reward


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def markdown_table(points: list[Point]) -> str:
    """The results table: one row per (loss, ratio)."""
    lines = [
        "| loss | async_ratio | final held-out acc | acc - sync | final reward | reward - sync | wall s | status |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in sorted(points, key=lambda q: (q.loss, q.ratio)):
        status = "ok" if p.returncode in (0, None) and p.curve.steps else f"failed (rc {p.returncode}, see {p.log})"
        lines.append(
            f"| {p.loss} | {p.ratio} | {_fmt(p.final_accuracy)} | {_fmt(p.acc_vs_sync, True)} | "
            f"{_fmt(p.final_reward)} | {_fmt(p.reward_vs_sync, True)} | "
            f"{'n/a' if p.wall_s is None else f'{p.wall_s:.0f}'} | {status} |"
        )
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path) -> None:
    """Two panels, held-out accuracy and training reward vs step; colour = loss, line style = ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = sorted({p.loss for p in points})
    ratios = sorted({p.ratio for p in points})
    colors = {loss: plt.get_cmap("tab10")(i % 10) for i, loss in enumerate(losses)}
    styles = ["-", "--", ":", "-."]
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in points:
        style = styles[ratios.index(p.ratio) % len(styles)]
        label = f"{p.loss} r={p.ratio}"
        if p.curve.eval_steps:
            ax_acc.plot(p.curve.eval_steps, p.curve.accuracy, style, color=colors[p.loss], marker="o", ms=3, label=label)
        if p.curve.steps:
            ax_rew.plot(p.curve.steps, p.curve.reward, style, color=colors[p.loss], label=label)
    ax_acc.set(title="held-out accuracy", xlabel="step", ylabel="eval/accuracy")
    ax_rew.set(title="training reward", xlabel="step", ylabel="reward/mean")
    for ax in (ax_acc, ax_rew):
        ax.grid(alpha=0.3)
    ax_rew.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(points: list[Point], out_dir: Path) -> dict[str, Path]:
    """results.json (everything, curves included), results.csv, results.md, results.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summarize(points)
    paths = {k: out_dir / f"results.{k}" for k in ("json", "csv", "md", "png")}
    paths["json"].write_text(json.dumps([asdict(p) for p in points], indent=1))
    cols = ["loss", "ratio", "run_name", "returncode", "wall_s", "final_accuracy", "acc_vs_sync", "final_reward",
            "reward_vs_sync"]
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for p in points:
            w.writerow(["" if getattr(p, c) is None else getattr(p, c) for c in cols])
    paths["md"].write_text("# Off-policy algorithms: final held-out accuracy and reward\n\n" + markdown_table(points))
    plot(points, paths["png"])
    return paths


def _default_cmd() -> list[str]:
    script = Path(sys.executable).parent / "flashrl"
    if script.exists():
        return [str(script)]
    found = shutil.which("flashrl")
    return [found] if found else [sys.executable, "-m", "flashrl.cli"]


def _completed(run_dir: Path, steps: int) -> float | None:
    """The wall time of a run in ``run_dir`` that finished ``steps`` steps (its summary.json), else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if int(summary.get("steps", 0)) < steps or not (run_dir / "metrics.jsonl").exists():
        return None
    return float(summary.get("wall_s") or 0.0)


def run_algorithms_bench(losses: Sequence[str], ratios: Sequence[int], steps: int, out_dir: str | Path,
                         config: str | Path = "configs/tiny.toml", *, prefix: str = "alg",
                         flashrl_cmd: Sequence[str] | None = None, extra_sets: Sequence[str] = (),
                         timeout_s: float | None = None, resume: bool = False) -> list[Point]:
    """Run every (loss, ratio) through the real CLI, one after another, then write the results files.

    ``resume``: a run whose ``summary.json`` in OUT says it completed ``steps`` steps is kept as it is
    (its curve and wall time read back), not run again; every other run (missing, failed, cut short)
    is run afresh in a clean folder.
    """
    if not losses:
        raise ValueError("run_algorithms_bench: losses is empty; give at least one, e.g. ['ppo']")
    if steps < 1:
        raise ValueError(f"run_algorithms_bench: steps={steps} must be >= 1")
    ratio_list = sorted(set(int(r) for r in ratios) | {0})  # sync is the baseline every row is compared to
    out = Path(out_dir)
    runs_dir, logs_dir = out / "runs", out / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    cmd0 = list(flashrl_cmd) if flashrl_cmd else _default_cmd()
    points: list[Point] = []
    for loss in losses:
        for ratio in ratio_list:
            name = run_name(prefix, loss, ratio)
            sets = [f"algorithm.loss={loss}", f"scheduler.async_ratio={ratio}", f"run.steps={steps}",
                    f"run.name={name}", f"run.output_dir={runs_dir}", "run.dashboard=plain", *extra_sets]
            cmd = [*cmd0, "run", str(config)] + [arg for s in sets for arg in ("--set", s)]
            log = logs_dir / f"{name}.log"
            point = Point(loss=loss, ratio=ratio, run_name=name, log=str(log))
            done = _completed(runs_dir / name, steps) if resume else None
            if done is not None:
                point.returncode, point.wall_s = 0, done
                point.curve = read_curve(runs_dir / name / "metrics.jsonl")
                print(f"[bench] {name}: kept (completed {steps} steps earlier)", flush=True)
                points.append(point)
                continue
            shutil.rmtree(runs_dir / name, ignore_errors=True)  # never mix a new run with an old one's metrics
            t0 = time.monotonic()
            with log.open("w") as f:
                f.write(" ".join(cmd) + "\n")
                f.flush()
                try:
                    point.returncode = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
                except subprocess.TimeoutExpired:
                    point.returncode = -9
                    f.write(f"\nbench: killed after {timeout_s} s\n")
            point.wall_s = time.monotonic() - t0
            metrics = runs_dir / name / "metrics.jsonl"
            if metrics.exists():
                point.curve = read_curve(metrics)
            print(f"[bench] {name}: rc={point.returncode} {point.wall_s:.0f}s "
                  f"{len(point.curve.steps)} steps logged", flush=True)
            points.append(point)
    write_results(points, out)
    return points
