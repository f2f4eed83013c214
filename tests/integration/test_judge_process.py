"""The judge's engine processes for real: `flashrl run` with a judge (an untrained built-in LM: its verdicts
mostly do not parse, which is counted) whose engine is SIGKILLed mid-run: every step finishes once, the death
is named, the retries and the restart are counted, and nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flashrl.metrics import read_jsonl
from tests.helpers import engine_processes, killed_on_exit, wait_while_running

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.timeout(1500)
def test_a_killed_judge_engine_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    from flashrl.models.tiny import build_untrained

    judge = build_untrained(tmp_path / "judge", seed=3)
    steps = 12
    cmd = [
        sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "judge.toml"),
        "--set", f"run.output_dir={tmp_path}", "--set", "run.name=jkill", "--set", f"run.steps={steps}",
        "--set", "run.max_time_s=0", "--set", "run.eval_every=0", "--set", "env.eval_size=16",
        "--set", "run.dashboard=plain", "--set", f'judge.model="{judge}"', "--set", 'judge.on_unparsable="default"',
        "--set", "run.checkpoint_every=0", "--set", "rollout.turn_timeout_s=300",
    ]
    out_file = (tmp_path / "out.txt").open("wb")  # a file, not a pipe: nobody reads a pipe until the end
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "jkill" / "metrics.jsonl"
    seen: list[psutil.Process] = []
    with killed_on_exit(proc):
        def at_step(n: int):  # type: ignore[no-untyped-def]
            return lambda: metrics.exists() and any(r.get("step", 0) >= n for r in read_jsonl(metrics))

        wait_while_running("training step 2", at_step(2), proc, 900)
        first = wait_while_running("the judge engine", lambda: engine_processes(proc.pid, "judge0"), proc, 30)[0]
        seen += psutil.Process(proc.pid).children(recursive=True)
        first.send_signal(signal.SIGSTOP)  # stopped, so the kill lands with verdicts in flight
        time.sleep(1.0)
        os.killpg(first.pid, signal.SIGKILL)
        second = wait_while_running("a restarted judge engine", lambda: [p for p in engine_processes(proc.pid, "judge0") if p.pid != first.pid],
                       proc, 300)[0]
        seen.append(second)
        proc.wait(timeout=900)
    out_file.close()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, out[-3000:]
    rows = [r for r in read_jsonl(metrics) if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    last = rows[-1]
    assert last["env/judge_engine_died"] == 1 and last["env/judge_engine_restarts"] == 1, last
    assert last["env/judge_retries"] >= 1 and last["env/judge_engines_started"] == 2
    assert last.get("env/judge_failed", 0) == 0  # every verdict came in the end: no episode failed for it
    assert last["env/judge_verdicts"] > 0 and "env/judge_tokens" in last
    assert all("reward/judge_gap" in r for r in rows)
    log = (tmp_path / "jkill" / "logs" / "controller.log").read_text()
    assert f"judge engine 0 (pid {first.pid}) died (exit code -9)" in log
    time.sleep(0.5)
    alive = [c for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running: {[(c.pid, c.cmdline()) for c in alive]}"


@pytest.mark.timeout(900)
def test_a_judge_that_cannot_come_back_stops_the_run_naming_it(tmp_path: Path) -> None:
    """judge.max_restarts = 0 and its one engine SIGKILLed: no verdict can ever come, so the run stops at once
    with JudgeDown (not a wait per verdict up to judge.startup_timeout_s), non-zero, and leaves nothing running."""
    from flashrl.models.tiny import build_untrained

    judge = build_untrained(tmp_path / "judge", seed=3)
    cmd = [
        sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "judge.toml"),
        "--set", f"run.output_dir={tmp_path}", "--set", "run.name=jdown", "--set", "run.steps=200",
        "--set", "run.max_time_s=0", "--set", "run.eval_every=0", "--set", "env.eval_size=16",
        "--set", "run.dashboard=plain", "--set", f'judge.model="{judge}"', "--set", 'judge.on_unparsable="default"',
        "--set", "run.checkpoint_every=0", "--set", "judge.max_restarts=0",
    ]
    out_file = (tmp_path / "out.txt").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "jdown" / "metrics.jsonl"
    seen: list[psutil.Process] = []
    with killed_on_exit(proc):
        wait_while_running("training step 2", lambda: metrics.exists() and any(r.get("step", 0) >= 2 for r in read_jsonl(metrics)),
              proc, 900)
        first = wait_while_running("the judge engine", lambda: engine_processes(proc.pid, "judge0"), proc, 30)[0]
        seen += psutil.Process(proc.pid).children(recursive=True)
        os.killpg(first.pid, signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=300)
        stopped_s = time.monotonic() - t0
    out_file.close()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode != 0, out[-3000:]
    assert "JudgeDown" in out and "judge.max_restarts = 0" in out, out[-3000:]
    assert stopped_s < 120, stopped_s  # the judge's startup_timeout_s is 600
    assert max(r.get("step", 0) for r in read_jsonl(metrics)) < 200
    time.sleep(0.5)
    alive = [c for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running: {[(c.pid, c.cmdline()) for c in alive]}"
