"""Fault injection with real processes: kill things on purpose and check the promised outcome.

Each test starts real vLLM engines / trainer ranks (tens of seconds on 2 cores), so they are slow.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flashrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

FAST = [  # the embedded default, cut down to what a fault test needs
    "--set", "run.steps=100000", "--set", "run.eval_every=0", "--set", "env.eval_size=8",
    "--set", "run.dashboard=plain", "--set", "rollout.batch_prompts=4", "--set", "rollout.group_size=4",
]


def _flashrl_run(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"),
           "--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}", *FAST, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_step(proc: subprocess.Popen[bytes], metrics: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"flashrl run exited with {proc.returncode} before step {step}:\n{out[-3000:]}")
        if metrics.exists() and any(r.get("step", 0) >= step for r in read_jsonl(metrics)):
            return
        time.sleep(0.5)
    pytest.fail(f"no step {step} within {timeout:.0f} s")


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.timeout(300)
def test_sigkilled_controller_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGKILL `flashrl run` mid-training: engines, vLLM EngineCores, trainer ranks and env workers all exit
    on their own within 30 s (parent-death signal + watchdog in every child, group kill for grandchildren)."""
    proc = _flashrl_run(
        tmp_path, "kill9",
        # remote env: one env worker process too; 2 trainer ranks
        "--set", "env.name=remote", "--set", 'env.params={inner = "arithmetic", workers = 1, params = {digits = 2, ops = ["+"]}}',
        "--set", "trainer.ranks=2",
    )
    survivors: list[psutil.Process] = []
    tree: list[psutil.Process] = []
    try:
        _wait_step(proc, tmp_path / "kill9" / "metrics.jsonl", 1, 240)
        tree = _tree(proc.pid)
        names = " ".join(" ".join(p.cmdline()) for p in _running(tree))
        for part in ("flashrl.engine.server", "flashrl.trainer.worker", "envs.remote"):
            assert part in names, f"{part} not among the run's processes: {names}"
        engine_pids = {p.pid for p in tree if "flashrl.engine.server" in " ".join(p.cmdline())}
        cores = [p for p in tree if p.ppid() in engine_pids]
        assert cores, "no vLLM EngineCore under the engine processes"
        assert len(_running(tree)) >= 2 + 2 + 2 + 1  # engines, their cores, trainer ranks, env worker
        proc.send_signal(signal.SIGKILL)  # the controller only; its children are in their own groups
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(tree):
            time.sleep(0.5)
        survivors = _running(tree)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(_running(tree))
    assert survivors == [], "outlived the controller by 30 s: " + "; ".join(
        f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in survivors)
