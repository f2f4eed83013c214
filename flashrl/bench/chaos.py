"""``flashrl bench chaos [CONFIG]``: a training run under repeated failures, and the proof it lost nothing.

    flashrl run CONFIG --set engine.count=2 (segment 1, FLASHRL_PARENT_PID = this process: it dies with the bench)
      every --kill-every s after the first step: SIGKILL one engine process, engine0 / engine1 / ...
        in turn (only an engine that is serving: one the controller has reported back), and the
        --sync-kill-th kill lands inside a weight sync: the engine's own fault hook
        (FLASHRL_FAULT_KILL_IN_SYNC, a marker file kept present = disarmed; deleting it arms the hook,
        the engine SIGKILLs its own process group in its next weight receive and re-creates the marker)
      at --controller-kill-after s (once a checkpoint exists): SIGKILL `flashrl run` itself; count the
        processes it started that are still alive 30 s later (promised: none)
    flashrl run CONFIG --resume (segment 2): engine kills go on until the run ends (run.max_time_s)
    -> OUT/report.json, OUT/report.md, OUT/run/ (metrics.jsonl, the segment-1 records, summary.json,
       controller logs, the final checkpoint's controller.json; the weights are not kept)

What the report shows and how it is checked: chaos_report.py (pure functions of the records).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashrl.bench.chaos_report import MIN_GAIN_POINTS, analyze, markdown
from flashrl.engine.server import EngineSpec
from flashrl.wire.spec import spec_in

FAULT_ENV = "FLASHRL_FAULT_KILL_IN_SYNC"
SURVIVOR_WAIT_S = 30.0
_BACK_RE = re.compile(r"engine (\S+) is back at version (\d+) after ([\d.]+) s")
_RESUME_RE = re.compile(r"resuming from (\S+) \(step (\d+)\)")


class _Tail:
    """New lines of a file that may be replaced (resume rewrites metrics.jsonl) or appended to."""

    def __init__(self, path: Path, skip_ino: int | None = None) -> None:
        self.path = path
        self.pos = 0
        self.ino: int | None = None
        self.skip_ino = skip_ino  # ignore the file while it is still this one (before a resume replaces it)
        self.buf = ""

    def lines(self) -> list[str]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino == self.skip_ino:
            return []
        if st.st_ino != self.ino or st.st_size < self.pos:
            self.ino, self.pos, self.buf = st.st_ino, 0, ""
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            fh.seek(self.pos)
            data = fh.read()
            self.pos = fh.tell()
        data = self.buf + data
        parts = data.split("\n")
        self.buf = parts.pop()
        return [p for p in parts if p.strip()]


def _children(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: Sequence[Any]) -> list[Any]:
    import psutil

    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _engine_pid(run_pid: int, name: str) -> int | None:
    import psutil

    for p in _children(run_pid):
        with contextlib.suppress(psutil.Error):
            spec = spec_in(p.environ(), EngineSpec)
            if spec is not None and spec.name == name and "flashrl.engine.server" in p.cmdline():
                return int(p.pid)
    return None


class Chaos:
    def __init__(self, config: str, out: Path, *, kill_every: float, controller_kill_after: float,
                 sync_kill: int, sets: Sequence[str], timeout_s: float, engine_kills: int = -1,
                 min_gain: float = MIN_GAIN_POINTS, end_after: float | None = None) -> None:
        from flashrl.config import load

        self.config = config
        self.out = out
        self.kill_every = kill_every
        self.controller_kill_after = controller_kill_after
        self.sync_kill = sync_kill
        self.engine_kills = engine_kills
        self.min_gain = min_gain
        self.end_after = end_after
        self.stopped_by_bench = False
        self.timeout_s = timeout_s
        self.sets = ["--set", f"run.output_dir={out}", "--set", "run.name=run", "--set", "run.dashboard=plain"]
        for s in sets:
            self.sets += ["--set", s]
        self.cfg = load(config, [s for i, s in enumerate(self.sets) if i % 2 == 1])
        self.run_dir = self.cfg.run_dir
        self.engines = [f"engine{i}" for i in range(self.cfg.engine.count)]
        self.marker = out / "sync-fault.marker"
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.step_times: list[tuple[float, int, int]] = []
        self.segments: list[dict[str, Any]] = []
        self.last_step = 0
        self.seen: set[int] = set()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def say(self, msg: str) -> None:
        print(f"[chaos {self.now():7.1f}s] {msg}", flush=True)

    def launch(self, seg: int, resume: bool) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "flashrl.cli", "run", self.config, *self.sets, *(["--resume"] if resume else [])]
        env = dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid()),
                   **{FAULT_ENV: f"{self.engines[max(self.sync_kill, 0) % len(self.engines)]}@1@{self.marker}"})
        env.setdefault("OMP_NUM_THREADS", "1")
        self.say(f"segment {seg}: {' '.join(cmd[2:])}")
        metrics = self.run_dir / "metrics.jsonl"
        ino, kept = None, 0
        if resume:
            # The resumed run cuts metrics.jsonl back to the checkpoint's metrics_through (a new file, os.replace):
            # lines of the old file are not steps of this segment, and the kept ones (<= kept) are not new.
            from flashrl.checkpoint import read_latest

            latest = read_latest(self.run_dir / "checkpoints")
            assert latest is not None
            kept = int(json.loads((latest / "controller.json").read_text())["metrics_through"])
            ino = metrics.stat().st_ino if metrics.exists() else None
        log = open(self.out / f"segment{seg}.out", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.segments.append({"segment": seg, "launch_t": self.now(), "first_step_t": None, "end_t": None})
        self.seen = set(range(kept + 1)) if resume else set()
        self.metrics = _Tail(metrics, skip_ino=ino)
        self.clog = _Tail(self.run_dir / "logs" / "controller.log")
        if resume:
            self.clog.lines()  # segment 1's lines (the log is appended to)
        return p

    def poll(self, seg: int, back: dict[str, float]) -> None:
        for line in self.metrics.lines():
            try:
                step = int(json.loads(line).get("step", -1))
            except ValueError:
                continue
            if step >= 1 and step not in self.seen:
                self.seen.add(step)
                self.step_times.append((self.now(), step, seg))
                self.last_step = step
                if self.segments[-1]["first_step_t"] is None:
                    self.segments[-1]["first_step_t"] = self.now()
        for line in self.clog.lines():
            m = _BACK_RE.search(line)
            if m:
                back[m.group(1)] = self.now()
                for e in reversed(self.events):
                    if e.get("target") == m.group(1) and e.get("back_t") is None and e["segment"] == seg:
                        e.update(back_t=self.now(), back_version=int(m.group(2)), controller_down_s=float(m.group(3)))
                        break

    def kill_engine(self, seg: int, name: str, in_sync: bool, proc: subprocess.Popen[bytes]) -> bool:
        ev = {"segment": seg, "target": name, "step": self.last_step, "back_t": None}
        if in_sync:
            self.marker.unlink(missing_ok=True)  # armed: the engine kills itself in its next weight receive
            armed = self.now()
            deadline = time.monotonic() + 60
            while not self.marker.exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    self.marker.touch()
                    self.say(f"{name}: the in-sync fault did not fire within 60 s of arming; disarmed")
                    return False
                time.sleep(0.05)
            ev.update(kind="engine_kill_in_sync", t=self.now(), armed_t=armed)
        else:
            pid = _engine_pid(proc.pid, name)
            if pid is None:
                return False
            os.kill(pid, signal.SIGKILL)
            ev.update(kind="engine_kill", t=self.now(), pid=pid)
        self.events.append(ev)
        self.say(f"SIGKILL {name}{' inside a weight sync' if in_sync else ''} at step {self.last_step}")
        return True

    def kill_controller(self, seg: int, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        tree = _children(proc.pid)
        ev: dict[str, Any] = {"segment": seg, "kind": "controller_kill", "target": "flashrl run", "step": self.last_step,
                              "t": self.now(), "processes": len(tree)}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        self.say(f"SIGKILL flashrl run (pid {proc.pid}, {len(tree)} processes under it) at step {self.last_step}")
        deadline = time.monotonic() + SURVIVOR_WAIT_S
        while time.monotonic() < deadline and _alive(tree):
            time.sleep(0.25)
        left = _alive(tree)
        ev["all_gone_s"] = round(self.now() - ev["t"], 1) if not left else None
        ev["survivors_after_30s"] = len(left)
        for p in left:  # the run broke its promise; do not let them spoil what follows
            with contextlib.suppress(Exception):
                p.kill()
        self.events.append(ev)
        self.say(f"processes of the killed run still alive after {SURVIVOR_WAIT_S:.0f} s: {len(left)}")
        return ev

    def run(self) -> dict[str, Any]:
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        self.marker.touch()  # disarmed
        seg = 1
        proc = self.launch(seg, resume=False)
        back: dict[str, float] = {}
        down: set[str] = set()
        kills = 0
        next_kill: float | None = None
        ctl_kill_at: float | None = None
        ctl_event: dict[str, Any] | None = None
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                time.sleep(0.25)
                self.poll(seg, back)
                for name in list(down):
                    if name in back:
                        down.discard(name)
                        back.pop(name)
                if proc.poll() is not None:
                    self.segments[-1]["end_t"] = self.now()
                    if seg == 1:
                        raise RuntimeError(f"flashrl run exited with {proc.returncode} before the controller kill "
                                           f"(see {self.out / 'segment1.out'})")
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the chaos run took over {self.timeout_s:.0f} s")
                first = self.segments[-1]["first_step_t"]
                if first is None:
                    continue
                if next_kill is None:
                    next_kill = first + self.kill_every
                    if seg == 1:
                        ctl_kill_at = first + self.controller_kill_after
                now = self.now()
                # one failure at a time (each one's cost is measured alone): once the controller kill is
                # due, no engine is killed; it happens when every engine is back and a checkpoint exists
                ctl_due = seg == 1 and ctl_kill_at is not None and now >= ctl_kill_at
                if (self.end_after is not None and seg == 2 and kills == self.engine_kills and not down
                        and now - max([e.get("back_t") or e["t"] for e in self.events] + [first]) >= self.end_after):
                    # every planned failure happened and was recovered from: stop the run the orderly way
                    # (SIGTERM: finish the step, checkpoint, exit 130)
                    self.say(f"every planned failure done and recovered; SIGTERM to flashrl run at step {self.last_step}")
                    self.stopped_by_bench = True
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
                    continue
                # ... and a step record written after the last engine came back (its counters show the restart)
                last_back = max([e.get("back_t") or 0.0 for e in self.events] + [0.0])
                recorded = bool(self.step_times) and self.step_times[-1][0] > last_back + 1.0
                if ctl_due and not down and recorded and (self.run_dir / "checkpoints" / "latest").exists():
                    self.segments[-1]["end_t"] = now
                    ctl_event = self.kill_controller(seg, proc)
                    shutil.copy(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.segment1.jsonl")
                    seg = 2
                    proc = self.launch(seg, resume=True)
                    ctl_event["relaunch_t"] = self.now()
                    back.clear()
                    down.clear()
                    next_kill = None
                    continue
                if now >= next_kill and kills != self.engine_kills and not ctl_due:
                    name = self.engines[kills % len(self.engines)]
                    if name in down:
                        continue  # not back yet: the kill waits for it
                    if self.kill_engine(seg, name, kills == self.sync_kill, proc):
                        down.add(name)
                        kills += 1
                    next_kill = self.now() + self.kill_every
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.say(f"segment {seg} ended: exit {proc.returncode}")
        return self.report(proc.returncode)

    def report(self, exit_code: int | None) -> dict[str, Any]:
        from flashrl.checkpoint import read_latest, read_rollouts

        def rows(path: Path) -> list[dict[str, Any]]:
            if not path.exists():
                return []
            return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

        rd = self.run_dir
        latest = read_latest(rd / "checkpoints")
        final_state = json.loads((latest / "controller.json").read_text()) if latest else {}
        if latest and final_state.get("rollouts_file"):
            # partial mode: the groups saved with their rollouts are outstanding too (restored, not re-admitted)
            snap = read_rollouts(latest / final_state["rollouts_file"], int(final_state["version"]))
            final_state["rollout_groups"] = [g.uid for g in snap.groups]
        (rd / "final_controller.json").write_text(json.dumps(final_state, indent=1) + "\n")
        summary = json.loads((rd / "summary.json").read_text()) if (rd / "summary.json").exists() else {}
        log_text = (rd / "logs" / "controller.log").read_text() if (rd / "logs" / "controller.log").exists() else ""
        m = _RESUME_RE.search(log_text)
        resumed_from = int(m.group(2)) if m else summary.get("resumed_from")
        rep = analyze(rows=rows(rd / "metrics.jsonl"), seg1_rows=rows(rd / "metrics.segment1.jsonl"),
                      final_state=final_state, events=self.events, step_times=self.step_times,
                      segments=self.segments, logs=[log_text], summary=summary, resumed_from=resumed_from,
                      exit_code=exit_code, min_gain=self.min_gain, stopped_by_bench=self.stopped_by_bench)
        rep["segments"] = self.segments
        rep["wall_s"] = self.now()
        rep["config"] = self.config
        # keep the records, not the weights
        self.marker.unlink(missing_ok=True)
        shutil.copy(rd / "logs" / "controller.log", rd / "controller.log")
        for sub in ("checkpoints", "logs", "final", "tensorboard"):
            shutil.rmtree(rd / sub, ignore_errors=True)
        for p in rd.glob("samples*.jsonl"):
            p.unlink()
        return rep


def run_chaos(config: str, out: str | Path, command: str, *, kill_every: float = 60.0,
              controller_kill_after: float = 150.0, sync_kill: int = 1, engine_kills: int = -1,
              min_gain: float = MIN_GAIN_POINTS, end_after: float | None = None, sets: Sequence[str] = (),
              timeout_s: float = 1800.0) -> int:
    """``flashrl bench chaos``: the run under failures, then OUT/report.json and report.md (``command`` is the
    command line the report names). Exit code 0 when the report passes, else 1."""
    out = Path(out).resolve()
    chaos = Chaos(config, out, kill_every=kill_every, controller_kill_after=controller_kill_after,
                  # two engines by default (the embedded default runs one): a killed engine's requests
                  # move to the other while it restarts; a --set engine.count=N given here wins
                  sync_kill=sync_kill, sets=["engine.count=2", *sets], timeout_s=timeout_s,
                  engine_kills=engine_kills, min_gain=min_gain, end_after=end_after)
    rep = chaos.run()
    rep["command"] = command.strip()
    (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    md = markdown(rep, rep["command"])
    (out / "report.md").write_text(md)
    print(md)
    return 0 if rep["pass"] else 1
