"""The chaos bench's report (``flashrl bench chaos``; the run itself: chaos.py): pure functions of its records.

What the report shows (``analyze``, pure functions of the records, tested in tests/unit/test_chaos.py):
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

import re
from collections.abc import Sequence
from typing import Any

MIN_GAIN_POINTS = 20.0
BACK_WITHIN_S = 150.0  # an engine killed this long before its segment ended must have been back by then
_CKPT_RE = re.compile(r"checkpoint (\S+) written in ([\d.]+) s")


def verify_prompts(rows: Sequence[dict[str, Any]], final_state: dict[str, Any]) -> dict[str, Any]:
    """Which prompt uids the run's steps trained (``rows``: metrics.jsonl, step 1..N, each with
    ``prompt_uids``) against what the final checkpoint says was handed out (``next_uid``), still
    outstanding (``readmit``, and ``rollout_groups``: the groups saved with their rollouts, partial mode)
    and dropped (``dropped_uids``, or only a count in ``counters``)."""
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
    outstanding = {int(u) for u in (*final_state.get("readmit", []), *final_state.get("rollout_groups", []))}
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
