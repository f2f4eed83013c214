"""`flashrl bench chaos`'s pure parts (flashrl/bench/chaos_soak_report.py): the kill plan, which process is
which kind, and the report on hand-made run folders: it must flag a step trained twice, a missing step, a
prompt trained twice, a lost sample, a process left, an accuracy off the baseline; and price each kill."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from flashrl.bench.chaos_soak_report import (
    ProcInfo,
    Records,
    Slot,
    analyze,
    checkpoint_every,
    classify,
    draw_kind,
    early_kill_step,
    kill_costs,
    lineage,
    load,
    markdown,
    parse_every,
    pick,
    plan,
    redone,
    redraw,
    restarts,
    step_time,
    targets,
)

PY = "/venv/bin/python"


def test_every_parses_a_range_and_names_a_bad_one() -> None:
    assert parse_every("30-60") == (30.0, 60.0)
    assert parse_every("45") == (45.0, 45.0)
    for bad in ("60-30", "soon", "0-10", "1-2-3", "-5"):
        with pytest.raises(ValueError, match="give seconds between kills as LO-HI"):
            parse_every(bad)


def test_the_plan_is_seeded_inside_the_window_and_spaced_as_asked() -> None:
    a, b = plan(30, (30, 60), seed=3), plan(30, (30, 60), seed=3)
    assert a == b and a != plan(30, (30, 60), seed=4)
    times = [s.t for s in a]
    assert 30 <= times[0] <= 60 and times[-1] <= 30 * 60
    assert all(30 - 1e-6 <= y - x <= 60 + 1e-6 for x, y in zip(times, times[1:], strict=False))
    with pytest.raises(ValueError, match="--minutes"):
        plan(0, (30, 60), seed=0)


def test_thirty_minutes_always_hold_five_controller_kills_spread_out() -> None:
    """The acceptance asks >= 5 controller kills in 30 minutes at 30-60 s: true for every seed, not on average."""
    for seed in range(200):
        slots = plan(30, (30, 60), seed)
        ctl = [i for i, s in enumerate(slots) if s.controller]
        assert len(ctl) >= 5 and len(ctl) == max(1, round(len(slots) * 0.2)), seed
        # one per equal stretch of the plan: never two in the same fifth-or-smaller stretch
        n = len(slots)
        stretches = [(k * n) // len(ctl) for k in range(len(ctl) + 1)]
        assert all(stretches[k] <= ctl[k] < stretches[k + 1] for k in range(len(ctl))), seed
    assert sum(s.controller for s in plan(1, (20, 30), 0)) == 1  # a short plan still kills it once


def _procs() -> list[ProcInfo]:
    ctl = [PY, "-m", "flashrl.cli", "run", "configs/tools.toml", "--set", "run.name=run"]
    eng = [PY, "-m", "flashrl.engine.server"]
    return [
        ProcInfo(pid=10, ppid=1, cmdline=ctl),                              # the controller (the supervisor is 1)
        ProcInfo(pid=11, ppid=10, cmdline=eng), ProcInfo(pid=12, ppid=10, cmdline=eng),
        ProcInfo(pid=13, ppid=11, cmdline=eng),                             # vLLM's engine core, forked: part of 11
        ProcInfo(pid=14, ppid=10, cmdline=[PY, "-m", "flashrl.trainer.worker"]),
        ProcInfo(pid=15, ppid=10, cmdline=[PY, "-m", "envs.remote"]),
        ProcInfo(pid=16, ppid=15, cmdline=["sh", "-c", "sandboxed"]),       # the env worker's own child
        ProcInfo(pid=17, ppid=10, cmdline=[PY, "-m", "flashrl.rewards", "--spec", "x"]),
        ProcInfo(pid=18, ppid=10, cmdline=[PY, "-c", "from multiprocessing import ..."]),
        ProcInfo(pid=19, ppid=99, cmdline=ctl),                             # a run not under this supervisor
        ProcInfo(pid=20, ppid=1, cmdline=[*ctl, "--supervise"]),            # a supervisor is not a controller
    ]


def test_targets_by_kind_from_the_process_tree() -> None:
    t = targets(_procs(), supervisor_pid=1)
    assert {k: [p.pid for p in v] for k, v in t.items()} == {
        "engine": [11, 12], "trainer": [14], "env": [15], "reward": [17], "controller": [10]}
    assert classify([PY, "-m", "flashrl.rewardmodel.worker", "--model", "m"]) == "reward"
    assert classify([PY, "-m", "flashrl.cli", "bench", "chaos"]) is None
    assert classify(["flashrl", "run", "x.toml"]) is None  # only what Child.spawn starts (python -m ...)


def test_a_slot_draws_a_kind_the_run_has_and_waits_for_one_alive() -> None:
    alive = targets(_procs(), supervisor_pid=1)
    rng = random.Random(0)
    ctl = Slot(t=1, controller=True)
    assert draw_kind(rng, ctl, set()) == "controller"
    assert pick(rng, "controller", alive, controller_ok=False) is None  # no checkpoint yet: it waits
    assert (pick(rng, "controller", alive, controller_ok=True) or ProcInfo(0, 0, [])).pid == 10
    any_slot = Slot(t=1, controller=False)
    assert draw_kind(rng, any_slot, set()) is None  # nothing seen yet
    seen = {"engine", "trainer", "env", "controller"}
    assert {draw_kind(rng, any_slot, seen) for _ in range(200)} == {"engine", "trainer", "env"}  # never the controller
    # restarting: only engines and the trainer alive; an env slot waits, then takes a kind alive
    starting = {"engine": alive["engine"], "trainer": alive["trainer"], "controller": alive["controller"]}
    assert pick(rng, "env", starting, controller_ok=True) is None
    assert {redraw(rng, starting) for _ in range(50)} == {"engine", "trainer"}
    assert redraw(rng, {"controller": alive["controller"]}) is None
    assert {(pick(rng, "engine", alive, True) or ProcInfo(0, 0, [])).pid for _ in range(50)} == {11, 12}


def test_lineage_flags_a_step_trained_twice_and_a_missing_one() -> None:
    rows = [{"step": s} for s in (0, 1, 2, 3, 3, 4, 6)]
    lin = lineage(rows, steps_asked=6)
    assert lin["trained_twice"] == [3] and lin["missing"] == [5] and not lin["ok"]
    assert lineage([{"step": s} for s in range(7)], steps_asked=6)["ok"]
    assert not lineage([{"step": s} for s in range(5)], steps_asked=6)["ok"]  # ended early: 5, 6 missing
    assert lineage([{"step": s} for s in range(5)], steps_asked=6)["missing"] == [5, 6]


def test_time_lost_per_kill_against_the_all_up_step_time() -> None:
    """Each kill owns the stretch to the next kill (or the end): its length less the new steps made x the
    step time; the first new step may be the dying controller's in-flight one, so recovery is the second."""
    prog = [(float(t), t) for t in range(0, 11)] + [(10.7, 11), (20.0, 12), (21.0, 13), (30.0, 14), (31.0, 15)]
    kills = [{"t": 10.5, "kind": "trainer"}, {"t": 21.5, "kind": "controller"}, {"t": 25.0, "kind": "engine"}]
    assert step_time([], prog) == 1.0 and step_time([{"row": {"time/step_s": 0.5}}], prog) == 0.5
    rows = kill_costs(kills, prog, 1.0, end_t=32.0)
    assert [r["window_s"] for r in rows] == [11.0, 3.5, 7.0]
    assert [r["steps_made"] for r in rows] == [3, 0, 2]
    assert rows[0]["recovered_s"] == 9.5 and rows[0]["lost_s"] == 8.0 and not rows[0]["overlapped"]
    assert rows[1]["recovered_s"] is None and rows[1]["overlapped"] and rows[1]["lost_s"] == 3.5
    assert rows[2]["lost_s"] == 5.0 and rows[2]["recovered_s"] == 6.0


def test_steps_redone_are_the_lines_not_in_the_lineage() -> None:
    final = [{"step": 0}, {"step": 1, "x": "b"}, {"step": 2, "x": "b"}]
    history = [{"t": 1, "row": {"step": 0}}, {"t": 2, "row": {"step": 1, "x": "a", "tokens/trained": 7}},
               {"t": 3, "row": {"step": 0}},  # the resumed run's copy of the kept line
               {"t": 4, "row": {"step": 1, "x": "b"}}, {"t": 5, "row": {"step": 2, "x": "b"}}]
    assert redone(history, final) == [{"step": 1, "x": "a", "tokens/trained": 7}]


# --------------------------------------------------------------------------- a run folder, by hand


def _write(out: Path, *, steps: list[int], uids: dict[int, list[int]], next_uid: int, kills: list[dict[str, Any]],
           left: list[dict[str, Any]] | None = None, acc: float = 0.8, exit_code: int = 0,
           run_kinds: list[str] | None = None) -> Path:
    run = out / "run"
    (out / "chaos").mkdir(parents=True)
    run.mkdir(parents=True)
    rows = []
    for i, s in enumerate(steps):
        r: dict[str, Any] = {"step": s, "time/elapsed_s": float(i)}
        if s in uids:
            r["prompt_uids"] = uids[s]
        rows.append(r)
    rows[0]["eval/accuracy"] = 0.5
    rows[-1]["eval/accuracy"] = acc
    rows[-1]["count/resume/regenerated_tokens"] = 40
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    thrown = {"step": 3, "prompt_uids": [99], "tokens/trained": 100, "time/elapsed_s": 2.5}  # trained, then the controller died
    hist = [{"t": 10.0 + i, "row": r} for i, r in enumerate(rows[:4])] + [{"t": 14.0, "row": thrown}]
    hist += [{"t": 40.0 + i, "row": r} for i, r in enumerate(rows[3:])]
    (out / "chaos" / "steps.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    (out / "chaos" / "kills.jsonl").write_text("".join(json.dumps(k) + "\n" for k in kills))
    (out / "chaos" / "exit.json").write_text(json.dumps({"exit_code": exit_code, "left": left or [], "window_s": 60, "end_t": 50.0,
                                                          "run_kinds": run_kinds or ["controller", "engine"]}))
    (run / "config.toml").write_text("[rollout]\ngroup_size = 4\n")
    (run / "final_controller.json").write_text(json.dumps({"next_uid": next_uid, "readmit": [], "dropped_uids": [],
                                                          "counters": {}}))
    (run / "supervisor.log").write_text(
        "2026-11-28 09:00:00 supervisor: death 1: the controller (pid 42) was killed by SIGKILL; restart 1 of 1000 "
        "in 2 s, --resume from step-2. Last lines of x: y\n"
        "2026-11-28 09:00:10 supervisor: killed 3 process(es) the dead controller had started (pids [1, 2, 3])\n")
    base = out / "baseline"
    base.mkdir()
    (base / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n"
                                        + json.dumps({"step": max(steps), "eval/accuracy": 0.79}) + "\n")
    return run


KILLS = [{"t": 14.5, "kind": "controller", "pid": 42, "step": 3, "newest_step": 2},
         {"t": 45.5, "kind": "engine", "pid": 43, "step": 6}]


def _report(out: Path, **kw: Any) -> dict[str, Any]:
    run = _write(out, **kw)
    return analyze(load(out, run, out / "baseline", steps_asked=6), min_controller_kills=1)


def test_a_clean_run_passes_and_counts_what_it_cost(tmp_path: Path) -> None:
    uids = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}
    rep = _report(tmp_path, steps=list(range(7)), uids=uids, next_uid=12, kills=KILLS)
    assert rep["pass"], rep["checks"]
    assert rep["kills"] == {"engine": 1, "trainer": 0, "env": 0, "reward": 0, "controller": 1}
    assert rep["samples_lost"] == 0 and rep["prompts"]["trained_prompts"] == 12
    assert rep["tokens_regenerated"] == {"total": 140, "resume_counter": 40, "steps_redone": 1, "steps_redone_tokens": 100}
    assert rep["controller_deaths"] == [{"n": 1, "pid": 42, "cause": "was killed by SIGKILL"}]
    assert rep["reaped_by_supervisor"] == 3
    assert rep["accuracy"]["diff_points"] == 1.0
    # controller killed at 14.5, engine at 45.5, run ended at 50: new steps 4, 5 (41, 42), 6 (43) in the first
    # stretch (31 s, step time 1 s: 28 s lost), none after the engine kill (4.5 s, overlapped)
    assert rep["time_lost"]["per_kind"]["controller"]["lost_s_median"] == 28.0
    assert rep["time_lost"]["per_kind"]["engine"] == {"kills": 1, "lost_s_median": None, "lost_s_max": None,
                                                      "measured_alone": 0, "lost_s_total": 4.5}
    md = markdown(rep, "flashrl bench chaos --minutes 1")
    assert "**PASS**" in md and "| controller | 1 | 1 | 28.0 |" in md


def test_a_step_trained_twice_and_a_missing_step_fail_the_report(tmp_path: Path) -> None:
    uids = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}
    rep = _report(tmp_path, steps=[0, 1, 2, 3, 3, 4, 6], uids=uids, next_uid=12, kills=KILLS)
    assert not rep["pass"]
    assert rep["lineage"]["trained_twice"] == [3] and rep["lineage"]["missing"] == [5]
    assert not rep["checks"]["every_step_trained_once"]
    # step 3's prompts were trained twice; step 5's never: 2 prompts of 4 samples lost
    assert {r["uid"] for r in rep["prompts"]["repeated"]} == {4, 5}
    assert rep["prompts"]["lost"] == [8, 9] and rep["samples_lost"] == 8
    assert not rep["checks"]["every_prompt_trained_once"] and not rep["checks"]["no_sample_lost"]
    assert "**FAIL**" in markdown(rep, "x")


def test_a_process_left_a_lost_accuracy_and_too_few_controller_kills_fail(tmp_path: Path) -> None:
    uids = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}
    run = _write(tmp_path, steps=list(range(7)), uids=uids, next_uid=12, kills=KILLS[1:],
                 left=[{"pid": 7, "cmdline": "python -m flashrl.engine.server"}], acc=0.7, exit_code=1,
                 run_kinds=["controller", "engine", "env"])
    rep = analyze(load(tmp_path, run, tmp_path / "baseline", steps_asked=6), min_controller_kills=5)
    assert {k for k, v in rep["checks"].items() if not v} == {
        "run_finished", "no_process_left", "controller_kills_ge_5", "accuracy_within_3_points", "every_kind_killed"}
    assert rep["accuracy"]["diff_points"] == -9.0


def test_no_final_checkpoint_is_a_failure_that_says_why(tmp_path: Path) -> None:
    uids = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}
    run = _write(tmp_path, steps=list(range(7)), uids=uids, next_uid=12, kills=KILLS)
    (run / "final_controller.json").unlink()
    rep = analyze(load(tmp_path, run, None, steps_asked=6))
    assert not rep["checks"]["every_prompt_trained_once"] and "no final checkpoint" in rep["prompts"]["why"]
    assert "accuracy_within_3_points" not in rep["checks"]  # no baseline: no comparison


def test_records_default_to_empty() -> None:
    rep = analyze(Records(metrics=[], history=[], kills=[], final_state={}))
    assert not rep["pass"] and rep["lineage"]["last_step"] == -1


def test_a_report_computed_again_against_a_baseline_that_ran_beside(tmp_path: Path) -> None:
    """``--report-only``: a chaos run with --steps and no baseline, its undisturbed run made beside it; the report
    computed again from the records compares the accuracy and keeps the first command."""
    from flashrl.bench.chaos_soak import report_again

    uids = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}
    run = _write(tmp_path, steps=list(range(7)), uids=uids, next_uid=12, kills=KILLS)
    rep = analyze(load(tmp_path, run, None, steps_asked=6), min_controller_kills=1)
    rep.update(command="flashrl bench chaos --steps 6", config="c.toml", seed=0, minutes=1, every=[30, 60],
               planned={"kills": 2, "controller": 1})
    (tmp_path / "report.json").write_text(json.dumps(rep))
    assert "accuracy_within_3_points" not in rep["checks"]
    assert report_again(tmp_path, "flashrl bench chaos --report-only", str(tmp_path / "baseline")) == 0
    again = json.loads((tmp_path / "report.json").read_text())
    assert again["checks"]["accuracy_within_3_points"] and again["accuracy"]["diff_points"] == 1.0
    assert again["command"] == "flashrl bench chaos --steps 6" and again["report_command"].endswith("--report-only")
    assert "**PASS**" in (tmp_path / "report.md").read_text()
    (tmp_path / "report.json").unlink()
    with pytest.raises(RuntimeError, match="give the --out folder of a finished"):
        report_again(tmp_path, "x", None)


# --------------------------------------------------------------------------- issue 51: restarts and the early kill
def test_the_early_kill_is_seeded_before_the_first_checkpoint() -> None:
    """The bench kills the controller once before the first ``latest``: a seeded step in the first half of
    the first checkpoint interval (run.checkpoint_every from the run's --set, the last one winning)."""
    steps = {early_kill_step(seed, 10) for seed in range(200)}
    assert steps == {1, 2, 3, 4, 5}
    assert early_kill_step(7, 10) == early_kill_step(7, 10) and early_kill_step(0, 1) == 1
    assert checkpoint_every(["run.seed=0", "run.checkpoint_every=10", "run.checkpoint_every = 4"]) == 4
    assert checkpoint_every(["run.seed=0"]) == 10


LOG = ("x supervisor: death 1: the controller (pid 10) was killed by SIGKILL; restart 1 of 1000 in 2 s, fresh start: "
       "no complete checkpoint in /r/run.x/checkpoints. Last lines of /r/logs/controller.log: a | b\n"
       "x supervisor: death 2: the controller (pid 11) was killed by SIGKILL; restart 2 of 1000 in 2 s, --resume from "
       "step-20. Last lines of /r/logs/controller.log: c\n"
       "x supervisor: the run finished at step 60 (/r/checkpoints/step-60), though its controller (pid 12) was killed "
       "by SIGKILL after that checkpoint; not restarted\n")


def test_each_restart_must_resume_the_newest_complete_checkpoint() -> None:
    """A kill with a complete checkpoint (``latest`` or not) is resumed from it or a newer one; a fresh start only
    when there was none: the restart of 7feef93 (fresh over a complete step-20 whose ``latest`` was gone) fails."""
    kills = [{"kind": "controller", "pid": 10, "newest_step": 0, "early": True},
             {"kind": "engine", "pid": 99, "newest_step": 20},
             {"kind": "controller", "pid": 11, "newest_step": 20},
             {"kind": "controller", "pid": 12, "newest_step": 60}]
    got = restarts(LOG, kills)
    assert got["ok"] and [r["plan"] for r in got["controller_kills"]] == [
        "fresh start: no complete checkpoint in /r/run.x/checkpoints", "--resume from step-20", "finished at step-60"]
    old = LOG.replace("--resume from step-20", "fresh start: no complete checkpoint in /r/checkpoints")
    bad = restarts(old, kills)
    assert not bad["ok"] and [r["pid"] for r in bad["wrong"]] == [11]
    assert not restarts(LOG.replace("step-20", "step-10"), kills)["ok"]  # an older checkpoint than there was
    assert not restarts("", kills[2:3])["ok"]  # a kill with no restart logged after it
    # killed between step-30's rename and its pointer's write: the pointer (step-20) is what a resume takes
    assert restarts(LOG, [{"kind": "controller", "pid": 11, "newest_step": 30, "latest_step": 20}])["ok"]
    assert not restarts(LOG, [{"kind": "controller", "pid": 11, "newest_step": 30}])["ok"]  # no pointer: step-30


def test_a_complete_checkpoint_set_aside_and_a_missed_early_kill_fail_the_report(tmp_path: Path) -> None:
    uids = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}
    run = _write(tmp_path, steps=list(range(7)), uids=uids, next_uid=12, kills=KILLS)
    meta = json.loads((tmp_path / "chaos" / "exit.json").read_text())
    meta["early_kill"] = {"step": 3, "done": True, "at_step": 3, "latest_deleted": False}
    (tmp_path / "chaos" / "exit.json").write_text(json.dumps(meta))
    (run / "set_aside.json").write_text(json.dumps({"checkpoints.1764": []}))  # a killed save only: fine
    rep = analyze(load(tmp_path, run, tmp_path / "baseline", steps_asked=6), min_controller_kills=1)
    assert rep["pass"] and rep["checks"]["killed_before_the_first_latest"], rep["checks"]
    assert "| kill before the first `latest` | after step 3 |" in markdown(rep, "x")
    (run / "set_aside.json").write_text(json.dumps({"checkpoints.1764": [10, 20]}))
    meta["early_kill"] = {"step": 3, "done": False}
    (tmp_path / "chaos" / "exit.json").write_text(json.dumps(meta))
    rep = analyze(load(tmp_path, run, tmp_path / "baseline", steps_asked=6), min_controller_kills=1)
    assert {k for k, v in rep["checks"].items() if not v} == {"no_complete_checkpoint_set_aside",
                                                              "killed_before_the_first_latest"}
    assert "| complete checkpoints set aside | **2** |" in markdown(rep, "x")
