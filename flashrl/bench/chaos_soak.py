"""``flashrl bench chaos``: a supervised run while every kind of process it has is SIGKILLed, and the proof
that it lost nothing. The plan, the process kinds and the report: chaos_soak_report.py (pure).

    [--baseline]  flashrl run CONFIG (undisturbed, OUT/baseline; run.max_time_s = the window unless
                  --steps): its last step N is the step count of the chaos run, its last eval the bar
    flashrl run CONFIG --supervise --max-restarts 1000 (OUT/run; run.steps = N; FLASHRL_PARENT_PID = this
        process: the whole run dies with the bench)
      every 0.25 s: new metrics.jsonl lines -> OUT/chaos/steps.jsonl (every line seen, whichever
                    controller wrote it: resumes cut the file back, the history keeps what was cut)
      at each slot of the plan (seeded; the window starts at the first trained step): its kind
                    (draw_kind), the process tree under the supervisor (psutil) -> the targets by kind
                    -> SIGKILL one of that kind -> OUT/chaos/kills.jsonl; a slot with nothing of its
                    kind alive waits (the controller's slots also wait for a first checkpoint: before
                    it a restart would start over)
      after the window: no more kills; wait for the supervisor to exit (the run ends at step N)
    every process seen, and every process naming one of them as FLASHRL_PARENT_PID, still alive 30 s
    later -> OUT/chaos/exit.json ("left"); the bench kills them
    -> OUT/report.json, OUT/report.md; OUT/run keeps the records (metrics.jsonl, supervisor.log,
       config.toml, controller.log, final_controller.json), not the weights

The process kinds are found from what every run already exposes (each child runs ``python -m <its
module>`` under its parent), so the run publishes no table of its own; a launcher that starts processes
elsewhere (Ray, SLURM) is out of reach of this bench: it kills local processes only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashrl.bench.chaos import _Tail
from flashrl.bench.chaos_soak_report import (
    KIND_WAIT_S,
    ProcInfo,
    Slot,
    analyze,
    checkpoint_every,
    draw_kind,
    early_kill_step,
    load,
    markdown,
    pick,
    plan,
    redraw,
    targets,
)

SURVIVOR_WAIT_S = 30.0
POLL_S = 0.25


def _tree(root: int) -> list[ProcInfo]:
    """Every live process under ``root`` (not itself), with its command line."""
    import psutil

    out = []
    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in kids:
        with contextlib.suppress(psutil.Error):
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            out.append(ProcInfo(pid=p.pid, ppid=p.ppid(), cmdline=p.cmdline(), create_time=p.create_time()))
    return out


def _still_alive(seen: dict[int, float], parents: set[int]) -> list[dict[str, Any]]:
    """Processes of the run still alive: one seen (same pid and start time) or one whose environment names a
    seen process (or the supervisor) as its FLASHRL_PARENT_PID (one pass over /proc)."""
    import psutil

    from flashrl.procs import PARENT_ENV

    found: dict[int, dict[str, Any]] = {}
    prefix = f"{PARENT_ENV}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        with contextlib.suppress(OSError, psutil.Error, ValueError):
            named = [int(v[len(prefix):]) for v in (entry / "environ").read_bytes().split(b"\0") if v.startswith(prefix)]
            ours = bool(named) and named[0] in parents
            if not ours and pid in seen:
                ours = abs(psutil.Process(pid).create_time() - seen[pid]) < 0.01
            if ours:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    found[pid] = {"pid": pid, "cmdline": " ".join(p.cmdline())[:200]}
    return list(found.values())


class Soak:
    def __init__(self, config: str, out: Path, *, minutes: float, every: tuple[float, float], seed: int,
                 sets: Sequence[str], steps: int | None, timeout_s: float) -> None:
        self.config = config
        self.out = out
        self.minutes = minutes
        self.seed = seed
        self.slots: list[Slot] = plan(minutes, every, seed)
        self.sets = list(sets)
        self.steps = steps
        self.timeout_s = timeout_s
        self.run_dir = out / "run"
        self.t0 = time.monotonic()
        self.rng = random.Random(seed + 1)  # the draws at the slots (the plan has its own)
        self.early: dict[str, Any] = {"step": early_kill_step(seed, checkpoint_every(self.sets)), "done": False}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def say(self, msg: str) -> None:
        print(f"[chaos {self.now():7.1f}s] {msg}", flush=True)

    def _cmd(self, name: str, extra: Sequence[str], supervise: bool) -> list[str]:
        cmd = [sys.executable, "-m", "flashrl.cli", "run", self.config]
        for s in [f"run.output_dir={self.out}", f"run.name={name}", "run.dashboard=plain", *self.sets, *extra]:
            cmd += ["--set", s]
        return cmd + (["--supervise", "--max-restarts", "1000"] if supervise else [])

    def _popen(self, cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        env = dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid()))
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(log, "wb") as fh:
            return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def baseline(self) -> Path:
        """The undisturbed run (same config, seed and overrides); its folder."""
        extra = [f"run.steps={self.steps}", "run.max_time_s=0"] if self.steps else \
            ["run.steps=1000000", f"run.max_time_s={self.minutes * 60:g}"]
        cmd = self._cmd("baseline", extra, supervise=False)
        self.say(f"baseline: {' '.join(cmd[2:])}")
        p = self._popen(cmd, self.out / "baseline.out")
        try:
            code = p.wait(timeout=self.timeout_s)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if code != 0:
            raise RuntimeError(f"the baseline run exited with {code} (see {self.out / 'baseline.out'})")
        return self.out / "baseline"

    def run(self) -> int | None:
        """The chaos run; the supervisor's exit code (None: timed out, killed)."""
        extra = [f"run.steps={self.steps}", "run.max_time_s=0"] if self.steps else \
            ["run.steps=1000000", f"run.max_time_s={self.minutes * 60:g}"]
        cmd = self._cmd("run", extra, supervise=True)
        rec = self.out / "chaos"
        rec.mkdir(parents=True, exist_ok=True)
        self.say(f"chaos run: {' '.join(cmd[2:])}; {len(self.slots)} kills planned "
                 f"({sum(s.controller for s in self.slots)} of the controller) over {self.minutes:g} min")
        sup = self._popen(cmd, self.out / "run.out")
        seen: dict[int, float] = {}
        tail = _Tail(self.run_dir / "metrics.jsonl")
        steps_f, kills_f = open(rec / "steps.jsonl", "w"), open(rec / "kills.jsonl", "w")  # noqa: SIM115
        start: float | None = None
        last_step = -1
        i = 0
        kind: str | None = None  # the kind slot i kills (drawn when it is due)
        run_kinds: set[str] = set()  # every kind seen alive so far
        deadline = time.monotonic() + self.timeout_s
        code: int | None = None
        try:
            while True:
                time.sleep(POLL_S)
                for line in tail.lines():
                    with contextlib.suppress(ValueError):
                        row = json.loads(line)
                        steps_f.write(json.dumps({"t": self.now(), "row": row}) + "\n")
                        steps_f.flush()
                        last_step = max(last_step, int(row.get("step", -1)))
                        if start is None and last_step >= 1:
                            start = self.now()
                            self.say(f"first trained step: the chaos window ({self.minutes:g} min) starts")
                procs = _tree(sup.pid)
                for p in procs:
                    seen.setdefault(p.pid, p.create_time)
                alive = targets(procs, sup.pid)
                run_kinds |= {k for k, v in alive.items() if v}
                if sup.poll() is not None:
                    code = sup.returncode
                    break
                if time.monotonic() > deadline:
                    self.say(f"the run took over {self.timeout_s:.0f} s: stopping it")
                    break
                if not self.early["done"] and last_step >= self.early["step"] and alive.get("controller"):
                    self._kill_early(alive["controller"], last_step, kills_f)
                    continue
                if start is None or i >= len(self.slots) or self.now() < start + self.slots[i].t:
                    continue
                due = start + self.slots[i].t
                if kind is None:
                    kind = draw_kind(self.rng, self.slots[i], run_kinds)
                    if kind is None:
                        continue
                elif kind != "controller" and not alive.get(kind) and self.now() > due + KIND_WAIT_S:
                    kind = redraw(self.rng, alive) or kind
                ckpt = (self.run_dir / "checkpoints" / "latest").exists()
                proc = pick(self.rng, kind, alive, controller_ok=ckpt)
                if proc is None:
                    continue  # none of the kind alive now (restarting), or no checkpoint yet: the slot waits
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                ev = {"t": self.now(), "slot": i, "planned_t": round(due, 2), "kind": kind, "pid": proc.pid,
                      "step": last_step, "newest_step": newest_step(self.run_dir), "latest_step": latest_step(self.run_dir),
                      "alive": {k: len(v) for k, v in alive.items()}}
                kills_f.write(json.dumps(ev) + "\n")
                kills_f.flush()
                self.say(f"kill {i + 1}/{len(self.slots)}: SIGKILL {kind} pid {proc.pid} at step {last_step}")
                i += 1
                kind = None
        finally:
            steps_f.close()
            kills_f.close()
            if sup.poll() is None:
                sup.send_signal(signal.SIGTERM)  # the supervisor's orderly stop (checkpoint, children down)
                try:
                    sup.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    sup.kill()
                    sup.wait()
        self.say(f"the supervisor exited with {code}; {i} kills done")
        end_t = self.now()
        left = self._survivors(seen, sup.pid)
        (rec / "exit.json").write_text(json.dumps({
            "exit_code": code, "end_t": end_t, "kills_done": i, "kills_planned": len(self.slots), "left": left,
            "run_kinds": sorted(run_kinds), "early_kill": self.early,
            "window_s": round(min(self.now() - start, self.minutes * 60), 1) if start is not None else 0.0}, indent=1))
        return code

    def _kill_early(self, controllers: list[ProcInfo], last_step: int, kills_f: Any) -> None:
        """The kill before the first ``latest`` (module docstring), recorded in kills.jsonl and exit.json."""
        latest = self.run_dir / "checkpoints" / "latest"
        deleted = latest.exists()
        if deleted:  # the run got past its first checkpoint before the bench looked: take the pointer away
            latest.unlink()
        proc = self.rng.choice(controllers)
        newest = newest_step(self.run_dir)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        self.early.update(done=True, at_step=last_step, latest_deleted=deleted, pid=proc.pid)
        kills_f.write(json.dumps({"t": self.now(), "slot": "early", "kind": "controller", "pid": proc.pid,
                                  "step": last_step, "newest_step": newest, "early": True,
                                  "latest_deleted": deleted}) + "\n")
        kills_f.flush()
        self.say(f"early kill: SIGKILL controller pid {proc.pid} at step {last_step}, before the first `latest` "
                 f"({'deleted first' if deleted else 'none yet'}; newest complete checkpoint: step {newest or '-'})")

    def _survivors(self, seen: dict[int, float], sup_pid: int) -> list[dict[str, Any]]:
        end = time.monotonic() + SURVIVOR_WAIT_S
        left = _still_alive(seen, {sup_pid, *seen})
        while left and time.monotonic() < end:
            time.sleep(0.5)
            left = _still_alive(seen, {sup_pid, *seen})
        for p in left:  # the run broke its promise: do not let them spoil the host
            self.say(f"still alive {SURVIVOR_WAIT_S:.0f} s after the run: pid {p['pid']} {p['cmdline']}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p["pid"], signal.SIGKILL)
        return left

    def keep_records(self) -> None:
        """The final checkpoint's controller.json (+ the groups saved with their rollouts), the logs, what a
        fresh start set aside (set_aside.json: each checkpoints.<t> folder's complete steps); not the weights."""
        from flashrl.checkpoint import list_checkpoints, read_latest, read_rollouts

        rd = self.run_dir
        set_aside = {d.name: [n for n, _ in list_checkpoints(d)] for d in sorted(rd.glob("checkpoints.*")) if d.is_dir()}
        (rd / "set_aside.json").write_text(json.dumps(set_aside, indent=1) + "\n")
        with contextlib.suppress(Exception):  # a run that never checkpointed: the report says so
            latest = read_latest(rd / "checkpoints")
            if latest is not None:
                state = json.loads((latest / "controller.json").read_text())
                if state.get("rollouts_file"):
                    snap = read_rollouts(latest / state["rollouts_file"], int(state["version"]))
                    state["rollout_groups"] = [g.uid for g in snap.groups]
                (rd / "final_controller.json").write_text(json.dumps(state, indent=1) + "\n")
        for d in (rd, self.out / "baseline"):
            if (d / "logs" / "controller.log").exists():
                shutil.copy(d / "logs" / "controller.log", d / "controller.log")
            for name in ("checkpoints", "logs", "final", "tensorboard"):
                shutil.rmtree(d / name, ignore_errors=True)
            for aside in d.glob("checkpoints.*"):
                shutil.rmtree(aside, ignore_errors=True)
            for p in d.glob("samples*.jsonl"):
                p.unlink()


def newest_step(run_dir: Path) -> int:
    """The newest complete step-N folder of the run (0: none), with or without ``latest``."""
    from flashrl.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir / "checkpoints")
    return found[-1][0] if found else 0


def latest_step(run_dir: Path) -> int:
    """The step ``latest`` names (0: no pointer, or one that cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    return 0


def last_step(run_dir: Path) -> int:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not rows:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'}: empty; the baseline trained no step")
    return int(rows[-1]["step"])


def run_soak(config: str, out: str | Path, command: str, *, minutes: float, every: tuple[float, float], seed: int,
             baseline: bool, baseline_dir: str | None, steps: int | None, sets: Sequence[str],
             timeout_s: float | None) -> int:
    """``flashrl bench chaos``: (the baseline,) the chaos run, OUT/report.json and report.md. 0 when the
    report passes, else 1."""
    out = Path(out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # a checkpoint every 10 steps (a --set wins): a controller kill costs the steps since the last one
    sets = [f"run.seed={seed}", "run.checkpoint_every=10", *sets]
    timeout = timeout_s if timeout_s is not None else minutes * 60 * 3 + 900
    soak = Soak(config, out, minutes=minutes, every=every, seed=seed, sets=sets, steps=steps, timeout_s=timeout)
    base: Path | None = Path(baseline_dir).resolve() if baseline_dir else None
    if baseline:
        base = soak.baseline()
    if base is not None and steps is None:
        soak.steps = last_step(base)
        soak.say(f"the chaos run trains {soak.steps} steps, as the undisturbed run did")
    soak.run()  # its exit code is in OUT/chaos/exit.json, for the report
    soak.keep_records()
    rec = load(out, soak.run_dir, base, soak.steps)
    n_ctl = sum(s.controller for s in soak.slots)
    rep = analyze(rec, min_controller_kills=n_ctl)
    rep.update(command=command.strip(), config=config, seed=seed, minutes=minutes, every=list(every),
               planned={"kills": len(soak.slots), "controller": n_ctl}, baseline_dir=str(base) if base else None)
    return _write_report(out, rep)


def _write_report(out: Path, rep: dict[str, Any]) -> int:
    """OUT/report.json and report.md, the markdown printed; 0 when the report passes, else 1."""
    (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    md = markdown(rep, rep["command"])
    (out / "report.md").write_text(md)
    print(md)
    return 0 if rep["pass"] else 1


def report_again(out: str | Path, command: str, baseline_dir: str | None) -> int:
    """``flashrl bench chaos --report-only``: OUT's report computed again from its records, against
    ``baseline_dir`` when given (an undisturbed run that trained beside the chaos run, or after it); runs
    nothing. The first report's command stays in it (``command``); this one is ``report_command``."""
    out = Path(out).resolve()
    first = out / "report.json"
    if not first.exists():
        raise RuntimeError(f"{first}: not found; give the --out folder of a finished `flashrl bench chaos`")
    old = json.loads(first.read_text())
    base = Path(baseline_dir).resolve() if baseline_dir else None
    rec = load(out, out / "run", base, old["lineage"]["steps_asked"])
    rep = analyze(rec, min_controller_kills=int(old["planned"]["controller"]))
    rep.update({k: old[k] for k in ("command", "config", "seed", "minutes", "every", "planned")},
               baseline_dir=str(base) if base else None, report_command=command.strip())
    return _write_report(out, rep)
