"""The supervisor's decisions (flashrl/supervise.py); the real controller kills are tests/integration/test_supervise.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrl.supervise import backoff, controller_command, decide, latest_checkpoint, leftovers, streak_after


@pytest.mark.parametrize(("code", "stopping", "restarts", "want"), [
    (0, False, 0, "done"),
    (130, False, 0, "stopped"),  # the controller's own Ctrl-C / SIGTERM: the user meant it
    (2, False, 0, "refused"),  # a config the launcher cannot run fails the same way again
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


def test_latest_checkpoint_names_the_pointer(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) == ""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-40\n")
    assert latest_checkpoint(tmp_path) == "step-40"


def test_leftovers_are_the_processes_that_name_the_dead_parent(tmp_path: Path) -> None:
    for pid, env in {"11": b"A=1\0FLASHRL_PARENT_PID=7\0", "12": b"FLASHRL_PARENT_PID=77\0",
                     "13": b"X=FLASHRL_PARENT_PID=7\0", "14": b"FLASHRL_PARENT_PID=7"}.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "environ").write_bytes(env)
    (tmp_path / "self").mkdir()
    (tmp_path / "15").mkdir()  # gone between listing and reading: skipped
    assert sorted(leftovers(7, tmp_path)) == [11, 14]


def test_controller_command_resumes_only_from_a_checkpoint(tmp_path: Path) -> None:
    command = controller_command(Path("configs/tiny.toml"), ["run.steps=5"], tmp_path)
    assert command(False)[-4:] == ["run", "configs/tiny.toml", "--set", "run.steps=5"]
    assert "--resume" not in command(True)  # died before its first checkpoint: the run starts over
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-5")
    assert command(True)[-1] == "--resume" and "--resume" not in command(False)
