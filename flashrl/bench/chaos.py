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

What the report shows (``analyze``, pure functions of the records, tested in tests/test_chaos.py):
  - held-out accuracy at step 0 -> the last eval (the run must gain >= ``MIN_GAIN_POINTS``);
  - every failure injected (time, target, the step it hit), the engine deaths / restarts / retried
    requests the run counted in each segment, and the time lost to each failure:
      engine kill: down time (kill -> the controller logs it back, caught up at the current version) and
        lost time = down time - steps made while it was down / the step rate while every engine was up;
      controller kill: time until the resumed run was back at the step it had reached (restart of every
        process + the steps after the checkpoint, trained again), with those parts;
  - checkpoint time (every checkpoint of both segments, from the controller logs) as a share of training
    time, and the resume time (relaunch -> first new step);
  - the prompts: every step's ``prompt_uids`` (metrics.jsonl) across both segments; no uid trained twice,
    every uid handed out (< the final checkpoint's next_uid) trained, dropped (counted, with its uid) or
    still outstanding at the end (at most (async_ratio + 1) x batch_prompts groups), per epoch of the
    train split (uid // train_size).
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

from flashrl.engine.server import EngineSpec
from flashrl.wire.spec import spec_in

MIN_GAIN_POINTS = 20.0
FAULT_ENV = "FLASHRL_FAULT_KILL_IN_SYNC"
SURVIVOR_WAIT_S = 30.0
BACK_WITHIN_S = 150.0  # an engine killed this long before its segment ended must have been back by then
_BACK_RE = re.compile(r"engine (\S+) is back at version (\d+) after ([\d.]+) s")
_CKPT_RE = re.compile(r"checkpoint (\S+) written in ([\d.]+) s")
_RESUME_RE = re.compile(r"resuming from (\S+) \(step (\d+)\)")


# --------------------------------------------------------------------------------------------- analysis
def verify_prompts(rows: Sequence[dict[str, Any]], final_state: dict[str, Any]) -> dict[str, Any]:
    """Which prompt uids the run's steps trained (``rows``: metrics.jsonl, step 1..N, each with
    ``prompt_uids``) against what the final checkpoint says was handed out (``next_uid``), still
    outstanding (``readmit``) and dropped (``dropped_uids``, or only a count in ``counters``)."""
    trained: dict[int, int] = {}  # uid -> step
    repeated: list[dict[str, int]] = []
    for r in rows:
        if int(r.get("step", 0)) < 1:
            continue
        for u in r.get("prompt_uids", []):
            u = int(u)
            if u in trained:
                repeated.append({"uid": u, "first_step": trained[u], "again_step": int(r["step"])})
            else:
                trained[u] = int(r["step"])
    next_uid = int(final_state.get("next_uid", 0))
    outstanding = {int(u) for u in final_state.get("readmit", [])}
    dropped_uids = {int(u) for u in final_state.get("dropped_uids", [])}
    counters = final_state.get("counters", {})
    dropped_count = sum(int(v) for k, v in counters.items() if k.startswith("dropped/groups_"))
    handed = set(range(next_uid))
    lost = sorted(handed - set(trained) - outstanding - dropped_uids)
    beyond = sorted(set(trained) - handed)  # trained but never handed out: a bookkeeping error
    trained_and_outstanding = sorted(set(trained) & outstanding)
    trained_and_dropped = sorted(set(trained) & dropped_uids)
    if not dropped_uids and dropped_count:
        # an older checkpoint without the uids: the unaccounted uids must be exactly the counted drops
        lost_ok = len(lost) == dropped_count
    else:
        lost_ok = not lost and len(dropped_uids) == dropped_count
    size = int(final_state.get("train_size", 0)) or max(next_uid, 1)
    epochs = []
    for e in range((next_uid + size - 1) // size if next_uid else 0):
        lo, hi = e * size, min((e + 1) * size, next_uid)
        ids = range(lo, hi)
        epochs.append({
            "epoch": e, "uids": [lo, hi - 1], "complete": hi - lo == size,
            "trained": sum(1 for u in ids if u in trained),
            "outstanding": sum(1 for u in ids if u in outstanding),
            "dropped": sum(1 for u in ids if u in dropped_uids),
        })
    return {
        "steps": len([r for r in rows if int(r.get("step", 0)) >= 1]),
        "trained_prompts": len(trained),
        "handed_out": next_uid,
        "outstanding_at_end": len(outstanding),
        "dropped": max(len(dropped_uids), dropped_count),
        "repeated": repeated,
        "lost": lost if not (not dropped_uids and dropped_count and lost_ok) else [],
        "never_handed_out_but_trained": beyond,
        "trained_and_outstanding": trained_and_outstanding,
        "trained_and_dropped": trained_and_dropped,
        "train_size": size,
        "epochs": epochs,
        "ok": (not repeated and lost_ok and not beyond and not trained_and_outstanding
               and not trained_and_dropped and next_uid > 0),
    }


def steps_contiguous(rows: Sequence[dict[str, Any]]) -> bool:
    """metrics.jsonl holds steps 0..N once each, in order."""
    steps = [int(r.get("step", -1)) for r in rows]
    return steps == list(range(len(steps)))


def accuracy(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    evals = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r]
    if not evals:
        return {"start": None, "end": None, "gain_points": None, "evals": 0}
    start, end = evals[0][1], evals[-1][1]
    return {"start": start, "start_step": evals[0][0], "end": end, "end_step": evals[-1][0],
            "best": max(a for _, a in evals), "gain_points": round(100 * (end - start), 2), "evals": len(evals)}


def _intervals_union(iv: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _steps_in(times: Sequence[float], a: float, b: float) -> int:
    return sum(1 for t in times if a <= t < b)


def engine_failure_costs(events: Sequence[dict[str, Any]], step_times: Sequence[tuple[float, int, int]],
                         segments: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per engine kill: down time (kill -> back) and lost time against the all-engines-up step rate.

    ``step_times``: (bench time the step's line was first seen, step, segment); ``segments``: each with
    ``segment``, ``first_step_t`` and ``end_t`` (the span over which engines were being killed).
    """
    kills = [e for e in events if e["kind"] in ("engine_kill", "engine_kill_in_sync")]
    per_seg_rate: dict[int, float | None] = {}
    for seg in segments:
        n = seg["segment"]
        a, b = seg.get("first_step_t"), seg.get("end_t")
        if a is None or b is None or b <= a:
            per_seg_rate[n] = None
            continue
        down = _intervals_union([(k["t"], k.get("back_t") or b) for k in kills if k["segment"] == n])
        times = [t for t, _, s in step_times if s == n]
        up_s, up_steps, cur = 0.0, 0, a
        for da, db in down + [(b, b)]:
            da, db = max(da, a), min(db, b)
            if da > cur:
                up_s += da - cur
                up_steps += _steps_in(times, cur, da)
            cur = max(cur, db)
        per_seg_rate[n] = up_steps / up_s if up_s > 0 else None
    rows = []
    for k in kills:
        rate = per_seg_rate.get(k["segment"])
        back = k.get("back_t")
        row = dict(k)
        if back is not None:
            down_s = back - k["t"]
            during = _steps_in([t for t, _, s in step_times if s == k["segment"]], k["t"], back)
            row.update(down_s=round(down_s, 1), steps_while_down=during)
            if rate:
                row["lost_s"] = round(down_s - during / rate, 1)
        rows.append(row)
    seg_end = {seg["segment"]: seg.get("end_t") for seg in segments}
    lost = [r["lost_s"] for r in rows if "lost_s" in r]
    downs = [r["down_s"] for r in rows if "down_s" in r]
    return {
        "kills": rows,
        "step_rate_all_up": {str(k): (round(v, 3) if v else None) for k, v in per_seg_rate.items()},
        "down_s_mean": round(sum(downs) / len(downs), 1) if downs else None,
        "lost_s_total": round(sum(lost), 1) if lost else None,
        # a kill shortly before the run's end may legitimately end with the run, still restarting
        "not_back": [r["target"] for r in rows if r.get("back_t") is None
                     and (seg_end.get(r["segment"]) or 0) - r["t"] >= BACK_WITHIN_S],
        "run_ended_while_restarting": [r["target"] for r in rows if r.get("back_t") is None
                                       and (seg_end.get(r["segment"]) or 0) - r["t"] < BACK_WITHIN_S],
    }


def controller_failure_cost(event: dict[str, Any], step_times: Sequence[tuple[float, int, int]],
                            resumed_from: int | None) -> dict[str, Any]:
    """The controller kill: time until the resumed run was back at the step it had reached."""
    out = dict(event)
    reached = int(event.get("step", 0))
    seg2 = sorted((t, s) for t, s, g in step_times if g == event["segment"] + 1)
    first_new = next(((t, s) for t, s in seg2 if resumed_from is None or s > resumed_from), None)
    regained = next(((t, s) for t, s in seg2 if s >= reached), None)
    out["resumed_from_step"] = resumed_from
    out["steps_redone"] = reached - resumed_from if resumed_from is not None else None
    if first_new is not None:
        out["kill_to_first_new_step_s"] = round(first_new[0] - event["t"], 1)
    if first_new is not None and event.get("relaunch_t") is not None:
        out["relaunch_to_first_new_step_s"] = round(first_new[0] - event["relaunch_t"], 1)
    if regained is not None:
        out["lost_s"] = round(regained[0] - event["t"], 1)
    return out


def checkpoint_times(log_texts: Sequence[str]) -> list[float]:
    return [float(m.group(2)) for text in log_texts for m in _CKPT_RE.finditer(text)]


def counted(rows: Sequence[dict[str, Any]], keys: Sequence[str], since_step: int | None = None) -> dict[str, int]:
    """Counter increments in ``rows`` (metrics.jsonl) after ``since_step`` (whole run when None)."""
    def at(step: int | None) -> dict[str, Any]:
        if step is None:
            return {}
        prior = [r for r in rows if int(r.get("step", 0)) <= step]
        return prior[-1] if prior else {}

    last = rows[-1] if rows else {}
    base = at(since_step)
    return {k: int(last.get(f"count/{k}", 0)) - int(base.get(f"count/{k}", 0)) for k in keys}


COUNTERS = ("engine/deaths", "engine/restarts", "engine/retried_requests", "weight_sync/engine_died",
            "engine/gave_up", "resume/readmitted_groups", "checkpoint/failed")


def analyze(*, rows: Sequence[dict[str, Any]], seg1_rows: Sequence[dict[str, Any]], final_state: dict[str, Any],
            events: Sequence[dict[str, Any]], step_times: Sequence[tuple[float, int, int]],
            segments: Sequence[dict[str, Any]], logs: Sequence[str], summary: dict[str, Any],
            resumed_from: int | None, exit_code: int | None, min_gain: float = MIN_GAIN_POINTS,
            stopped_by_bench: bool = False) -> dict[str, Any]:
    """The chaos report from the run's records (see the module docstring); ``pass`` = every promise held."""
    acc = accuracy(rows)
    prompts = verify_prompts(rows, final_state)
    engines = engine_failure_costs(events, step_times, segments)
    ctl_events = [e for e in events if e["kind"] == "controller_kill"]
    controller = [controller_failure_cost(e, step_times, resumed_from) for e in ctl_events]
    ck = checkpoint_times(logs)
    train_s = float(summary.get("result", {}).get("elapsed_s") or 0.0) if summary else 0.0
    seg_counts = {"segment 1 (until the controller kill)": counted(seg1_rows, COUNTERS)}
    seg_counts["segment 2 (resumed)"] = counted(rows, COUNTERS, since_step=resumed_from)
    total = {k: sum(c[k] for c in seg_counts.values()) for k in COUNTERS}
    kills = [e for e in events if e["kind"] in ("engine_kill", "engine_kill_in_sync")]
    in_sync = [e for e in kills if e["kind"] == "engine_kill_in_sync"]
    checks = {
        # 0, or 130 when the bench itself ended the run with SIGTERM (--end-after)
        "exit_ok": exit_code == 0 or (stopped_by_bench and exit_code == 130),
        f"gain_ge_{min_gain:g}_points": acc["gain_points"] is not None and acc["gain_points"] >= min_gain,
        "metrics_steps_once_each": steps_contiguous(rows),
        "no_prompt_lost_or_repeated": prompts["ok"],
        "every_killed_engine_back": not engines["not_back"],
        "deaths_counted": total["engine/deaths"] >= len(kills),
        "kill_inside_a_weight_sync": bool(in_sync) and total["weight_sync/engine_died"] >= 1,
        "controller_killed_and_resumed": bool(controller) and resumed_from is not None,
        "no_process_outlived_the_controller": all(c.get("survivors_after_30s") == 0 for c in controller),
    }
    return {
        "accuracy": acc,
        "prompts": prompts,
        "engine_kills": len(kills),
        "engine_kills_in_sync": len(in_sync),
        "engines_back": sum(1 for k in kills if k.get("back_t") is not None),  # seen in the controller log
        "exit_code": exit_code, "stopped_by_bench": stopped_by_bench,
        "counted": {"total": total, **seg_counts},
        "engine_failures": engines,
        "controller_failures": controller,
        "checkpoints": {
            "count": len(ck), "seconds": [round(x, 3) for x in ck], "total_s": round(sum(ck), 2),
            "training_s": round(train_s, 1),
            "share_of_training": round(sum(ck) / train_s, 5) if train_s else None,
        },
        "resume": {"from_step": resumed_from,
                   "relaunch_to_first_new_step_s": controller[0].get("relaunch_to_first_new_step_s") if controller else None},
        "checks": checks,
        "pass": all(checks.values()),
    }


def markdown(rep: dict[str, Any], command: str) -> str:
    acc, p, c = rep["accuracy"], rep["prompts"], rep["counted"]["total"]
    lines = [
        "# Chaos run", "", f"`{command}`", "",
        f"**{'PASS' if rep['pass'] else 'FAIL'}**: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in rep["checks"].items()),
        "", "| | |", "|---|---|",
    ]
    if acc["start"] is not None:
        lines.append(f"| held-out accuracy, step {acc['start_step']} -> step {acc['end_step']} | "
                     f"{acc['start']:.1%} -> {acc['end']:.1%} (**{acc['gain_points']:+.1f} points**; best {acc['best']:.1%}) |")
    lines += [
        f"| engine SIGKILLs (of which inside a weight sync) / back and caught up (controller log) | "
        f"{rep['engine_kills']} ({rep['engine_kills_in_sync']}) / {rep.get('engines_back')} |",
        f"| counted by the run: engine deaths / restarts / retried requests / engine died in a sync | "
        f"{c['engine/deaths']} / {c['engine/restarts']} / {c['engine/retried_requests']} / {c['weight_sync/engine_died']} |",
        f"| engine down (kill -> back, caught up), mean | {rep['engine_failures']['down_s_mean']} s |",
        f"| time lost to engine kills, total (down time - steps made / all-up step rate) | {rep['engine_failures']['lost_s_total']} s |",
    ]
    if rep["engine_failures"].get("run_ended_while_restarting"):
        lines.append(f"| engines the run ended while they were restarting (killed < {BACK_WITHIN_S:.0f} s before the end) | "
                     f"{', '.join(rep['engine_failures']['run_ended_while_restarting'])} |")
    for ctl in rep["controller_failures"]:
        lines += [
            f"| controller SIGKILL at step {ctl['step']}: processes alive 30 s later | {ctl.get('survivors_after_30s')} |",
            f"| ... resumed from checkpoint step {ctl['resumed_from_step']} ({ctl['steps_redone']} steps trained again); "
            f"relaunch -> first new step | {ctl.get('relaunch_to_first_new_step_s')} s |",
            f"| ... time lost (kill -> back at step {ctl['step']}) | {ctl.get('lost_s')} s |",
        ]
    ck = rep["checkpoints"]
    share = f"{ck['share_of_training']:.2%}" if ck["share_of_training"] is not None else "n/a"
    lines += [
        f"| checkpoints (both segments) | {ck['count']} in {ck['total_s']} s = {share} of {ck['training_s']} s training |",
        f"| prompts: steps / trained / handed out / outstanding at end / dropped | {p['steps']} / {p['trained_prompts']} / "
        f"{p['handed_out']} / {p['outstanding_at_end']} / {p['dropped']} |",
        f"| prompts trained twice / lost | {len(p['repeated'])} / {len(p['lost'])} |",
        "", "## Failures", "", "| t (s) | what | target | at step | down (s) | steps while down | lost (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in rep["engine_failures"]["kills"]:
        lines.append(f"| {k['t']:.0f} | {k['kind']} | {k['target']} | {k['step']} | {k.get('down_s', '-')} | "
                     f"{k.get('steps_while_down', '-')} | {k.get('lost_s', '-')} |")
    for ctl in rep["controller_failures"]:
        lines.append(f"| {ctl['t']:.0f} | controller_kill | flashrl run | {ctl['step']} | "
                     f"{ctl.get('kill_to_first_new_step_s', '-')} | - | {ctl.get('lost_s', '-')} |")
    lines += ["", "Per epoch of the train split (uid // train_size):", "",
              "| epoch | uids | complete | trained | outstanding at end | dropped |", "|---|---|---|---|---|---|"]
    for e in p["epochs"]:
        lines.append(f"| {e['epoch']} | {e['uids'][0]}..{e['uids'][1]} | {e['complete']} | {e['trained']} | "
                     f"{e['outstanding']} | {e['dropped']} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- the run
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
        from flashrl.checkpoint import read_latest

        def rows(path: Path) -> list[dict[str, Any]]:
            if not path.exists():
                return []
            return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

        rd = self.run_dir
        latest = read_latest(rd / "checkpoints")
        final_state = json.loads((latest / "controller.json").read_text()) if latest else {}
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
