"""``flashrl bench chaos``'s pure parts (the run itself: chaos_soak.py): the kill plan, which process is
which kind, and the report computed from a run directory's records. No process, no socket, no clock.

The plan (``plan``): kill times t_1 < t_2 < ... with gaps drawn uniformly from ``--every LO-HI``
(seeded), over the chaos window (``--minutes``, counted from the first trained step). A share of the
slots (``CONTROLLER_SHARE``, at least one) is reserved for the controller, one slot drawn at random in
each of that many equal stretches of the plan, so a 30-minute plan at 30-60 s (30 to 60 slots) holds 6
to 12 controller kills whatever the seed; every other slot kills a random kind among the kinds alive
(engine, trainer, env, reward: every kind the run has shown so far, equally likely), then a random
process of that kind; a slot whose kind has no live process (the run is restarting: env workers start
after the engines) waits for one, up to ``KIND_WAIT_S``, then takes another kind alive.

Which process is which (``classify``, ``targets``): the processes under the supervisor, by the module
each one runs (``python -m flashrl.engine.server`` ...; ``KIND_MODULES``); the controller is the
supervisor's child running ``flashrl.cli run``. A process started by another process of the same
kind (vLLM's engine core under an engine server) is part of it, not a target of its own.

The report (``analyze`` over ``Records``; ``load`` reads them from the bench's folder):
  - lineage: the final metrics.jsonl (the records of the weights the run ends with) holds steps
    0..N once each, N the steps asked; a step twice or a gap fails it;
  - history (chaos/steps.jsonl: every metrics line the bench saw, in order, whatever incarnation of the
    controller wrote it): steps trained by a controller that then died before its next checkpoint
    were thrown away and trained again (``steps_redone``; their tokens count as regenerated);
  - prompts: every uid handed out (the final checkpoint's next_uid) trained exactly once in the
    lineage, or outstanding or dropped at the end (chaos_report.verify_prompts); samples lost =
    lost uids x group_size (must be 0);
  - tokens regenerated: the run's own ``resume/regenerated_tokens`` counter plus the tokens of the
    steps redone;
  - time lost per kill: over the stretch from the kill to the next one (or the run's end), its length
    less the new steps made in it (a step higher than any seen before) x the all-up step time (the
    median of the run's own ``time/step_s``): an upper bound, since whatever else slows the run in that
    stretch (an eval) counts too; a kill whose stretch holds fewer than two new steps (the next kill came
    before the run was going again) is ``overlapped`` and left out of the per-kind medians (its loss
    runs on into the next kill's);
  - restarts (``restarts``): after each controller kill the supervisor resumed the checkpoint a resume takes
    (the one ``latest`` named at the kill, else the newest complete step-N folder), started fresh only when
    there was no complete checkpoint, or ended a finished run; no complete checkpoint was set aside as
    ``checkpoints.<t>`` (``set_aside``); and the one kill before the first ``latest`` (``early_kill_step``) was done;
  - processes left: every process seen under the supervisor, and every process whose environment
    names one of them as its parent, still alive 30 s after the supervisor exited (must be 0);
  - held-out accuracy at the last step against an undisturbed run of the same seed and steps.
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from flashrl.bench.chaos_report import verify_prompts

KINDS = ("engine", "trainer", "env", "reward", "controller")
KIND_MODULES = {"flashrl.engine.server": "engine", "flashrl.trainer.worker": "trainer",  # judge engines too
                "envs.remote": "env", "flashrl.rewards": "reward",
                "flashrl.rewardmodel.worker": "reward"}  # [reward] model workers: reward workers as well
CONTROLLER_SHARE = 0.2
KIND_WAIT_S = 60.0  # a slot waits this long for a process of its kind (an env worker while the run restarts)
ACCURACY_POINTS = 3.0  # held-out accuracy within this many points of the undisturbed run
_DEATH_RE = re.compile(r"death (\d+): the controller \(pid (\d+)\) ([^;]+);")
_REAPED_RE = re.compile(r"killed (\d+) process\(es\) the dead controller had started")
_PLAN_RE = re.compile(r"death \d+: the controller \(pid (\d+)\) [^;]+; restart \d+ of \d+ in \d+ s, (.+?)\. Last lines of ")
_FINISHED_RE = re.compile(r"the run finished at step (\d+) .*?its controller \(pid (\d+)\)")


class Slot(msgspec.Struct, frozen=True):
    """One planned kill: ``t`` seconds into the chaos window; ``controller``: the slot is the controller's."""

    t: float
    controller: bool


class ProcInfo(msgspec.Struct, frozen=True):
    """A process as the bench saw it: pid, parent pid, command line, start time (pid reuse)."""

    pid: int
    ppid: int
    cmdline: list[str]
    create_time: float = 0.0


def parse_every(text: str) -> tuple[float, float]:
    """``--every 30-60`` (or ``45``): the range of seconds between kills."""
    parts = text.split("-")
    try:
        lo, hi = (float(parts[0]), float(parts[-1])) if len(parts) in (1, 2) else (math.nan, math.nan)
    except ValueError:
        lo = hi = math.nan
    if not (lo > 0 and hi >= lo):
        raise ValueError(f"--every {text!r}: give seconds between kills as LO-HI with 0 < LO <= HI, e.g. 30-60")
    return lo, hi


def plan(minutes: float, every: tuple[float, float], seed: int, controller_share: float = CONTROLLER_SHARE) -> list[Slot]:
    """The kill slots of a ``minutes`` window (module docstring); the same seed gives the same plan."""
    if minutes <= 0:
        raise ValueError(f"--minutes {minutes}: give a positive number of minutes")
    rng = random.Random(seed)
    times: list[float] = []
    t = rng.uniform(*every)
    while t <= minutes * 60:
        times.append(round(t, 2))
        t += rng.uniform(*every)
    if not times:
        return []
    n_ctl = min(len(times), max(1, round(len(times) * controller_share)))
    ctl: set[int] = set()
    for i in range(n_ctl):  # one slot in each of n_ctl equal stretches: spread over the window
        lo, hi = (i * len(times)) // n_ctl, ((i + 1) * len(times)) // n_ctl
        ctl.add(rng.randrange(lo, hi))
    return [Slot(t=x, controller=i in ctl) for i, x in enumerate(times)]


def classify(cmdline: Sequence[str]) -> str | None:
    """The kind of process a command line runs (``KIND_MODULES``; "controller" for ``flashrl.cli run``
    without ``--supervise``), or None."""
    for i, word in enumerate(cmdline):
        if word == "-m" and i + 1 < len(cmdline):
            mod = cmdline[i + 1]
            if mod in KIND_MODULES:
                return KIND_MODULES[mod]
            if mod == "flashrl.cli" and "run" in cmdline[i + 2:i + 3] and "--supervise" not in cmdline:
                return "controller"
    return None


def targets(procs: Sequence[ProcInfo], supervisor_pid: int) -> dict[str, list[ProcInfo]]:
    """The processes that can be killed, by kind: the supervisor's controller child, and under it the top
    process of each engine, trainer rank, env and reward worker (module docstring)."""
    by_pid = {p.pid: p for p in procs}
    kind = {p.pid: classify(p.cmdline) for p in procs}
    out: dict[str, list[ProcInfo]] = {k: [] for k in KINDS}
    for p in procs:
        k = kind[p.pid]
        if k is None:
            continue
        if k == "controller":
            if p.ppid == supervisor_pid:
                out[k].append(p)
            continue
        parent = by_pid.get(p.ppid)
        if parent is not None and kind[parent.pid] == k:
            continue  # a sub-process of one (vLLM's engine core started by the engine server)
        out[k].append(p)
    for v in out.values():
        v.sort(key=lambda p: p.pid)
    return out


def draw_kind(rng: random.Random, slot: Slot, run_kinds: set[str]) -> str | None:
    """The kind a slot kills: the controller for its slots, else a random one of the other kinds this run has
    shown (``run_kinds``: every kind seen alive so far), or None while none was seen."""
    if slot.controller:
        return "controller"
    kinds = sorted(k for k in run_kinds if k != "controller")
    return rng.choice(kinds) if kinds else None


def pick(rng: random.Random, kind: str, alive: dict[str, list[ProcInfo]], controller_ok: bool) -> ProcInfo | None:
    """A random live process of ``kind``, or None (the slot waits: none alive now, the run is restarting; or,
    for the controller, no checkpoint yet to resume from)."""
    if kind == "controller" and not controller_ok:
        return None
    procs = alive.get(kind) or []
    return rng.choice(procs) if procs else None


def redraw(rng: random.Random, alive: dict[str, list[ProcInfo]]) -> str | None:
    """A slot whose kind stayed dead too long (``KIND_WAIT_S``) takes a random other kind alive now."""
    kinds = [k for k in KINDS if k != "controller" and alive.get(k)]
    return rng.choice(kinds) if kinds else None


def early_kill_step(seed: int, checkpoint_every: int) -> int:
    """The step after which the bench kills the controller once in the window before the first ``latest``
    exists (a restart then has no pointer: it must start fresh, or resume a complete step-N folder the dead
    controller renamed but never pointed to): drawn, seeded, in the first half of the first checkpoint
    interval, so the bench's polling (POLL_S) sees it before the checkpoint even on a fast host."""
    return random.Random(seed + 2).randint(1, max(1, checkpoint_every // 2))


def checkpoint_every(sets: Sequence[str], default: int = 10) -> int:
    """run.checkpoint_every as the run's --set overrides give it (the last one wins)."""
    found = [s.split("=", 1)[1] for s in sets if s.replace(" ", "").startswith("run.checkpoint_every=")]
    return int(found[-1]) if found else default


def restarts(supervisor_log: str, kills: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each controller kill against what the supervisor did after it (its log): resume the checkpoint a resume
    takes (resuming.newest_complete: the one ``latest`` named at the kill, ``latest_step``; without a pointer
    the newest complete step-N folder, ``newest_step``), or a newer one completed as it died; a fresh start
    only when there was no complete checkpoint; or end a run that had finished."""
    plans = {int(m.group(1)): m.group(2) for m in _PLAN_RE.finditer(supervisor_log)}
    plans.update({int(m.group(2)): f"finished at step-{m.group(1)}" for m in _FINISHED_RE.finditer(supervisor_log)})
    rows, wrong = [], []
    for k in kills:
        if k.get("kind") != "controller":
            continue
        newest, plan = int(k.get("newest_step", 0)), plans.get(int(k.get("pid", -1)), "")
        due = int(k.get("latest_step", 0)) or newest  # the pointer wins (a folder newer than it is passed over)
        m = re.match(r"(?:--resume from|finished at) step-(\d+)", plan)
        ok = (m is not None and int(m.group(1)) >= due) or (newest == 0 and plan.startswith("fresh start"))
        row = {"pid": k.get("pid"), "newest_step": newest, "latest_step": int(k.get("latest_step", 0)), "plan": plan,
               "ok": ok}
        rows.append(row)
        if not ok:
            wrong.append(row)
    return {"controller_kills": rows, "wrong": wrong, "ok": not wrong}


# --------------------------------------------------------------------------- the report


class Records(msgspec.Struct):
    """What the report is computed from (``load`` reads it from the bench's OUT folder)."""

    metrics: list[dict[str, Any]]  # the final metrics.jsonl: the lineage of the weights the run ends with
    history: list[dict[str, Any]]  # chaos/steps.jsonl: {"t": bench s, "row": metrics line} for every line seen
    kills: list[dict[str, Any]]  # chaos/kills.jsonl: {"t", "kind", "pid", "step", ...}
    final_state: dict[str, Any]  # the final checkpoint's controller.json (+ rollout_groups in partial mode)
    supervisor_log: str = ""
    group_size: int = 1
    steps_asked: int | None = None
    left: list[dict[str, Any]] = []  # processes alive 30 s after the supervisor exited
    exit_code: int | None = None
    baseline: list[dict[str, Any]] | None = None  # the undisturbed run's metrics.jsonl
    window_s: float = 0.0
    end_t: float | None = None  # bench time the run ended (the last kill's window closes there)
    run_kinds: list[str] = []  # the kinds of process the run had (seen alive at least once)
    early: dict[str, Any] | None = None  # the kill before the first ``latest`` (early_kill_step): step, done, latest_deleted
    set_aside: dict[str, list[int]] = {}  # checkpoints.<t> folders a fresh start set aside -> the complete steps in them


def _canon(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True)


def lineage(rows: Sequence[dict[str, Any]], steps_asked: int | None) -> dict[str, Any]:
    """Steps 0..N in the final metrics.jsonl: each once, none missing, N = the steps asked."""
    steps = [int(r.get("step", -1)) for r in rows]
    seen: dict[int, int] = {}
    for s in steps:
        seen[s] = seen.get(s, 0) + 1
    top = max(steps, default=-1)
    end = steps_asked if steps_asked is not None else top
    twice = sorted(s for s, n in seen.items() if n > 1)
    missing = [s for s in range(0, max(end, top) + 1) if s not in seen]
    return {"last_step": top, "steps_asked": steps_asked, "trained_twice": twice, "missing": missing,
            "in_order": steps == sorted(steps), "ok": not twice and not missing and steps == sorted(steps) and top == end}


def progress(history: Sequence[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, step) of each new step: a step line higher than any seen before."""
    out: list[tuple[float, int]] = []
    top = -1
    for h in history:
        s = int(h["row"].get("step", -1))
        if s > top:
            out.append((float(h["t"]), s))
            top = s
    return out


def redone(history: Sequence[dict[str, Any]], final: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step lines a controller wrote that are not in the final lineage: trained, then thrown away when it
    died before its next checkpoint (the resumed run trained those steps again)."""
    kept = {_canon(r) for r in final}
    out, seen = [], set()
    for h in history:
        c = _canon(h["row"])
        if c in kept or c in seen:
            continue
        seen.add(c)
        out.append(h["row"])
    return out


def step_time(history: Sequence[dict[str, Any]], prog: Sequence[tuple[float, int]]) -> float | None:
    """The all-up step time: the median of the run's own ``time/step_s`` (wall time between its steps), or
    else of the gaps between new steps the bench saw."""
    own = [float(h["row"]["time/step_s"]) for h in history if h["row"].get("time/step_s") is not None]
    if own:
        return statistics.median(own)
    gaps = [b[0] - a[0] for a, b in zip(prog, prog[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def kill_costs(kills: Sequence[dict[str, Any]], prog: Sequence[tuple[float, int]], step_s: float | None,
               end_t: float | None = None) -> list[dict[str, Any]]:
    """Per kill (module docstring): over [the kill, the next kill or the run's end), lost = its length less
    the new steps made in it x ``step_s``; recovered = kill -> the second new step after it (the first may
    be a step the dying controller had in flight); overlapped = the next kill came before that."""
    times = [t for t, _ in prog]
    order = sorted(kills, key=lambda k: float(k["t"]))
    stop = end_t if end_t is not None else (times[-1] if times else 0.0)
    nxt = {id(k): (float(order[i + 1]["t"]) if i + 1 < len(order) else max(stop, float(k["t"]))) for i, k in enumerate(order)}
    rows = []
    for k in kills:
        t, b = float(k["t"]), nxt[id(k)]
        made = [x for x in times if t < x <= b]
        row = dict(k)
        row["window_s"] = round(b - t, 1)
        row["steps_made"] = len(made)
        row["recovered_s"] = round(made[1] - t, 1) if len(made) >= 2 else None
        row["overlapped"] = len(made) < 2
        row["lost_s"] = round(max(0.0, (b - t) - len(made) * step_s), 1) if step_s is not None else None
        rows.append(row)
    return rows


def _last_eval(rows: Sequence[dict[str, Any]]) -> tuple[int, float] | None:
    ev = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r]
    return ev[-1] if ev else None


def analyze(rec: Records, min_controller_kills: int = 0, points: float = ACCURACY_POINTS) -> dict[str, Any]:
    """The chaos report (module docstring); ``pass`` when every check holds."""
    lin = lineage(rec.metrics, rec.steps_asked)
    prompts: dict[str, Any] = verify_prompts(rec.metrics, rec.final_state) if rec.final_state else {
        "ok": False, "lost": [], "repeated": [], "trained_prompts": 0, "handed_out": 0, "outstanding_at_end": 0,
        "dropped": 0, "steps": 0, "why": "no final checkpoint (controller.json) to account the prompts against"}
    prog = progress(rec.history)
    median = step_time(rec.history, prog)
    costs = kill_costs(rec.kills, prog, median, rec.end_t)
    thrown = redone(rec.history, rec.metrics)
    last = rec.metrics[-1] if rec.metrics else {}
    resume_regen = int(last.get("count/resume/regenerated_tokens", 0))
    redone_tokens = sum(int(r.get("tokens/trained", r.get("tokens", 0)) or 0) for r in thrown)
    per_kind: dict[str, dict[str, Any]] = {}
    for k in KINDS:
        mine = [c for c in costs if c["kind"] == k]
        alone = [c["lost_s"] for c in mine if c["lost_s"] is not None and not c["overlapped"]]
        per_kind[k] = {"kills": len(mine), "lost_s_median": round(statistics.median(alone), 1) if alone else None,
                       "lost_s_max": max(alone) if alone else None, "measured_alone": len(alone),
                       "lost_s_total": round(sum(c["lost_s"] or 0.0 for c in mine), 1)}
    deaths = [{"n": int(m.group(1)), "pid": int(m.group(2)), "cause": m.group(3).strip()}
              for m in _DEATH_RE.finditer(rec.supervisor_log)]
    reaped = sum(int(m.group(1)) for m in _REAPED_RE.finditer(rec.supervisor_log))
    acc: dict[str, Any] = {"chaos": _last_eval(rec.metrics), "baseline": _last_eval(rec.baseline) if rec.baseline else None}
    if acc["chaos"] and acc["baseline"]:
        acc["diff_points"] = round(100 * (acc["chaos"][1] - acc["baseline"][1]), 2)
    samples_lost = len(prompts.get("lost", [])) * rec.group_size
    restarted = restarts(rec.supervisor_log, rec.kills)
    checks = {
        "run_finished": rec.exit_code == 0,
        "every_step_trained_once": lin["ok"],
        "every_prompt_trained_once": bool(prompts["ok"]),
        "no_sample_lost": samples_lost == 0,
        "no_process_left": not rec.left,
        f"controller_kills_ge_{min_controller_kills}": per_kind["controller"]["kills"] >= min_controller_kills,
        "every_kind_killed": all(per_kind[k]["kills"] for k in rec.run_kinds),
        # issue 51: a restart resumes the newest complete checkpoint (with or without ``latest``); none is set aside
        "restarts_resume_the_newest_checkpoint": restarted["ok"],
        "no_complete_checkpoint_set_aside": not any(rec.set_aside.values()),
    }
    if rec.early is not None:
        checks["killed_before_the_first_latest"] = bool(rec.early.get("done"))
    if rec.baseline is not None:
        checks[f"accuracy_within_{points:g}_points"] = "diff_points" in acc and abs(acc["diff_points"]) <= points
    return {
        "checks": checks, "pass": all(checks.values()), "exit_code": rec.exit_code,
        "window_s": rec.window_s,
        "kills": {k: v["kills"] for k, v in per_kind.items()}, "kills_total": len(rec.kills),
        "run_kinds": rec.run_kinds,
        "lineage": lin,
        "prompts": {k: v for k, v in prompts.items() if k != "epochs"},
        "samples_lost": samples_lost,
        "tokens_regenerated": {"total": resume_regen + redone_tokens, "resume_counter": resume_regen,
                               "steps_redone": len(thrown), "steps_redone_tokens": redone_tokens},
        "time_lost": {"step_s": round(median, 3) if median is not None else None, "per_kind": per_kind},
        "controller_deaths": deaths, "reaped_by_supervisor": reaped,
        "restarts": restarted, "early_kill": rec.early, "set_aside": rec.set_aside,
        "counted": {k[len("count/"):]: v for k, v in last.items()
                    if k.startswith("count/") and k.split("/")[1] in ("engine", "resume", "env", "weight_sync", "rollout")},
        "processes_left": rec.left,
        "accuracy": acc,
        "kill_log": costs,
    }


def _early_text(early: dict[str, Any] | None) -> str:
    if not early:
        return "-"
    if not early.get("done"):
        return f"planned after step {early.get('step')}, not done"
    return f"after step {early.get('at_step')}" + (" (`latest` deleted first: it already existed)"
                                                   if early.get("latest_deleted") else "")


def markdown(rep: dict[str, Any], command: str) -> str:
    lin, p, tl = rep["lineage"], rep["prompts"], rep["time_lost"]
    acc = rep["accuracy"]

    def ev(x: Any) -> str:
        return f"{x[1]:.1%} at step {x[0]}" if x else "-"

    lines = [
        "# Chaos: every kind of process killed", "", f"`{command}`", "",
        f"**{'PASS' if rep['pass'] else 'FAIL'}**: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in rep["checks"].items()),
        "", "| | |", "|---|---|",
        f"| chaos window / kills | {rep['window_s']:.0f} s / {rep['kills_total']} |",
        "| kills per kind (kinds the run had) | " + ", ".join(f"{k} {n}" for k, n in rep["kills"].items())
        + f" ({', '.join(rep['run_kinds']) or '-'}) |",
        f"| steps in the final lineage / asked; trained twice; missing | {lin['last_step']} / {lin['steps_asked']}; "
        f"{lin['trained_twice'] or 0}; {lin['missing'] or 0} |",
        f"| prompts: trained / handed out / outstanding at end / dropped; trained twice / lost | {p.get('trained_prompts')} / "
        f"{p.get('handed_out')} / {p.get('outstanding_at_end')} / {p.get('dropped')}; {len(p.get('repeated', []))} / {len(p.get('lost', []))} |",
        f"| samples lost | **{rep['samples_lost']}** |",
        f"| tokens regenerated (resume counter + steps redone) | {rep['tokens_regenerated']['total']} "
        f"({rep['tokens_regenerated']['resume_counter']} + {rep['tokens_regenerated']['steps_redone_tokens']} in "
        f"{rep['tokens_regenerated']['steps_redone']} steps redone) |",
        f"| controller deaths the supervisor logged / processes it reaped | {len(rep['controller_deaths'])} / {rep['reaped_by_supervisor']} |",
        "| controller kills: the restart after each (newest complete step at the kill) | "
        + ("; ".join(f"{r['plan'] or '-'} ({r['newest_step']})" for r in rep.get("restarts", {}).get("controller_kills", []))
           or "-") + " |",
        f"| kill before the first `latest` | {_early_text(rep.get('early_kill'))} |",
        f"| complete checkpoints set aside | **{sum(len(v) for v in rep.get('set_aside', {}).values())}** |",
        f"| processes left 30 s after the run | **{len(rep['processes_left'])}** |",
        f"| held-out accuracy: chaos / undisturbed run | {ev(acc['chaos'])} / {ev(acc['baseline'])}"
        + (f" ({acc['diff_points']:+.1f} points)" if "diff_points" in acc else "") + " |",
        "", f"## Time lost per kill kind (all-up step time {tl['step_s']} s; lost = the time to the next kill "
        "less the new steps made in it x the step time)", "",
        "| kind | kills | measured alone | lost, median (s) | lost, max (s) | lost, total (s) |", "|---|---|---|---|---|---|",
    ]
    for k, v in tl["per_kind"].items():
        lines.append(f"| {k} | {v['kills']} | {v['measured_alone']} | {v['lost_s_median']} | {v['lost_s_max']} | {v['lost_s_total']} |")
    lines += ["", "## Kills", "", "| t (s) | kind | pid | at step | to next kill (s) | new steps | recovered (s) | lost (s) | overlapped |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k in rep["kill_log"]:
        lines.append(f"| {k['t']:.0f} | {k['kind']} | {k.get('pid')} | {k.get('step')} | {k['window_s']} | {k['steps_made']} | "
                     f"{k.get('recovered_s')} | {k.get('lost_s')} | {k.get('overlapped')} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- reading a bench folder


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def load(out: Path, run_dir: Path, baseline_dir: Path | None, steps_asked: int | None) -> Records:
    """The records of a chaos bench in ``out`` (chaos/steps.jsonl, kills.jsonl, left.json, exit.json) and its
    run folder (metrics.jsonl, supervisor.log, config.toml, final_controller.json or the latest checkpoint)."""
    final_state: dict[str, Any] = {}
    saved = run_dir / "final_controller.json"
    if saved.exists():
        final_state = json.loads(saved.read_text())
    group_size = 1
    if (run_dir / "config.toml").exists():
        group_size = int(tomllib.loads((run_dir / "config.toml").read_text()).get("rollout", {}).get("group_size", 1))
    meta = json.loads((out / "chaos" / "exit.json").read_text()) if (out / "chaos" / "exit.json").exists() else {}
    return Records(
        metrics=_jsonl(run_dir / "metrics.jsonl"), history=_jsonl(out / "chaos" / "steps.jsonl"),
        kills=_jsonl(out / "chaos" / "kills.jsonl"), final_state=final_state,
        supervisor_log=(run_dir / "supervisor.log").read_text() if (run_dir / "supervisor.log").exists() else "",
        group_size=group_size, steps_asked=steps_asked, left=meta.get("left", []), exit_code=meta.get("exit_code"),
        baseline=_jsonl(baseline_dir / "metrics.jsonl") if baseline_dir is not None else None,
        window_s=float(meta.get("window_s", 0.0)), end_t=meta.get("end_t"),
        run_kinds=list(meta.get("run_kinds", [])), early=meta.get("early_kill"),
        set_aside=json.loads((run_dir / "set_aside.json").read_text()) if (run_dir / "set_aside.json").exists() else {})
