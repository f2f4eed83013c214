"""`flashrl run --supervise` with the real parts: the controller SIGKILLed mid-run is restarted from its
latest checkpoint and the run ends with every step trained once; a SIGTERM to the supervisor stops it all and
restarts nothing. The decisions alone: tests/unit/test_supervise.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashrl.bench.chaos_report import verify_prompts
from flashrl.checkpoint import list_checkpoints
from flashrl.supervise import leftovers

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 60


def _start(tmp: Path, out: Path, steps: int = 200) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--supervise",
           "--set", f"run.output_dir={tmp}", "--set", "run.name=sup", "--set", f"run.steps={steps}",
           "--set", "run.checkpoint_every=10", "--set", "run.eval_every=50",
           "--set", "run.dashboard=plain", "--set", "run.max_time_s=0"]
    env = {**os.environ, "FLASHRL_PARENT_PID": str(os.getpid())}  # dies with this test
    with out.open("wb") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for(what: str, ok, deadline_s: float, sup: subprocess.Popen[bytes], out: Path):  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = ok()
        if got:
            return got
        if sup.poll() is not None:
            pytest.fail(f"the supervisor exited ({sup.returncode}) before {what}:\n{out.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {deadline_s} s:\n{out.read_text()[-3000:]}")


def _controllers(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(p) for p in re.findall(r"started the controller \(pid (\d+)", text)]


def _finish(sup: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return sup.wait(timeout)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait()


@pytest.mark.timeout(1500)
def test_a_controller_killed_without_latest_resumes_from_the_newest_step_and_trains_each_prompt_once(
        tmp_path: Path) -> None:
    """Issue 51's scenario: ``latest`` deleted after step 20 (what read_latest's own error tells a user to
    do, and what a crash between a checkpoint's rename and its pointer write leaves), then the controller
    SIGKILLed. The restart resumes from the newest complete step-N folder: nothing set aside, the lines
    kept before the kill kept byte for byte, each step and each prompt trained once in the lineage."""
    run_dir, out = tmp_path / "sup", tmp_path / "out.txt"
    log, ckpts = run_dir / "supervisor.log", run_dir / "checkpoints"

    def at_least_20() -> bool:
        with contextlib.suppress(OSError, ValueError):
            return int((ckpts / "latest").read_text().strip().removeprefix("step-")) >= 20
        return False

    sup = _start(tmp_path, out, steps=STEPS)
    try:
        _wait_for("checkpoint step-20", at_least_20, 600, sup, out)
        (ckpts / "latest").unlink()
        first = _controllers(log)[0]
        os.kill(first, signal.SIGKILL)
        newest = max(s for s, p in list_checkpoints(ckpts) if (p / "controller.json").exists())
        kept = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= newest]
        _wait_for("a restart", lambda: len(_controllers(log)) >= 2, 120, sup, out)
        assert _finish(sup, 600) == 0, out.read_text()[-3000:]
    finally:
        _finish(sup, 0.1) if sup.poll() is None else None
    text = log.read_text()
    assert f"death 1: the controller (pid {first}) was killed by SIGKILL; restart 1 of 10" in text, text
    assert f"attempt 2, --resume from step-{newest}" in text, text
    assert "the run finished" in text and "1 restart(s)" in text, text
    aside = sorted(p.name for p in run_dir.iterdir() if re.match(r"(checkpoints|metrics|samples)\.\d", p.name))
    assert aside == [], f"a restart set progress aside: {aside}"  # 7feef93: checkpoints.<t> (step-10, step-20)
    assert f"resuming from {ckpts / f'step-{newest}'}" in (run_dir / "logs" / "controller.log").read_text()
    lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert lines[:len(kept)] == kept  # the lineage before the kill, as it was
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))  # no step missing, none twice
    final = json.loads((ckpts / f"step-{STEPS}" / "controller.json").read_text())
    prompts = verify_prompts(rows, final)
    assert prompts["ok"] and prompts["repeated"] == [] and prompts["lost"] == [], prompts  # once each, none lost
    assert prompts["trained_prompts"] == sum(len(r["prompt_uids"]) for r in rows[1:]) > 0
    for pid in [*_controllers(log), sup.pid]:
        assert leftovers(pid) == [], f"processes of {pid} outlived the run"


@pytest.mark.timeout(600)
def test_sigterm_to_the_supervisor_stops_the_run_and_restarts_nothing(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "sup", tmp_path / "out.txt"
    log = run_dir / "supervisor.log"
    sup = _start(tmp_path, out)
    try:
        _wait_for("a checkpoint", lambda: (run_dir / "checkpoints" / "latest").exists(), 300, sup, out)
        os.kill(sup.pid, signal.SIGTERM)
        assert _finish(sup, 120) == 130, out.read_text()[-3000:]
    finally:
        _finish(sup, 0.1) if sup.poll() is None else None
    text = log.read_text()
    assert "got SIGTERM: stopping the run" in text and "not restarted" in text, text
    assert "death" not in text and len(_controllers(log)) == 1, text
    for pid in [*_controllers(log), sup.pid]:
        assert leftovers(pid) == [], f"processes of {pid} outlived the run"
