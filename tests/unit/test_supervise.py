"""The supervisor's decisions (flashrl/supervise.py) and the restart's plan (resuming.restart_plan) on checkpoints
written by a controller on fakes; the real controller kills are tests/integration/test_supervise.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flashrl.checkpoint import CheckpointError
from flashrl.resuming import RestartPlan, restart_plan
from flashrl.supervise import (
    backoff,
    controller_command,
    decide,
    failure_of,
    final_policy_note,
    latest_checkpoint,
    leftovers,
    streak_after,
)
from tests.unit.test_checkpoint import _checkpointed_run, with_run


@pytest.mark.parametrize(("code", "stopping", "restarts", "want"), [
    (0, False, 0, "done"),
    (130, False, 0, "stopped"),  # the controller's own Ctrl-C / SIGTERM: the user meant it
    (2, False, 0, "refused"),  # a config the launcher cannot run fails the same way again
    (3, False, 0, "final"),  # JudgeDown, AdapterRefused: final by their own definition (driver.FINAL_EXIT)
    (-9, False, 0, "restart"),  # SIGKILL (the OOM killer)
    (1, False, 9, "restart"),
    (1, False, 10, "give-up"),  # budget of 10 spent
    (-9, True, 0, "stopped"),  # killed while we were stopping it: never restarted
])
def test_decide(code: int, stopping: bool, restarts: int, want: str) -> None:
    assert decide(code, stopping, restarts, max_restarts=10) == want


def test_backoff_doubles_to_its_cap() -> None:
    assert [backoff(n, 2.0, 60.0) for n in (1, 2, 3, 4, 5, 6, 7)] == [2, 4, 8, 16, 32, 60, 60]


def test_the_backoff_starts_over_after_a_healthy_controller() -> None:
    """Quick deaths in a row double the wait; one that lived HEALTHY_S or wrote a checkpoint resets it (a chaos
    run of 3 minutes waited 2, 4, 8, 16, 32 and 60 s for six controllers that each trained for 20-60 s
    before this)."""
    streak = 0
    waits = []
    for lived, ckpt in ((5.0, False), (5.0, False), (5.0, False), (61.0, False), (5.0, False), (120.0, False),
                        (5.0, False), (30.0, True), (5.0, False)):
        streak = streak_after(streak, lived, ckpt, healthy_s=60.0)
        waits.append(backoff(streak, 2.0, 60.0))
    assert waits == [2, 4, 8, 2, 4, 2, 4, 2, 4]


def test_progress_is_the_newest_step_folder_with_or_without_the_pointer(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) == ""
    root = tmp_path / "checkpoints"
    for name in ("step-10", "step-40", "step-50.tmp"):
        (root / name).mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == "step-40"  # no ``latest`` (deleted, or a crash before its write)
    (root / "latest").write_text("step-10\n")
    assert latest_checkpoint(tmp_path) == "step-40"


def test_leftovers_are_the_processes_that_name_the_dead_parent(tmp_path: Path) -> None:
    for pid, env in {"11": b"A=1\0FLASHRL_PARENT_PID=7\0", "12": b"FLASHRL_PARENT_PID=77\0",
                     "13": b"X=FLASHRL_PARENT_PID=7\0", "14": b"FLASHRL_PARENT_PID=7"}.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "environ").write_bytes(env)
    (tmp_path / "self").mkdir()
    (tmp_path / "15").mkdir()  # gone between listing and reading: skipped
    assert sorted(leftovers(7, tmp_path)) == [11, 14]


def test_the_command_does_what_the_plan_says(tmp_path: Path) -> None:
    """The log line is the plan's describe(); the command resumes from the very folder the plan chose."""
    command = controller_command(Path("configs/tiny.toml"), ["run.steps=5"])
    fresh = RestartPlan(action="fresh", why=f"no complete checkpoint in {tmp_path}")
    assert command(fresh)[-4:] == ["run", "configs/tiny.toml", "--set", "run.steps=5"]
    assert fresh.describe() == f"fresh start: no complete checkpoint in {tmp_path}"
    step = str(tmp_path / "checkpoints" / "step-20")
    resume = RestartPlan(action="resume", checkpoint=step, step=20)
    assert command(resume)[-6:] == ["run", "configs/tiny.toml", step, "--set", "run.steps=5", "--resume"]
    assert resume.describe() == "--resume from step-20"
    asked = RestartPlan(action="resume", why="as asked")  # the user's own --resume: the latest, the controller checks
    assert command(asked)[-5:] == ["run", "configs/tiny.toml", "--set", "run.steps=5", "--resume"]


def test_a_restart_resumes_a_complete_step_folder_without_latest(tmp_path: Path) -> None:
    """Issue 51: the restart's rule is the resume's. A complete step-N folder counts without ``latest``; none
    left gives a fresh start; one at run.steps (or past run.max_time_s) is a finished run, not a restart."""
    cfg = _checkpointed_run(tmp_path)  # steps 4, a checkpoint each step, the last two kept: step-3, step-4
    root = cfg.run_dir / "checkpoints"
    done = restart_plan(cfg)
    assert (done.action, done.step) == ("finished", 4) and "nothing left to train" in done.why
    more = with_run(cfg, steps=6)
    assert restart_plan(more) == RestartPlan(action="resume", checkpoint=str(root / "step-4"), step=4)
    (root / "latest").unlink()  # a user following read_latest's advice, or a crash before the pointer's write
    assert restart_plan(more) == RestartPlan(action="resume", checkpoint=str(root / "step-4"), step=4)
    timed = with_run(more, max_time_s=0.001)
    assert restart_plan(timed).action == "finished" and "run.max_time_s" in restart_plan(timed).why
    (root / "step-4" / "controller.json").write_text("{")  # the newest corrupt: the one before
    assert restart_plan(more).checkpoint == str(root / "step-3")
    (root / "latest").write_text("garbage")
    with pytest.raises(CheckpointError, match="delete the file"):
        restart_plan(more)
    (root / "latest").unlink()
    (root / "step-3" / "controller.json").write_text("{")
    fresh = restart_plan(more)
    assert fresh.action == "fresh" and f"no complete checkpoint in {root} (2 unusable" in fresh.why


def test_a_final_failure_is_named_from_its_record_only_when_fresh(tmp_path: Path) -> None:
    assert failure_of(tmp_path, time.time()) == ""
    rec = tmp_path / "failure.json"
    rec.write_text(json.dumps({"error": "JudgeDown", "message": "every judge engine is down for good", "exit_code": 3}))
    assert failure_of(tmp_path, time.time()) == "JudgeDown: every judge engine is down for good"
    os.utime(rec, (time.time() - 600, time.time() - 600))  # an earlier controller's: not this one's
    assert failure_of(tmp_path, time.time()) == ""
    rec.write_text("{")
    assert failure_of(tmp_path, 0.0) == ""


def test_a_finished_run_says_where_its_policy_is(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints" / "step-60"
    ckpt.mkdir(parents=True)
    plan = RestartPlan(action="finished", checkpoint=str(ckpt), step=60)
    assert f"flashrl export {tmp_path} --step 60 --out DIR" in final_policy_note(tmp_path, plan)
    (tmp_path / "final").mkdir()
    assert final_policy_note(tmp_path, plan) == f"its final policy is in {tmp_path / 'final'}"
