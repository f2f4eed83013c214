"""Checkpoints and resume on fakes (virtual clock): atomic folders, resume equivalence, faults, bad input.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_checkpoint.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from flashrl.checkpoint import CheckpointWriter, ControllerState, read_latest
from flashrl.resuming import find_checkpoint
from flashrl.sim.fake import (
    FakeTrainer,
)

ROOT = Path(__file__).resolve().parents[2]


def test_cli_resume_errors_exit_2_before_any_process(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--set",
           f"run.output_dir={tmp_path}", "--set", "run.name=none", "--resume"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "resume error: --resume: no checkpoint in" in p.stderr, p.stderr
    p = subprocess.run(cmd + [str(tmp_path / "nope")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no checkpoint in" in p.stderr and "nope" in p.stderr, p.stderr
    p = subprocess.run(cmd[:-1] + [str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--resume" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "none" / "logs").exists()  # nothing was started


_KILL_SCRIPT = textwrap.dedent('''
    import asyncio, sys, time
    from pathlib import Path
    from flashrl.checkpoint import CheckpointWriter, ControllerState
    from flashrl.sim.fake import FakeTrainer

    class SlowTrainer(FakeTrainer):
        async def save_checkpoint(self, path):
            if Path(path).parent.name == "step-2.tmp":
                Path(path).mkdir(parents=True)
                with open(Path(path) / "__0_0.distcp", "wb") as f:
                    f.write(b"x" * 4096); f.flush()
                    print("writing", flush=True)
                    time.sleep(60)  # killed here, in the middle of the write
            await super().save_checkpoint(path)

    async def main():
        w = CheckpointWriter(Path(sys.argv[1]), SlowTrainer(), "", keep=3)
        await w.save(ControllerState(step=1, version=1, elapsed_s=1.0, train_size=5, next_uid=2))
        await w.save(ControllerState(step=2, version=2, elapsed_s=2.0, train_size=5, next_uid=4))

    asyncio.run(main())
''')


def test_kill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path: Path) -> None:
    """A process SIGKILLed while writing step-2 leaves step-1 as the latest; resume uses it; a new save works."""
    root = tmp_path / "checkpoints"
    p = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "writing"
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (root / "step-2.tmp").exists() and not (root / "step-2").exists()
    assert read_latest(root) == root / "step-1"
    r = find_checkpoint(tmp_path)
    assert r.step == 1 and r.skipped == []

    async def again() -> None:
        w = CheckpointWriter(root, FakeTrainer(), "", keep=3)
        await w.save(ControllerState(step=2, version=2, elapsed_s=2.0, train_size=5, next_uid=4))

    asyncio.run(again())
    assert read_latest(root) == root / "step-2" and not (root / "step-2.tmp").exists()
    assert find_checkpoint(tmp_path).step == 2
