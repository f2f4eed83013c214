"""`flashrl run --resume` with the real parts: vLLM engines, a trainer rank, DCP checkpoints.

Slow (two runs start their processes); the same logic on fakes, and the other faults, are in
tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from flashrl.checkpoint import list_checkpoints, read_latest
from flashrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

BATCH = 4


def _run(tmp: Path, steps: int, *extra: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f"run.output_dir={tmp}", "--set", "run.name=res", "--set", f"run.steps={steps}",
        "--set", "run.checkpoint_every=1", "--set", "run.keep_checkpoints=2", "--set", "run.eval_every=2",
        "--set", "run.dashboard=plain", "--set", "env.eval_size=8", "--set", "engine.count=1",
        "--set", "scheduler.async_ratio=0", "--set", f"rollout.batch_prompts={BATCH}", "--set", "rollout.group_size=4",
        *extra,
    ]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


@pytest.mark.timeout(900)
def test_resume_falls_back_past_a_truncated_checkpoint_and_trains_the_same_prompts(tmp_path: Path) -> None:
    """Run 3 synchronous steps (checkpoints 2 and 3 kept); truncate step-3's DCP data; `--resume` names it,
    resumes from step 2, and steps 3..5 train exactly the prompts the uninterrupted order gives them."""
    run_dir = tmp_path / "res"
    first = _run(tmp_path, 3)
    assert first.returncode == 0, first.stdout[-3000:]
    # the plain dashboard's lines (one per refresh: steps may be skipped) show the trainer's lr of their step:
    # tiny.toml's 20-step warm-up, 1e-4 * step / 20
    shown = [(int(m[1]), m[2]) for m in re.finditer(r"^step (\d+)/3 .* lr (\S+)", first.stdout, re.M)]
    assert shown and all(lr == f"{1e-4 * step / 20:.1e}" for step, lr in shown), first.stdout[-3000:]
    root = run_dir / "checkpoints"
    assert [n for n, _ in list_checkpoints(root)] == [2, 3] and read_latest(root) == root / "step-3"
    before = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(before) == [0, 1, 2, 3]

    data = next((root / "step-3" / "trainer").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    second = _run(tmp_path, 5, "--resume")
    out = second.stdout
    assert second.returncode == 0, out[-3000:]
    assert f"skipped a corrupt checkpoint: {data}: truncated: 1000 bytes" in out
    assert "resumed from step 2" in out and "done: res 5 steps (resumed from step 2)" in out
    assert "(evals of steps 0 -> 5)" in out  # the summary's accuracies say which evals they are
    assert (root / "step-3.abandoned").is_dir()  # the corrupt one is set aside, not overwritten
    assert [n for n, _ in list_checkpoints(root)] == [4, 5] and read_latest(root) == root / "step-5"

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # no duplicate, no missing step
    assert rows[:2] == [before[0], before[1]]  # lines up to the checkpoint kept as they were
    # step 2's eval was still running when checkpoint 2 was written: its line was dropped and the resumed
    # run wrote it again, evaluating the same (checkpointed) weights greedily: the same accuracy
    assert rows[2]["eval/accuracy"] == before[2]["eval/accuracy"] and rows[2]["loss"] == before[2]["loss"]
    for r in rows[1:]:
        # synchronous: step s trains the prompts (s-1)*B .. s*B-1, whatever run trains it
        assert sorted(r["prompt_uids"]) == list(range((r["step"] - 1) * BATCH, r["step"] * BATCH)), r["step"]
        # every sample on-policy: the resumed engine got the checkpoint's weights (version 2) first
        assert r["staleness/max"] == 0 and r["version"] == r["step"]
    assert sorted(rows[3]["prompt_uids"]) == sorted(before[3]["prompt_uids"])
    assert rows[-1].get("count/stale/dropped_samples", 0) == 0
    summary = msgspec.json.decode((run_dir / "summary.json").read_bytes())
    assert summary["resumed_from"] == 2 and summary["checkpoints"] == 3


@pytest.mark.timeout(900)
def test_controller_killed_while_a_checkpoint_is_written_resumes_from_the_previous_one(tmp_path: Path) -> None:
    """SIGKILL `flashrl run` while step-K is being written (its step-K.tmp folder exists, before the rename):
    step-K never appears, `latest` still names the checkpoint before, and `--resume` continues from that
    one (the half-written folder removed), with every step in metrics.jsonl once."""
    run_dir = tmp_path / "res"
    root = run_dir / "checkpoints"
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"),
           "--set", f"run.output_dir={tmp_path}", "--set", "run.name=res", "--set", "run.steps=100000",
           "--set", "run.checkpoint_every=2", "--set", "run.keep_checkpoints=5", "--set", "run.eval_every=0",
           "--set", "run.dashboard=plain", "--set", "env.eval_size=8", "--set", "engine.count=1",
           "--set", "rollout.batch_prompts=4", "--set", "rollout.group_size=4"]
    env = dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid()))
    out = tmp_path / "first.out"
    with open(out, "wb") as fh:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    killed_at = None
    try:
        deadline = time.monotonic() + 300
        while killed_at is None:
            assert p.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint write caught in progress within 300 s"
            latest = read_latest(root) if (root / "latest").exists() else None
            if latest is not None:
                for tmp in root.glob("step-*.tmp"):
                    k = int(tmp.name[len("step-"):-len(".tmp")])
                    if k > int(latest.name[len("step-"):]) and not (root / f"step-{k}").exists():
                        os.kill(p.pid, signal.SIGKILL)  # the controller only: its children die with it
                        killed_at = k
                        break
            time.sleep(0.005)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    prev = killed_at - 2
    assert (root / f"step-{killed_at}.tmp").is_dir() and not (root / f"step-{killed_at}").exists()
    assert read_latest(root) == root / f"step-{prev}"
    time.sleep(3)  # the killed run's children exit on their own (tests/integration/test_faults.py counts them)
    second = _run(tmp_path, killed_at + 2, "--resume", "--set", "scheduler.async_ratio=2", "--set", "run.checkpoint_every=2",
                  "--set", "run.keep_checkpoints=5", "--set", "run.eval_every=0")
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"resumed from step {prev}" in second.stdout
    assert not (root / f"step-{killed_at}.tmp").exists()  # the half-written folder is removed on resume
    assert read_latest(root) == root / f"step-{killed_at + 2}"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(killed_at + 3))
    uids = [u for r in rows for u in r.get("prompt_uids", [])]
    assert len(uids) == len(set(uids))  # no prompt trained twice across the kill
    # partial mode (the default): the periodic checkpoint's untrained groups and unfinished rollouts were
    # restored and continued, none regenerated (single-turn), none re-drawn from the data
    counters = msgspec.json.decode((run_dir / "summary.json").read_bytes())["result"]["counters"]
    assert counters["resume/restored_groups"] > 0 and counters["resume/restored_rollouts"] > 0, counters
    assert counters["resume/regenerated_tokens"] == 0 and counters["resume/readmitted_groups"] == 0, counters
