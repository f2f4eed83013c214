"""The supervisor's loop (flashrl/supervise.py) with real processes but no model: stand-in controllers (a few
lines of Python each) and the restart plan computed the real way (``python -m flashrl.supervise plan``) on
checkpoints a controller on fakes wrote. Seconds each; the real run is tests/integration/test_supervise.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from flashrl.config import Config, to_toml
from flashrl.resuming import RestartPlan
from flashrl.supervise import Supervisor, plan_in_child
from tests.unit.test_checkpoint import _checkpointed_run

KILL_SELF = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def _config_file(cfg: Config, tmp: Path) -> Path:
    path = tmp / "run.toml"
    path.write_text(to_toml(cfg))
    return path


def _run(sup: Supervisor) -> int:
    return asyncio.run(asyncio.wait_for(sup.run(), 120))


@pytest.mark.timeout(300)
def test_the_plan_child_uses_the_resume_rule(tmp_path: Path) -> None:
    """The plan, computed in its own process: a complete step folder without ``latest`` is resumed, a
    checkpoint at run.steps is a finished run, an unreadable pointer is an error naming the fix."""
    cfg = _checkpointed_run(tmp_path)  # run.steps 4: step-3 and step-4 kept
    config, root = _config_file(cfg, tmp_path), cfg.run_dir / "checkpoints"
    done = asyncio.run(plan_in_child(config, []))
    assert (done.action, done.step, done.checkpoint) == ("finished", 4, str(root / "step-4"))
    (root / "latest").unlink()
    assert asyncio.run(plan_in_child(config, ["run.steps=6"])) == RestartPlan(
        action="resume", checkpoint=str(root / "step-4"), step=4)
    (root / "latest").write_text("garbage")
    from flashrl.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="delete the file to resume from the newest complete checkpoint"):
        asyncio.run(plan_in_child(config, ["run.steps=6"]))


@pytest.mark.timeout(300)
def test_a_controller_killed_after_its_final_checkpoint_ends_the_run_as_finished(tmp_path: Path) -> None:
    """Issue 51: the controller dies (SIGKILL) after writing its last checkpoint: the supervisor exits 0,
    saying the run finished and where its policy is; nothing is restarted (at 7feef93: a restart with
    --resume, refused "nothing left to train", and exit 2)."""
    cfg = _checkpointed_run(tmp_path)
    config = _config_file(cfg, tmp_path)
    started: list[RestartPlan] = []

    def command(plan: RestartPlan) -> list[str]:
        started.append(plan)
        return [sys.executable, "-c", KILL_SELF]

    sup = Supervisor(command, cfg.run_dir, lambda: plan_in_child(config, []), max_restarts=3, first_backoff_s=0.1)
    assert _run(sup) == 0
    text = (cfg.run_dir / "supervisor.log").read_text()
    assert len(started) == 1, text
    assert "the run finished at step 4" in text and "was killed by SIGKILL after that checkpoint" in text, text
    assert f"flashrl export {cfg.run_dir} --step 4 --out DIR" in text, text


@pytest.mark.timeout(300)
def test_a_restart_resumes_the_folder_it_names_and_is_marked_a_restart(tmp_path: Path) -> None:
    """No ``latest``: the restart's command resumes step-4 by its path, the log line says so, and the
    restarted controller runs with FLASHRL_SUPERVISED_RESTART (a fresh start would refuse to set it aside)."""
    cfg = _checkpointed_run(tmp_path)
    config, root = _config_file(cfg, tmp_path), cfg.run_dir / "checkpoints"
    (root / "latest").unlink()
    check = ("import os, sys; assert os.environ.get('FLASHRL_SUPERVISED_RESTART') == '1', 'not marked'; "
             f"assert sys.argv[1:] == [{str(root / 'step-4')!r}, '--resume'], sys.argv")
    cmds: list[list[str]] = []

    def command(plan: RestartPlan) -> list[str]:
        if plan.action == "fresh":
            cmds.append([sys.executable, "-c", "import os; assert 'FLASHRL_SUPERVISED_RESTART' not in os.environ; "
                         + KILL_SELF])
        else:
            cmds.append([sys.executable, "-c", check, plan.checkpoint, "--resume"])
        return cmds[-1]

    sup = Supervisor(command, cfg.run_dir, lambda: plan_in_child(config, ["run.steps=6"]), max_restarts=3,
                     first_backoff_s=0.1)
    assert _run(sup) == 0, (cfg.run_dir / "supervisor.log").read_text()
    text = (cfg.run_dir / "supervisor.log").read_text()
    assert "attempt 1, fresh start: as asked (no --resume)" in text, text
    assert "restart 1 of 3 in 0 s, --resume from step-4" in text and "attempt 2, --resume from step-4" in text, text
    assert "the run finished (controller pid" in text and len(cmds) == 2


@pytest.mark.timeout(300)
def test_a_final_failure_stops_the_supervisor_at_once_and_names_it(tmp_path: Path) -> None:
    """A controller that exits FINAL_EXIT with its failure recorded (launch/driver.py): no restart, the
    supervisor exits 3 naming it (at 7feef93: exit 1, restarted up to --max-restarts times)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = ('{"error": "JudgeDown", "message": "every judge engine is down for good: judge.max_restarts = 5 '
              'spent", "exit_code": 3}')
    script = f"import pathlib, sys; pathlib.Path({str(run_dir / 'failure.json')!r}).write_text({record!r}); sys.exit(3)"
    starts = []

    def command(plan: RestartPlan) -> list[str]:
        starts.append(plan)
        return [sys.executable, "-c", script]

    async def no_plan() -> RestartPlan:
        raise AssertionError("a final failure is not restarted")

    sup = Supervisor(command, run_dir, no_plan, max_restarts=10, first_backoff_s=0.1)
    assert _run(sup) == 3
    text = (run_dir / "supervisor.log").read_text()
    assert len(starts) == 1 and "death" not in text, text
    assert ("exited with code 3: a final failure (JudgeDown: every judge engine is down for good: judge.max_restarts "
            "= 5 spent); a restart would fail the same way: not restarted") in text, text
