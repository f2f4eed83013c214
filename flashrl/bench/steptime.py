"""Step profile: where every millisecond of a training step and a weight sync goes, and of start-up.

    flashrl bench steptime [--config configs/tiny.toml] [--steps 60] [--label NAME] [--set KEY=VALUE ...]
        -> flashrl run CONFIG --set run.steps=N ... (one real run: vLLM engines, trainer, controller)
        -> OUT/NAME.json (per-phase median / mean ms over the steps after --skip), OUT/NAME.md (table)
    flashrl bench steptime --compare OUT/A.json OUT/B.json   side by side, with B / A ratios

Where the numbers come from (all in the run's own records; nothing is estimated):

- metrics.jsonl, per step: the controller's ``time/step_s`` (batch to batch), ``time/train_s`` (the
  TrainStep call), ``time/weight_sync_s``; the trainer's phases ``time/trainer/*`` (batch transfer
  to tensors and advantages, proximal pass, forward, backward, optimizer, metric reductions) and
  ``step_time_s`` (the whole step inside the trainer); ``time/train/transport_s`` (the request's trip:
  controller encode, ZeroMQ, fan-out, decode, reply); the sync's parts ``time/sync/*`` (trainer gather
  and pack + checksums, the round trip, the broadcast until every engine answered, and the slowest
  engine's pause, receive, verify, load, rpc, resume); ``time/eval_wait_s`` (what the step waited for
  held-out evals; ``time/sync/quiesce_s`` in runs from before evals ran off the training path);
  ``time/sync/wait_s`` (waiting for a weight sync: with
  weight_sync.overlap the broadcast and loads run beside the next step's training and only what is
  left of them when that step is done is on the path; serial, all of them).
- CPU per process (``cpu``): every 0.5 s this bench reads the user + system CPU time of every process
  of the run's tree (psutil) and labels it by role (controller, engine, engine core, trainer, other);
  between the step ``--skip`` and the last step it reports CPU ms per step for each role and the share
  of the 2 cores it took: who competes with whom for the cores.
- start-up: log timestamps in the run folder (engine "ready in", trainer "ready", controller
  "running", the first "weights v1 loaded") against the moment this bench started ``flashrl run``.

The first ``--skip`` steps (default 5) are left out of the step statistics: they include the first
calls of every code path (lazy imports, allocator growth). Eval steps stay in (an eval runs beside
training; its cost is part of the step it overlaps). A run is one process tree on a shared machine:
compare two profiles only when taken one after the other on the same machine (``--compare``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (label, metrics.jsonl key): the rows of the table, in order; indented rows are parts of the row above
ROWS: list[tuple[str, str]] = [
    ("step (batch to batch)", "time/step_s"),
    ("  waiting for the batch", "derived/wait_s"),
    ("  train call (controller)", "time/train_s"),
    ("    request trip (encode, ZeroMQ, fan-out, reply)", "time/train/transport_s"),
    ("    trainer step", "step_time_s"),
    ("      batch: pad + advantages", "time/trainer/batch_s"),
    ("      credit (rhythm) forward", "time/trainer/credit_s"),
    ("      proximal / reference logprobs", "time/trainer/proximal_s"),
    ("      forward + loss", "time/trainer/forward_s"),
    ("      backward", "time/trainer/backward_s"),
    ("      optimizer (clip + step)", "time/trainer/optimizer_s"),
    ("      metric reductions", "time/trainer/metrics_s"),
    ("      critics", "time/trainer/critics_s"),
    ("      other", "derived/trainer_other_s"),
    ("  waiting for held-out evals", "time/eval_wait_s"),
    ("  eval quiesce (runs before evals left the training path)", "time/sync/quiesce_s"),
    ("  waiting for a weight sync (on the step's path)", "time/sync/wait_s"),
    ("  weight sync (beside the next step when weight_sync.overlap)", "time/weight_sync_s"),
    ("    prepare call", "time/sync/prepare_s"),
    ("      state dict gather", "time/sync/trainer/gather_s"),
    ("      bucket packing + checksums", "time/sync/trainer/pack_s"),
    ("    broadcast + engine load", "time/sync/send_s"),
    ("      engine pause (after the receive)", "time/sync/engine/pause_s"),
    ("      engine receive (broadcast, beside generation)", "time/sync/engine/receive_s"),
    ("      engine verify checksums (beside generation)", "time/sync/engine/verify_s"),
    ("      engine load (reload_weights)", "time/sync/engine/load_s"),
    ("      engine rpc to EngineCore", "time/sync/engine/rpc_s"),
    ("      engine resume", "time/sync/engine/resume_s"),
]
TRAINER_PHASES = [k for _, k in ROWS if k.startswith("time/trainer/")]
STARTUP = ["trainer_ready_s", "engines_ready_s", "first_rollout_s", "first_step_s"]
_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def sync_on_path(r: dict[str, Any]) -> float:
    """Seconds of a step record's weight sync on the step's path: the prepare plus the wait for a sync
    (``time/sync/wait_s``; with weight_sync.overlap the broadcast and loads ran beside training); a
    record written before that key existed synced serially: the whole ``time/weight_sync_s``."""
    if "time/sync/wait_s" in r:
        return float(r.get("time/sync/prepare_s", 0.0)) + float(r["time/sync/wait_s"])
    return float(r.get("time/weight_sync_s", 0.0))


def _derived(r: dict[str, Any]) -> dict[str, float]:
    out = dict(r)
    if "time/step_s" in r and "time/train_s" in r:
        out["derived/wait_s"] = max(0.0, r["time/step_s"] - r["time/train_s"] - sync_on_path(r)
                                    - r.get("time/sync/quiesce_s", 0.0) - r.get("time/eval_wait_s", 0.0))
    if "step_time_s" in r and any(k in r for k in TRAINER_PHASES):
        out["derived/trainer_other_s"] = max(0.0, r["step_time_s"] - sum(r.get(k, 0.0) for k in TRAINER_PHASES))
    return out


def step_stats(records: list[dict[str, Any]], skip: int) -> dict[str, dict[str, float]]:
    """Per key of ROWS: median and mean milliseconds over the training steps after ``skip``."""
    steps = [_derived(r) for r in records if "time/step_s" in r and r.get("step", 0) > skip]
    out: dict[str, dict[str, float]] = {}
    for _, key in ROWS:
        vals = [float(r[key]) for r in steps if key in r]
        if vals:
            out[key] = {"median_ms": 1000 * statistics.median(vals), "mean_ms": 1000 * statistics.fmean(vals),
                        "n": len(vals)}
    busy = engine_busy(steps)
    if busy:
        out["engine"] = busy
    return out


def engine_busy(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over the records that have them of ``engine/{stepping,commands,busy}``: the share of the wall
    time the least busy engine's thread spent stepping vLLM and running commands ({} when none has)."""
    out: dict[str, float] = {}
    for k in ("stepping", "commands", "busy"):
        vals = [float(r[f"engine/{k}"]) for r in records if f"engine/{k}" in r]
        if vals:
            out[k] = statistics.fmean(vals)
    return out


def _log_time(line: str) -> float | None:
    m = _TS.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _first(path: Path, needle: str) -> float | None:
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        if needle in line:
            t = _log_time(line)
            if t is not None:
                return t
    return None


def startup(run_dir: Path, launched: float, records: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds from launching ``flashrl run`` to: trainer ready, every engine ready, the first rollouts
    requested (the controller is running), the first training step recorded."""
    out: dict[str, float] = {}
    logs = run_dir / "logs"
    t = _first(logs / "trainer0.log", " ready: ")
    if t is not None:
        out["trainer_ready_s"] = t - launched
    engines = [_first(p, "ready in") for p in sorted(logs.glob("engine*.log"))]
    if engines and all(e is not None for e in engines):
        out["engines_ready_s"] = max(e for e in engines if e is not None) - launched
    t = _first(logs / "controller.log", "controller running")
    if t is not None:
        out["first_rollout_s"] = t - launched
    # the first step is done when its weights (version 1) are loaded
    loaded = [_first(p, "weights v1 loaded") for p in sorted(logs.glob("engine*.log"))]
    if loaded and any(x is not None for x in loaded):
        out["first_step_s"] = min(x for x in loaded if x is not None) - launched
    return out


def role_of(cmdline: list[str], name: str, parent_role: str | None) -> str:
    """A process's role in a flashrl run, from its command line (children of a role inherit it)."""
    text = " ".join(cmdline)
    if "flashrl.engine" in text:
        return "engine (server)"
    if "EngineCore" in name or "EngineCore" in text:
        return "engine (EngineCore)"
    if "flashrl.trainer" in text:
        return "trainer"
    if "flashrl.cli" in text or "bin/flashrl" in text:
        return "controller"
    if parent_role is not None:
        return parent_role if parent_role.endswith("(EngineCore)") or parent_role == "trainer" else \
            ("engine (EngineCore)" if parent_role.startswith("engine") else parent_role + " child")
    return "other"


class CpuSampler:
    """CPU seconds per role of a process tree, read every ``every`` s, counted between two step counts."""

    def __init__(self, pid: int, metrics: Path, skip: int, every: float = 0.5) -> None:
        import threading

        self.pid, self.metrics, self.skip, self.every = pid, metrics, skip, every
        self.roles: dict[int, str] = {}
        self.first: tuple[float, int, dict[int, float]] | None = None  # (time, steps, cpu per pid)
        self.last: tuple[float, int, dict[int, float]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _steps(self) -> int:
        try:
            with self.metrics.open("rb") as f:
                return sum(1 for line in f if b'"time/step_s"' in line)
        except OSError:
            return 0

    def _sample(self) -> dict[int, float]:
        import psutil

        cpu: dict[int, float] = {}
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return cpu
        for p in procs:
            try:
                if p.pid not in self.roles:
                    parent = p.ppid()
                    self.roles[p.pid] = role_of(p.cmdline(), p.name(), self.roles.get(parent))
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        return cpu

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            n = self._steps()
            if n <= self.skip:
                continue
            snap = (time.monotonic(), n, self._sample())
            if self.first is None:
                self.first = snap
            elif self.last is None or n > self.last[1]:
                self.last = snap

    def close(self) -> dict[str, Any]:
        """Per role: CPU ms per step and share of the machine's cores, over the sampled steps."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.first is None or self.last is None or self.last[1] <= self.first[1]:
            return {}
        (t0, n0, a), (t1, n1, b) = self.first, self.last
        per: dict[str, float] = {}
        for pid, v in b.items():
            role = self.roles.get(pid, "other")
            per[role] = per.get(role, 0.0) + v - a.get(pid, 0.0)
        steps, wall = n1 - n0, t1 - t0
        cores = os.cpu_count() or 1
        return {"steps": steps, "wall_s": wall, "cores": cores,
                "roles": {k: {"ms_per_step": 1000 * v / steps, "share_of_cores": v / (wall * cores)}
                          for k, v in sorted(per.items())}}


def run_profile(config: str, steps: int, label: str, out: Path, sets: list[str], skip: int,
                timeout_s: float, python_path: str | None = None) -> dict[str, Any]:
    runs = out / "runs"
    run_dir = runs / label
    cmd = [sys.executable, "-m", "flashrl.cli", "run", config]
    for s in [f"run.steps={steps}", f"run.name={label}", f"run.output_dir={runs}", "run.dashboard=plain",
              "run.checkpoint_every=0", *sets]:
        cmd += ["--set", s]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{label}.log"
    launched = time.time()
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if python_path:
        # PYTHONSAFEPATH: no process of the run (engines and trainer ranks included) puts its working
        # directory first on sys.path, so the checkout named here is what runs, not the one in the cwd
        env["PYTHONPATH"] = python_path
        env["PYTHONSAFEPATH"] = "1"
    with log.open("w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        sampler = CpuSampler(child.pid, run_dir / "metrics.jsonl", skip)
        try:
            rc = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)
            raise
        finally:
            cpu = sampler.close()
    wall = time.monotonic() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    if rc != 0 or not records:
        raise RuntimeError(f"flashrl run failed (exit {rc}); see {log}")
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    steps_done = [r for r in records if "time/step_s" in r]
    result = {
        "label": label,
        "config": config,
        "sets": sets,
        "steps": len(steps_done),
        "skip": skip,
        "command": " ".join(cmd),
        "python_path": python_path,
        "wall_s": wall,
        "train_elapsed_s": float(steps_done[-1]["time/elapsed_s"]) if steps_done else 0.0,
        "evals": evals,
        "startup_s": startup(run_dir, launched, records),
        "phases": step_stats(records, skip),
        "cpu": cpu,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / f"{label}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{label}.md").write_text(table([result]))
    return result


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one column of median ms per profile (and B / A when two), start-up rows at the end."""
    head = "| phase (median ms per step) | " + " | ".join(r["label"] for r in results)
    sep = "|---|" + "---:|" * len(results)
    if len(results) == 2:
        head += f" | {results[1]['label']} / {results[0]['label']}"
        sep += "---:|"
    lines = [head + " |", sep]
    for name, key in ROWS:
        vals = [r["phases"].get(key, {}).get("median_ms") for r in results]
        if all(v is None for v in vals):
            continue
        row = f"| {name.replace('  ', '&nbsp;&nbsp;')} | " + " | ".join(_fmt(v) for v in vals)
        if len(results) == 2:
            a, b = vals
            row += " | " + (f"{b / a:.2f}" if a and b is not None else "")
        lines.append(row + " |")
    busy = [r["phases"].get("engine") for r in results]
    if any(busy):
        row = "| engine thread busy, mean over steps: stepping + commands | " + " | ".join(
            f"{b['stepping']:.0%} + {b['commands']:.0%} = {b['busy']:.0%}" if b else "" for b in busy)
        if len(results) == 2:
            a, b = busy
            row += " | " + (f"{b['busy'] / a['busy']:.2f}" if a and b and a["busy"] else "")
        lines.append(row + " |")
    for key in STARTUP:
        vals = [r["startup_s"].get(key) for r in results]
        row = f"| start-up: {key.removesuffix('_s').replace('_', ' ')} (s) | " + " | ".join(
            "" if v is None else f"{v:.1f}" for v in vals)
        if len(results) == 2:
            a, b = vals
            row += " | " + (f"{b / a:.2f}" if a and b is not None else "")
        lines.append(row + " |")
    roles = sorted({k for r in results for k in r.get("cpu", {}).get("roles", {})})
    for role in roles:
        vals = [r.get("cpu", {}).get("roles", {}).get(role) for r in results]
        row = f"| CPU ms per step: {role} | " + " | ".join(
            "" if v is None else f"{v['ms_per_step']:.0f} ({v['share_of_cores']:.0%} of the cores)" for v in vals)
        if len(results) == 2:
            a, b = vals
            row += " | " + (f"{b['ms_per_step'] / a['ms_per_step']:.2f}" if a and b and a["ms_per_step"] else "")
        lines.append(row + " |")
    lines.append("| steps profiled (after skip) | " + " | ".join(
        str(r["phases"].get("time/step_s", {}).get("n", 0)) for r in results) + (" | |" if len(results) == 2 else " |"))
    lines.append("| training time of the run (s) | " + " | ".join(f"{r['train_elapsed_s']:.1f}" for r in results)
                 + (" | |" if len(results) == 2 else " |"))
    lines.append("| held-out accuracy, last eval | " + " | ".join(
        f"{r['evals'][-1][1]:.1%} (step {r['evals'][-1][0]})" if r["evals"] else "" for r in results)
        + (" | |" if len(results) == 2 else " |"))
    return "\n".join(lines) + "\n"
