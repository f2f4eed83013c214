"""``flashrl bench peers``: flashrl (async and sync) against Hugging Face TRL's GRPOTrainer, same everything.

    flashrl bench peers [--modes trl,async,sync] [--seeds 0] [--sync-seeds S] [--steps N] [--resume]
                        [--config configs/tiny.toml] [--out bench/results/peers]
        for seed in seeds, for mode in modes (one process at a time: they share the machine; sync only
        for the first seed unless --sync-seeds says otherwise):
          trl   : python -m flashrl.benchmarks.peers trl CONFIG --seed S ...   (one process, HF generate)
          async : flashrl run CONFIG --set run.seed=S                          (the config as it is)
          sync  : flashrl run CONFIG --set run.seed=S --set scheduler.async_ratio=0
                                     --set scheduler.queue_scheduling=false
          each child is watched from here: its metrics.jsonl lines are time-stamped as they appear
          (start-up = min over lines of appeared - time/elapsed_s) and the resident memory of its whole
          process tree is sampled every 0.5 s (peak)
        -> OUT/results.json, results.csv, results.md (table + what differs), results.png
    flashrl bench seeds [--seeds 0,1,2]   the same, modes "async" only, OUT bench/results/seeds

The TRL peer (``run_trl``) is set up from the flashrl config: the same model folder (``ensure_model``:
the built-in tiny model, float32), the train prompts in flashrl's order (``DataStream`` for the seed:
epoch 0's shuffle, ``batch_prompts`` per step, TRL's own shuffling off), the same held-out split and
verifier (envs.arithmetic.verify through the env), and the hyperparameters mapped one to one
(``trl_settings``): group size -> num_generations, a step's prompts x group = generation batch split
into ``mini_batches`` optimizer steps (steps_per_generation), temperature, max new tokens, AdamW lr and
weight decay, flashrl's lr schedule (``scheduled_lr``: warm-up and decay by training step, the same lr on
both its optimizer steps: a LambdaLR given to TRL), PPO clip eps_low/eps_high, token-mean loss (TRL "dapo": over the
active tokens of the optimizer step's batch, one process, no accumulation), std-scaled group
advantages, no KL (beta 0), grad clip. Held-out accuracy every ``run.eval_every`` steps: greedy, the
same 400 tasks, ``max_new_tokens`` tokens, scored by the env's verifier; its time is taken out of the
training clock. flashrl evaluates on its engines beside training; what its steps waited for an eval
(``time/eval_wait_s``; ``time/sync/quiesce_s`` before evals ran off the training path) is taken out of
its training clock (``summarize``).

Reported per run: time to 70/80/85% held-out accuracy (first eval at or above; training clock and whole
process = start-up + training clock), trained samples/s over the whole training clock, the mean step
time and its parts after ``WARMUP_STEPS``, peak memory (process tree), first/final/best accuracy and
the worst dip after first reaching 80%.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashrl.benchmarks.steptime import engine_busy

THRESHOLDS = (0.70, 0.80, 0.85)
WARMUP_STEPS = 5  # steps left out of the mean step time (start-up transients)
MODES = ("trl", "async", "sync")
SYNC_SETS = ("scheduler.async_ratio=0", "scheduler.queue_scheduling=false")
MODE_LABEL = {"trl": "TRL GRPOTrainer (sync, HF generate, 1 process)", "async": "flashrl async (config as is)",
              "sync": "flashrl sync (async_ratio 0, no queue scheduling)"}


# flashrl: what a step waited for held-out evals (time/eval_wait_s), or, in runs from before evals ran
# off the training path, for the eval before its weight sync (time/sync/quiesce_s)
EVAL_WAITS = ("time/eval_wait_s", "time/sync/quiesce_s")


def eval_wait(r: dict[str, Any]) -> float:
    """Seconds a flashrl step record waited for held-out evals."""
    return sum(float(r.get(k, 0.0)) for k in EVAL_WAITS)


class PeerConfigError(ValueError):
    """The flashrl config uses something the TRL peer cannot reproduce; the message names the key."""


# --------------------------------------------------------------------------- results
@dataclass
class Run:
    """One (mode, seed) run and what the bench read from it."""

    mode: str
    seed: int
    name: str
    returncode: int | None = None
    log: str = ""
    wall_s: float | None = None  # launch -> exit, measured here
    startup_s: float | None = None  # launch -> training clock 0
    train_s: float | None = None  # training clock at the last step
    steps: int = 0
    samples: int = 0
    samples_per_s: float | None = None
    peak_mem_gib: float | None = None  # process tree, sampled here
    step_s: float | None = None
    parts: dict[str, float] = field(default_factory=dict)  # mean seconds per step, by phase
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, accuracy, training clock)
    time_to: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    first_acc: float | None = None
    final_acc: float | None = None
    best_acc: float | None = None
    worst_dip: float | None = None  # largest drop below the running best after first reaching 80%
    min_after_80: float | None = None
    eval_wait_s: float = 0.0  # held-out evals' time taken out of the training clock (flashrl: waits for them)
    # flashrl: the least busy engine thread's share of the wall time, mean over steps (stepping, commands, busy)
    engine_busy: dict[str, float] = field(default_factory=dict)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as a list of records (blank or torn last lines skipped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def startup_offset(appeared: Sequence[tuple[float, float]]) -> float | None:
    """Launch -> training clock 0, from (seconds after launch a record appeared, its time/elapsed_s) pairs.

    A record appears at or after the moment it describes, so every difference is an upper bound; the
    smallest is the estimate (its error is the polling interval plus the writer's delay)."""
    diffs = [a - e for a, e in appeared]
    return max(0.0, min(diffs)) if diffs else None


def summarize(run: Run, records: list[dict[str, Any]]) -> None:
    """Fill ``run``'s numbers from its metrics records (flashrl's metrics.jsonl or the TRL peer's, same keys)."""
    steps = sorted((r for r in records if int(r["step"]) >= 1 and "time/elapsed_s" in r), key=lambda r: int(r["step"]))
    # The training clock leaves held-out evals out, for both: TRL's evals run between its steps and
    # its time/elapsed_s already excludes them; flashrl's run on the engines beside training, and what a
    # step waited for one (eval_wait) is taken out here.
    clock, waited = {0: 0.0}, 0.0
    for r in steps:
        waited += eval_wait(r)
        clock[int(r["step"])] = float(r["time/elapsed_s"]) - waited
    run.eval_wait_s = waited
    evals = []
    for r in records:
        if r.get("eval/accuracy") is None:
            continue
        s = int(r["step"])
        t = clock.get(s, float(r.get("time/elapsed_s", 0.0)))
        evals.append((s, float(r["eval/accuracy"]), t))
    evals.sort()
    run.evals = evals
    run.steps = max((int(r["step"]) for r in steps), default=0)
    run.samples = int(sum(float(r.get("samples", 0)) for r in steps))
    run.train_s = clock.get(run.steps) if run.steps else None
    run.samples_per_s = run.samples / run.train_s if run.train_s else None
    steady = [r for r in steps if int(r["step"]) > WARMUP_STEPS] or steps
    if steady:
        run.step_s = statistics.fmean(float(r["time/step_s"]) - eval_wait(r)
                                      for r in steady if "time/step_s" in r) if any(
            "time/step_s" in r for r in steady) else None
        keys = sorted({k for r in steady for k in r if k.startswith("time/") and not k.startswith("time/eval")
                       and k not in ("time/elapsed_s", "time/step_s", *EVAL_WAITS)})
        run.parts = {k[5:]: statistics.fmean(float(r.get(k, 0.0)) for r in steady) for k in keys}
        run.engine_busy = engine_busy(steady)
        rest = (run.step_s or 0.0) - sum(run.parts.values())
        if run.step_s is not None and rest > 0.0005:  # flashrl: waiting for rollouts (generation not hidden)
            run.parts["rest"] = rest
    if evals:
        run.first_acc, run.final_acc = evals[0][1], evals[-1][1]
        run.best_acc = max(a for _, a, _ in evals)
    run.time_to = {}
    for thr in THRESHOLDS:
        hit = next(((s, t) for s, a, t in evals if a >= thr - 1e-9), None)
        run.time_to[f"{thr:.0%}"] = {
            "step": hit[0] if hit else None,
            "train_s": hit[1] if hit else None,
            "process_s": hit[1] + run.startup_s if hit and run.startup_s is not None else None,
        }
    after = [a for s, a, _ in evals if run.time_to["80%"]["step"] is not None and s >= run.time_to["80%"]["step"]]
    if after:
        best, dip = after[0], 0.0
        for a in after:
            best = max(best, a)
            dip = max(dip, best - a)
        run.worst_dip, run.min_after_80 = dip, min(after)


def seed_stats(runs: Sequence[Run], attr: str) -> tuple[float, float, float] | None:
    """(mean, min, max) of ``attr`` over ``runs`` (those that have it)."""
    xs = [getattr(r, attr) for r in runs if getattr(r, attr) is not None]
    return (statistics.fmean(xs), min(xs), max(xs)) if xs else None


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _time_to(r: Run, thr: str, which: str) -> str:
    t = r.time_to.get(thr) or {}
    if t.get("step") is None:
        return "not reached"
    v = t.get(which)
    return f"n/a (step {t['step']})" if v is None else f"{_f(v)} s (step {t['step']})"


def markdown_table(runs: Sequence[Run]) -> str:
    """One column per run; rows for everything the bench reports."""
    cols = [f"{r.mode} seed {r.seed}" for r in runs]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(runs)]

    def row(label: str, cells: Sequence[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for thr in (f"{t:.0%}" for t in THRESHOLDS):
        row(f"time to {thr} held-out (training clock)", [_time_to(r, thr, "train_s") for r in runs])
    for thr in (f"{t:.0%}" for t in THRESHOLDS):
        row(f"time to {thr} (whole process)", [_time_to(r, thr, "process_s") for r in runs])
    row("start-up (launch -> first step starts)", ["n/a" if r.startup_s is None else f"{r.startup_s:.1f} s" for r in runs])
    row("steps / training clock", [f"{r.steps} / {_f(r.train_s)} s" for r in runs])
    row("held-out eval waits left out of the clock", [f"{r.eval_wait_s:.1f} s" if r.mode != "trl" else "(evals between steps)"
                                                    for r in runs])
    row("trained samples/s", [_f(r.samples_per_s, "{:.0f}") for r in runs])
    row("mean step time (after step 5, eval waits out)", [_f(None if r.step_s is None else 1000 * r.step_s, "{:.0f}") + " ms" for r in runs])
    row("  of which", ["; ".join(f"{k} {1000 * v:.0f} ms" for k, v in r.parts.items()) or "n/a" for r in runs])
    row("engine thread busy: stepping + commands (mean over steps)",
        [f"{r.engine_busy['stepping']:.0%} + {r.engine_busy['commands']:.0%} = {r.engine_busy['busy']:.0%}"
         if r.engine_busy else ("n/a (one process)" if r.mode == "trl" else "n/a") for r in runs])
    row("peak memory (process tree)", [_f(r.peak_mem_gib, "{:.2f}") + " GiB" for r in runs])
    row("held-out accuracy first -> final (best)",
        [f"{_f(r.first_acc, '{:.1%}')} -> {_f(r.final_acc, '{:.1%}')} ({_f(r.best_acc, '{:.1%}')})" for r in runs])
    row("worst dip after reaching 80%", [_f(r.worst_dip, "{:.1%}") for r in runs])
    row("exit code / wall", [f"{r.returncode} / {_f(r.wall_s)} s" for r in runs])
    return "\n".join(lines) + "\n"


def _t80(r: Run, key: str) -> Any:
    """The run's first eval at >= 80%: its "step", "train_s" or "process_s" (None: never reached)."""
    return (r.time_to.get("80%") or {}).get(key)


def seeds_table(runs: Sequence[Run]) -> str:
    """Per mode, over seeds: final accuracy, time to 80%, samples/s as mean (min..max)."""
    lines = ["| mode | seeds | final held-out acc, mean (min..max) | worst dip after 80% | time to 80%, training clock | trained samples/s |",
             "|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(r.mode for r in runs):
        rs = [r for r in runs if r.mode == mode]
        fin = seed_stats(rs, "final_acc")
        dip = seed_stats(rs, "worst_dip")
        sps = seed_stats(rs, "samples_per_s")
        t80 = [_t80(r, "train_s") for r in rs]
        reached = [t for t in t80 if t is not None]
        t80s = (f"{statistics.fmean(reached):.1f} s ({min(reached):.1f}..{max(reached):.1f})" if reached else "n/a") + (
            f", {len(reached)}/{len(rs)} reached" if len(reached) < len(rs) else "")
        lines.append(
            f"| {mode} | {','.join(str(r.seed) for r in rs)} | "
            f"{'n/a' if fin is None else f'{fin[0]:.1%} ({fin[1]:.1%}..{fin[2]:.1%})'} | "
            f"{'n/a' if dip is None else f'max {dip[2]:.1%}'} | {t80s} | "
            f"{'n/a' if sps is None else f'{sps[0]:.0f} ({sps[1]:.0f}..{sps[2]:.0f})'} |")
    return "\n".join(lines) + "\n"


def mean_eval_acc(r: Run) -> float | None:
    """Mean held-out accuracy over the run's evals after step 0: how fast it learned per step, over the whole run."""
    accs = [a for step, a, _ in r.evals if step > 0]
    return statistics.fmean(accs) if accs else None


def paired_table(runs: Sequence[Run], baseline: str = "trl") -> str:
    """Each mode against ``baseline`` seed by seed, over the seeds both ran ("" if there are none).

    Means over different seed subsets mislead (a mode that misses 80% on its hardest seed gets a better mean
    time to 80%), so time to 80% is compared on the seeds both reached, with how many each side was sooner on,
    and the seeds only one reached are named."""
    base = {r.seed: r for r in runs if r.mode == baseline}
    rows: list[str] = []
    for mode in dict.fromkeys(r.mode for r in runs if r.mode != baseline):
        pairs = [(base[r.seed], r) for r in runs if r.mode == mode and r.seed in base]
        if not pairs:
            continue
        ratios = [m.samples_per_s / b.samples_per_s for b, m in pairs if m.samples_per_s and b.samples_per_s]
        ratio_s = f"{statistics.fmean(ratios):.2f} mean ({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "n/a"
        steps = ", ".join("/".join("-" if _t80(r, "step") is None else str(_t80(r, "step")) for r in pair)
                          for pair in pairs)
        both = [(_t80(b, "train_s"), _t80(m, "train_s")) for b, m in pairs
                if _t80(b, "train_s") is not None and _t80(m, "train_s") is not None]
        if both:
            sooner, later = sum(y < x for x, y in both), sum(y > x for x, y in both)
            t80s = (f"{statistics.fmean(x for x, _ in both):.1f} s vs {statistics.fmean(y for _, y in both):.1f} s "
                    f"({len(both)} seed{'s' if len(both) > 1 else ''}; {mode} sooner on {sooner}, later on {later})")
        else:
            t80s = "n/a (no seed both reached)"
        only_base = [str(b.seed) for b, m in pairs if _t80(b, "step") is not None and _t80(m, "step") is None]
        only_mode = [str(b.seed) for b, m in pairs if _t80(m, "step") is not None and _t80(b, "step") is None]
        only_s = "; ".join(f"{who}: seeds {', '.join(ss)}" for who, ss in ((baseline, only_base), (mode, only_mode)) if ss)
        accs = [(x, y) for x, y in ((mean_eval_acc(b), mean_eval_acc(m)) for b, m in pairs)
                if x is not None and y is not None]
        acc_s = f"{statistics.fmean(x for x, _ in accs):.1%} / {statistics.fmean(y for _, y in accs):.1%}" if accs else "n/a"
        rows.append(f"| {mode} | {', '.join(str(b.seed) for b, _ in pairs)} | {ratio_s} | {steps} | {t80s} | "
                    f"{only_s or 'none'} | {acc_s} |")
    if not rows:
        return ""
    head = [f"| seed by seed against {baseline} | seeds | trained samples/s, mode / {baseline} | "
            f"80% reached at step ({baseline} / mode; - = not reached) | time to 80%, training clock, on the seeds both "
            f"reached | reached 80% only | mean held-out over the evals after step 0 ({baseline} / mode) |",
            "|---|---|---|---|---|---|---|"]
    return "\n".join(head + rows) + "\n"


DIFFERENCES = """\
What is the same: model folder (the built-in tiny model, float32, built by `ensure_model` for the seed),
train prompts and their order (flashrl's DataStream for the seed), held-out split (the env's eval
tasks) and verifier, group size, prompts per step, temperature (sampling and the loss's logprobs),
max new tokens, AdamW (lr, weight decay, betas/eps defaults), the lr schedule (warm-up, decay) per training step,
PPO clip, token-mean loss, std-scaled group advantages, no KL, grad clip 1.0, 2 optimizer steps per
training step, held-out eval every run.eval_every steps (greedy, the same tasks and verifier).

What differs:
- Process layout: TRL is one process (generation with HF `generate` and training in turn, torch
  threads = the cores); flashrl runs the controller, vLLM engines and the trainer rank as separate
  processes ([engine] / [trainer] of the config).
- Generation: TRL samples with HF `generate` (KV cache, the training weights themselves); flashrl with
  vLLM (weights copied after every step, checksum-verified).
- Off-policy: async flashrl trains on samples up to scheduler.async_ratio versions old (the loss's
  importance ratio handles it); TRL and flashrl sync are on-policy (the second optimizer step of a
  training step is one update behind, in both, against recomputed old logprobs).
- Loss: with `algorithm.loss = "decoupled_ppo"` flashrl multiplies the clipped loss by a behaviour
  importance weight min(pi_prox / pi_behav, w_max); TRL's clipped loss has none. On-policy data (TRL's,
  flashrl sync's) has weight 1, so the losses are the same there; the weight acts on async flashrl's
  stale samples only.
- Mini-batches: TRL shuffles the 128 samples before splitting them into its 2 optimizer steps;
  flashrl splits the batch in order (groups stay together) unless `trainer.shuffle = true`.
- Advantage epsilon: TRL divides by std + 1e-4, flashrl by std + 1e-6.
- Eval: flashrl evaluates on its engines beside training (the trainer goes on meanwhile); TRL's
  eval runs in its process between steps. Neither training clock counts eval time: TRL's leaves out its
  evals, flashrl's leaves out what its steps waited for an eval (`time/eval_wait_s`, its own row);
  the eval's requests still share flashrl's engine with the rollouts.
- Memory: peak resident memory of each run's process tree, sampled every 0.5 s by the bench (RSS sums
  count shared pages once per process).
- Start-up: from launch to the training clock's 0 (imports, model load, for flashrl also engine and
  trainer start-up and the first weight sync); "whole process" = start-up + training clock.
"""


def write_results(runs: Sequence[Run], out: Path, title: str, notes: str = "") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"results.{k}" for k in ("json", "csv", "md", "png")}
    paths["json"].write_text(json.dumps([asdict(r) for r in runs], indent=1))
    cols = ["mode", "seed", "returncode", "wall_s", "startup_s", "train_s", "steps", "samples", "samples_per_s",
            "peak_mem_gib", "step_s", "first_acc", "final_acc", "best_acc", "worst_dip"]
    busy_cols = ["stepping", "commands", "busy"]
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*cols, *(f"t{t:.0%}_{k}" for t in THRESHOLDS for k in ("step", "train_s", "process_s")),
                    *(f"engine_{k}" for k in busy_cols)])
        for r in runs:
            w.writerow([*(getattr(r, c) for c in cols),
                        *((r.time_to.get(f"{t:.0%}") or {}).get(k) for t in THRESHOLDS for k in ("step", "train_s", "process_s")),
                        *(r.engine_busy.get(k) for k in busy_cols)])
    md = f"# {title}\n\n{notes}" + markdown_table(runs) + "\n"
    if len({r.seed for r in runs}) > 1:
        md += "Over seeds:\n\n" + seeds_table(runs) + "\n"
    paired = paired_table(runs)
    if paired:
        md += "Seed by seed:\n\n" + paired + "\n"
    if any(r.mode == "trl" for r in runs):
        md += DIFFERENCES
    paths["md"].write_text(md)
    plot(runs, paths["png"])
    return paths


def plot(runs: Sequence[Run], path: Path) -> None:
    """Held-out accuracy against the training clock and against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"trl": "tab:orange", "async": "tab:blue", "sync": "tab:green"}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r.seed for r in runs})
    for r in runs:
        if not r.evals:
            continue
        style = styles[seeds.index(r.seed) % len(styles)]
        label = f"{r.mode} seed {r.seed}"
        ax_t.plot([t for _, _, t in r.evals], [a for _, a, _ in r.evals], style, color=colors.get(r.mode), marker="o",
                  ms=2, label=label)
        ax_s.plot([s for s, _, _ in r.evals], [a for _, a, _ in r.evals], style, color=colors.get(r.mode), marker="o",
                  ms=2, label=label)
    ax_t.set(title="held-out accuracy vs training clock", xlabel="seconds", ylabel="eval/accuracy")
    ax_s.set(title="held-out accuracy vs step", xlabel="step", ylabel="eval/accuracy")
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3)
        for thr in THRESHOLDS:
            ax.axhline(thr, color="gray", lw=0.5, ls=":")
    ax_s.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- running the children
class _Watch:
    """Time-stamps metrics.jsonl lines as they appear and samples the child tree's resident memory."""

    def __init__(self, pid: int, metrics: Path, t0: float, interval_s: float = 0.5) -> None:
        self.pid, self.metrics, self.t0, self.interval_s = pid, metrics, t0, interval_s
        self.appeared: list[tuple[float, float]] = []  # (seconds after launch, time/elapsed_s)
        self.peak = 0
        self._pos = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="peers-watch")

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll_lines()

    def _poll_lines(self) -> None:
        now = time.monotonic() - self.t0
        try:
            with self.metrics.open() as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind("\n")
        if end < 0:
            return
        self._pos += len(chunk[: end + 1].encode())
        for line in chunk[: end + 1].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and int(rec.get("step", 0)) >= 1 and "time/elapsed_s" in rec:
                self.appeared.append((now, float(rec["time/elapsed_s"])))

    def _sample_mem(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_mem()
            self._poll_lines()


def _flashrl_cmd() -> list[str]:
    script = Path(sys.executable).parent / "flashrl"
    if script.exists():
        return [str(script)]
    found = shutil.which("flashrl")
    return [found] if found else [sys.executable, "-m", "flashrl.cli"]


def child_command(mode: str, config: str | Path, seed: int, steps: int | None, run_dir: Path,
                  extra_sets: Sequence[str] = ()) -> list[str]:
    """The command line of one run; its metrics land in ``run_dir``/metrics.jsonl."""
    sets = [f"run.seed={seed}", *extra_sets]
    if steps is not None:
        sets.append(f"run.steps={steps}")
    if mode == "trl":
        return [sys.executable, "-m", "flashrl.benchmarks.peers", "trl", str(config), "--out", str(run_dir),
                *(a for s in sets for a in ("--set", s))]
    if mode not in ("async", "sync"):
        raise ValueError(f"mode {mode!r}: give one of {MODES}")
    sets += [f"run.name={run_dir.name}", f"run.output_dir={run_dir.parent}", "run.dashboard=plain"]
    if mode == "sync":
        sets += list(SYNC_SETS)
    return [*_flashrl_cmd(), "run", str(config), *(a for s in sets for a in ("--set", s))]


def run_one(mode: str, config: str | Path, seed: int, steps: int | None, out: Path,
            extra_sets: Sequence[str] = (), timeout_s: float | None = None) -> Run:
    name = f"{mode}-seed{seed}"
    run_dir, log = out / "runs" / name, out / "logs" / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = child_command(mode, config, seed, steps, run_dir, extra_sets)
    run = Run(mode=mode, seed=seed, name=name, log=str(log))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        with _Watch(proc.pid, run_dir / "metrics.jsonl", t0) as watch:
            try:
                run.returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                run.returncode = -9
                f.write(f"\nbench: stopped after {timeout_s} s\n")
        run.wall_s = time.monotonic() - t0
    run.peak_mem_gib = watch.peak / 2**30 if watch.peak else None
    run.startup_s = startup_offset(watch.appeared)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        summarize(run, read_metrics(metrics))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps(asdict(run), indent=1))
    print(f"[bench] {name}: rc={run.returncode} wall {run.wall_s:.0f}s, {run.steps} steps, final acc "
          f"{_f(run.final_acc, '{:.3f}')}, {_f(run.samples_per_s, '{:.0f}')} samples/s", flush=True)
    return run


RUN_FILE = "bench_run.json"  # in each run's folder: what the bench measured of it (--resume reads it back)


def _kept(out: Path, mode: str, seed: int, steps: int | None, any_exit: bool = False) -> Run | None:
    """A run of an earlier invocation with the same output folder that exited 0 (``--resume``), else None."""
    try:
        data = json.loads((out / "runs" / f"{mode}-seed{seed}" / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    run = Run(**{k: v for k, v in data.items() if k in Run.__dataclass_fields__})
    run.evals = [tuple(e) for e in run.evals]  # type: ignore[misc]
    if not any_exit and (run.returncode != 0 or (steps is not None and run.steps < steps)):
        return None
    return run


def _recovered(out: Path, mode: str, seed: int) -> Run | None:
    """A run whose bench process died after it (no bench_run.json) but whose metrics.jsonl is there: its numbers
    from the metrics alone (``--report-only``); start-up unknown, peak memory from flashrl's own ``mem/total_gib``."""
    name = f"{mode}-seed{seed}"
    metrics = out / "runs" / name / "metrics.jsonl"
    if not metrics.exists():
        return None
    recs = read_metrics(metrics)
    run = Run(mode=mode, seed=seed, name=name, log=str(out / "logs" / f"{name}.log"))
    mem = [float(r["mem/total_gib"]) for r in recs if "mem/total_gib" in r]
    run.peak_mem_gib = max(mem) if mem else None
    summarize(run, recs)
    return run


def run_bench(modes: Sequence[str], seeds: Sequence[int], out: str | Path, config: str | Path = "configs/tiny.toml",
              steps: int | None = None, extra_sets: Sequence[str] = (), timeout_s: float | None = None,
              title: str = "flashrl vs TRL GRPOTrainer", sync_seeds: Sequence[int] | None = None,
              resume: bool = False, report_only: bool = False) -> list[Run]:
    """Every (seed, mode) run in turn (sync only for ``sync_seeds``, default all); results files after each.

    ``resume``: a run that an earlier invocation into ``out`` completed (exit 0, ``steps`` steps) is kept,
    not run again, so a long bench can be run one piece at a time and assembled by a last invocation."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes {','.join(modes)}: give a comma-separated subset of {','.join(MODES)}")
    out = Path(out)
    runs = []
    for seed in seeds:
        for mode in modes:
            if mode == "sync" and sync_seeds is not None and seed not in sync_seeds:
                continue
            if report_only:  # assemble what is there; run nothing
                got = _kept(out, mode, seed, None, any_exit=True) or _recovered(out, mode, seed)
                if got is not None:
                    runs.append(got)
                continue
            kept = _kept(out, mode, seed, steps) if resume else None
            if kept is not None:
                print(f"[bench] {kept.name}: kept (completed earlier)", flush=True)
                runs.append(kept)
            else:
                runs.append(run_one(mode, config, seed, steps, out, extra_sets, timeout_s))
            if not report_only:
                write_results(runs, out, title, _notes(config, steps, extra_sets))  # partial results survive a crash
    if report_only:
        write_results(runs, out, title, _notes(config, steps, extra_sets))
    return runs


def _notes(config: str | Path, steps: int | None, extra_sets: Sequence[str]) -> str:
    sets = " ".join(f"--set {s}" for s in extra_sets)
    return (f"Config `{config}`{f' with {sets}' if sets else ''}{f', run.steps={steps}' if steps else ''}; "
            f"runs one after another on this machine ({os.cpu_count()} cores). Modes: "
            + "; ".join(f"{m} = {MODE_LABEL[m]}" for m in MODES) + ".\n\n")


# --------------------------------------------------------------------------- the TRL peer
def trl_settings(cfg: Any) -> dict[str, Any]:
    """GRPOConfig keyword arguments equivalent to ``cfg`` (PeerConfigError for what TRL cannot reproduce)."""
    ro, tr, alg = cfg.rollout, cfg.trainer, cfg.algorithm
    problems = []
    if ro.max_turns != 1:
        problems.append(f"rollout.max_turns = {ro.max_turns} (the TRL peer is single-turn; set 1)")
    # decoupled_ppo = the clipped loss x a behaviour importance weight min(pi_prox / pi_behav, w_max). TRL
    # samples with its training weights and recomputes old logprobs at the step's start, so on its
    # on-policy data that weight is 1: the same loss as TRL's clipped one (it differs on stale samples only).
    if alg.loss not in ("ppo", "grpo", "decoupled_ppo"):
        problems.append(f"algorithm.loss = {alg.loss!r} (the TRL peer runs the clipped PPO/GRPO loss; set 'ppo' "
                        "or 'decoupled_ppo')")
    if alg.loss_agg != "token-mean":
        problems.append(f"algorithm.loss_agg = {alg.loss_agg!r} (the TRL peer maps only 'token-mean')")
    for key, val in (("entropy_coef", alg.entropy_coef), ("dual_clip", alg.dual_clip)):
        if val:
            problems.append(f"algorithm.{key} = {val} (no TRL equivalent; set 0)")
    if alg.filter_ties:
        problems.append("algorithm.filter_ties = true (no TRL equivalent; set false)")
    if ro.redundancy:
        problems.append(f"rollout.redundancy = {ro.redundancy} (no TRL equivalent; set 0)")
    batch = ro.group_size * ro.batch_prompts
    if batch % tr.mini_batches:
        problems.append(f"trainer.mini_batches = {tr.mini_batches} must divide group_size x batch_prompts = {batch}")
    if problems:
        raise PeerConfigError("the TRL peer cannot reproduce: " + "; ".join(problems))
    return dict(
        num_generations=ro.group_size,
        per_device_train_batch_size=batch // tr.mini_batches,
        gradient_accumulation_steps=1,
        steps_per_generation=tr.mini_batches,
        num_iterations=1,
        max_completion_length=ro.max_new_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=0,
        learning_rate=tr.lr,
        weight_decay=tr.weight_decay,
        max_grad_norm=tr.grad_clip if tr.grad_clip > 0 else 1e9,
        epsilon=alg.eps_low,
        epsilon_high=alg.eps_high,
        beta=alg.kl_coef,
        loss_type="dapo",
        scale_rewards="group" if alg.scale_std else "none",
        max_steps=cfg.run.steps * tr.mini_batches,
        shuffle_dataset=False,
        seed=cfg.run.seed,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def train_prompts(cfg: Any, suite: Any, n: int) -> list[Any]:
    """The first ``n`` train tasks in the order flashrl's controller hands them out for ``cfg.run.seed``."""
    from flashrl.controller.scheduler import DataStream

    stream = DataStream(suite.train_tasks(), cfg.run.seed)
    return [stream.next()[1] for _ in range(n)]


def run_trl(config: str | Path, overrides: Sequence[str], out: str | Path, threads: int | None = None) -> dict[str, Any]:
    """Train the config's model with TRL's GRPOTrainer; write OUT/metrics.jsonl (flashrl's keys) and summary.json."""
    import asyncio
    import random

    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl import GRPOConfig, GRPOTrainer

    from flashrl.config import load
    from flashrl.core.schedule import scheduled_lr
    from flashrl.models import ensure_model
    from flashrl.models.tiny import greedy_accuracy
    from flashrl.plugins import make_suite

    cfg = load(config, list(overrides))
    settings = trl_settings(cfg)
    if cfg.env.name != "arithmetic":
        raise PeerConfigError(f"env.name = {cfg.env.name!r}: the TRL peer scores with the arithmetic verifier; use 'arithmetic'")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(cfg)
    suite = make_suite(cfg.env.name, {k: v for k, v in cfg.env.params.items() if k != "faults"}, seed=cfg.run.seed,
                       eval_size=cfg.env.eval_size)
    eval_tasks = list(suite.eval_tasks())
    mb, steps = cfg.trainer.mini_batches, cfg.run.steps
    tasks = train_prompts(cfg, suite, steps * cfg.rollout.batch_prompts)
    # One dataset row per prompt, in order; TRL repeats each num_generations times (shuffle off).
    data = Dataset.from_dict({"prompt": [t.prompt for t in tasks], "task": list(range(len(tasks)))})
    env = suite.make_env()

    def correct(prompts: list[str], completions: list[str], task: list[int], **_: Any) -> list[float | None]:
        async def score() -> list[float | None]:  # the env's own verifier, as flashrl's rollouts score
            rewards: list[float | None] = []
            for c, i in zip(completions, task):
                await env.reset(tasks[i])
                rewards.append(float((await env.step(c)).reward))
            return rewards

        return asyncio.run(score())

    # transformers' tokenizer (TRL's processing_class; the eval's prompts and decoding), as flashrl's engines load it
    hf_tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    # flashrl's schedule, by training step (mb optimizer steps each)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: scheduled_lr(cfg.trainer, steps, k // mb) / cfg.trainer.lr)
    metrics = (out / "metrics.jsonl").open("w")
    times: dict[str, Any] = {"eval_s": 0.0, "gen_s": 0.0, "step_gen_s": 0.0, "t_step": 0.0, "t0": 0.0, "step_s": 0.0,
                             "lr": 0.0}

    def evaluate(step: int, rec: dict[str, Any]) -> None:
        t = time.perf_counter()
        was = model.training
        model.eval()
        with torch.no_grad():
            acc = greedy_accuracy(model, hf_tok, eval_tasks, cfg.rollout.max_new_tokens)
        model.train(was)
        dt = time.perf_counter() - t
        times["eval_s"] += dt
        rec.update({"eval/accuracy": acc, "time/eval_s": dt})

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:  # generation + reward + old logprobs
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                times["step_gen_s"] += time.perf_counter() - t

    class Clock(TrainerCallback):
        trainer: GRPOTrainer | None = None

        def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
            rec: dict[str, Any] = {"step": 0, "version": 0}
            evaluate(0, rec)
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            times["t0"] = time.perf_counter()
            times["eval_s"] = 0.0

        def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                         **kwargs: Any) -> None:
            if state.global_step % mb == 0:
                times["t_step"] = time.perf_counter()
                times["lr"] = opt.param_groups[0]["lr"]  # what this training step's optimizer steps use

        def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
            if state.global_step % mb:
                return
            now = time.perf_counter()
            step = state.global_step // mb
            gen, step_s = times["step_gen_s"], now - times["t_step"]
            times["step_gen_s"] = 0.0
            rec = {"step": step, "version": step, "samples": mb * args.per_device_train_batch_size,
                   "time/step_s": step_s, "time/generate_s": gen, "time/train_s": step_s - gen,
                   "time/elapsed_s": now - times["t0"] - times["eval_s"],
                   "lr": times["lr"]}
            rewards = self.trainer._metrics["train"].get("reward") if self.trainer is not None else None
            if rewards:
                rec["reward/mean"] = rewards[-1]
            if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == steps:
                evaluate(step, rec)
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()

    clock = Clock()
    trainer = Timed(model=model, reward_funcs=[correct], args=GRPOConfig(output_dir=str(out / "trl"), **settings),
                    train_dataset=data, processing_class=hf_tok, optimizers=(opt, sched), callbacks=[clock])
    clock.trainer = trainer
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    metrics.close()
    import resource

    changed = math.sqrt(sum(float((p.detach() - q).pow(2).sum()) for p, q in zip(model.parameters(), start)))
    summary = {"steps": steps, "optimizer_steps": trainer.state.global_step, "weights_changed_l2": changed,
               "train_wall_s": round(wall, 2), "eval_s": round(times["eval_s"], 2),
               "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
               "threads": torch.get_num_threads(), "settings": settings, "model": str(model_dir)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    shutil.rmtree(out / "trl", ignore_errors=True)
    return summary


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None, *, seeds_mode: bool = False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "trl":  # the TRL child: python -m flashrl.benchmarks.peers trl CONFIG --out DIR
        ap = argparse.ArgumentParser(prog="flashrl.benchmarks.peers trl")
        ap.add_argument("config")
        ap.add_argument("--out", required=True)
        ap.add_argument("--set", dest="sets", action="append", default=[])
        ap.add_argument("--threads", type=int, default=None)
        a = ap.parse_args(argv[1:])
        try:
            run_trl(a.config, a.sets, a.out, a.threads)
        except PeerConfigError as e:
            print(f"flashrl bench peers: {e}", file=sys.stderr)
            return 2
        return 0
    prog = "flashrl bench seeds" if seeds_mode else "flashrl bench peers"
    ap = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--modes", default="async" if seeds_mode else ",".join(MODES),
                    help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--seeds", default="0,1,2" if seeds_mode else "0", help="comma-separated run.seed values")
    ap.add_argument("--steps", type=int, default=None, help="run.steps for every run (default: the config's)")
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for every run")
    ap.add_argument("--out", default="bench/results/seeds" if seeds_mode else "bench/results/peers")
    ap.add_argument("--sync-seeds", default=None,
                    help="the seeds of the sync mode's runs (default: the first of --seeds; 'all' = every seed)")
    ap.add_argument("--timeout-s", type=float, default=None, help="stop a run after this many seconds")
    ap.add_argument("--resume", action="store_true", help="keep the runs in --out that an earlier invocation completed")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: write the results files from the runs already in --out")
    a = ap.parse_args(argv)
    title = "flashrl over seeds" if seeds_mode else "flashrl vs TRL GRPOTrainer"
    seeds = [int(s) for s in a.seeds.split(",") if s]
    sync_seeds = seeds if a.sync_seeds == "all" else (
        [int(s) for s in a.sync_seeds.split(",") if s] if a.sync_seeds else seeds[:1])
    try:
        runs = run_bench([m for m in a.modes.split(",") if m], seeds, a.out, a.config, a.steps, a.sets, a.timeout_s,
                         title=title, sync_seeds=sync_seeds, resume=a.resume, report_only=a.report_only)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(Path(a.out, "results.md").read_text())
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
