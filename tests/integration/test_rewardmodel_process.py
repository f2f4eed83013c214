"""The reward model's worker processes for real: a batch scored in a worker, and `flashrl run` with a reward
model whose worker is hung (SIGSTOP) and then SIGKILLed mid-run: every step finishes once, the death is named,
the retries are counted, no episode failed for it, and nothing is left running."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flashrl.metrics import read_jsonl
from flashrl.rewardmodel.build import RmSpec, build_untrained_rm
from tests.helpers import killed_on_exit, wait_while_running

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rm") / "rm"
    out.mkdir()
    build_untrained_rm(out, RmSpec(), seed=0)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runner", ["torch", "vllm"])
def test_worker_scores_a_batch_as_transformers_does(rm_folder: Path, runner: str) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flashrl.rewardmodel.build import scores
    from flashrl.rewardmodel.client import ProcessScorer, RewardModelClient

    texts = ["12+3=15", "1+1=3", "99+99=198"]
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_folder), dtype=torch.float32).eval()
    want = scores(model, AutoTokenizer.from_pretrained(str(rm_folder)), texts)

    async def main() -> tuple[list[float], dict[str, float], list[int]]:
        client = RewardModelClient(ProcessScorer(rm_folder, runner=runner), max_batch=8, batch_wait_s=0.05)
        try:
            got = await asyncio.gather(*(client.score(t) for t in texts))
            return list(got), client.counters, client.pids()
        finally:
            await client.aclose()

    got, counters, pids = asyncio.run(main())
    assert got == pytest.approx(want, abs=1e-4)  # vLLM's pooling runner: the same logits up to float error
    assert counters["rm_batches"] == 1  # the three came in one batch
    assert counters[f"rm_workers_{runner}"] == 1
    assert pids and not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def _workers(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "flashrl.rewardmodel.worker" in " ".join(k.cmdline()):
                out.append(k)
        except psutil.Error:
            pass
    return out


@pytest.mark.timeout(1200)
def test_a_hung_then_killed_reward_model_worker_is_replaced_and_the_run_finishes(tmp_path: Path, rm_folder: Path) -> None:
    steps = 20
    cmd = [
        sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "rm.toml"),
        "--set", f"run.output_dir={tmp_path}", "--set", "run.name=rmkill", "--set", f"run.steps={steps}",
        "--set", "run.max_time_s=0", "--set", "run.eval_every=0", "--set", "env.eval_size=16",
        "--set", "run.dashboard=plain", "--set", f"reward.model={str(rm_folder)!r}".replace("'", '"'),
        "--set", "reward.timeout_s=3.0", "--set", "run.checkpoint_every=0",
        "--set", 'reward.runner="vllm"',  # rm.toml picks torch (faster on this CPU); the failures of vLLM workers here
    ]
    out_file = (tmp_path / "out.txt").open("wb")  # a file, not a pipe: nobody reads a pipe until the end
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "rmkill" / "metrics.jsonl"
    seen: list[psutil.Process] = []
    with killed_on_exit(proc):
        def at_step(n: int):  # type: ignore[no-untyped-def]
            return lambda: metrics.exists() and any(r.get("step", 0) >= n for r in read_jsonl(metrics))

        wait_while_running("training step 2", at_step(2), proc, 900)
        first = wait_while_running("a reward-model worker", lambda: _workers(proc.pid), proc, 30)[0]
        seen += psutil.Process(proc.pid).children(recursive=True)
        first.send_signal(signal.SIGSTOP)  # hung: a batch sent to it times out (reward.timeout_s), it is killed
        second = wait_while_running("a replacement worker", lambda: [w for w in _workers(proc.pid) if w.pid != first.pid], proc, 120)[0]
        seen.append(second)
        now = max(r.get("step", 0) for r in read_jsonl(metrics))
        wait_while_running("two more steps", at_step(now + 2), proc, 300)  # the replacement is up and scoring
        second.send_signal(signal.SIGSTOP)  # stopped, so the kill lands with a batch in flight
        time.sleep(1.0)
        os.kill(second.pid, signal.SIGKILL)
        third = wait_while_running("a second replacement", lambda: [w for w in _workers(proc.pid) if w.pid not in (first.pid, second.pid)],
                      proc, 120)[0]
        seen.append(third)
        proc.wait(timeout=600)
    out_file.close()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, out[-3000:]
    rows = [r for r in read_jsonl(metrics) if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    last = rows[-1]
    assert last["env/rm_timeout"] >= 1 and last["env/rm_crash"] >= 1, last
    assert last["env/rm_retries"] >= 2 and last["env/rm_workers_started"] >= 3
    assert last["env/rm_workers_vllm"] >= 3  # every replacement was a vLLM pooling worker too
    assert last.get("env/rm_failed", 0) == 0  # every batch scored in the end: no episode failed for it
    assert not any(k.startswith("count/rollout/failed_rm") for k in last)
    assert all("reward/rm_gap" in r for r in rows)
    log = (tmp_path / "rmkill" / "logs" / "controller.log").read_text()
    assert f"the reward-model worker (pid {second.pid}) died (exit code -9, killed by signal 9)" in log
    assert f"the reward-model worker (pid {first.pid}) gave no scores within reward.timeout_s" in log
    time.sleep(0.5)
    alive = [c for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running: {[(c.pid, c.cmdline()) for c in alive]}"
