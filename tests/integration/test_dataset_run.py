"""End to end: `flashrl run` on the dataset environment with a user's reward loaded by file path, real
engines and trainer. Checks what a user reads afterwards: samples.jsonl, the reward's extra metric in
metrics.jsonl, TensorBoard event files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashrl.config import load
from flashrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

REWARD = '''
def score(row, response):
    correct = response.strip() == row["answer"]
    return {"reward": float(correct), "correct": correct, "resp_chars": float(len(response)), "carry": float(row["carry"])}
'''


@pytest.mark.timeout(600)
def test_dataset_run_with_a_file_reward(tmp_path: Path) -> None:
    from flashrl.models import ensure_model

    # The built-in model `make test` builds for configs/tiny.toml (warm-started on 2-digit additions).
    model = ensure_model(load(ROOT / "configs" / "tiny.toml")).resolve()
    rows = [f'{{"id": "r{i}", "q": "{i}+{i + 7}", "a": "{2 * i + 7}", "carry": {str(i % 10 >= 2).lower()}}}' for i in range(40)]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows + ["{broken"]) + "\n")
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD))
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        [run]
        name = "ds"
        output_dir = "{tmp_path}"
        steps = 3
        eval_every = 0
        dashboard = "plain"
        [model]
        path = "{model}"
        max_model_len = 64
        [env]
        name = "dataset"
        eval_size = 6
        [env.params]
        path = "{tmp_path / 'rows.jsonl'}"
        prompt = "q"
        answer = "a"
        id = "id"
        extra = ["carry"]
        template = "{{prompt}}="
        eval_fraction = 0.2
        reward = "{tmp_path / 'my_reward.py'}:score"
        [rollout]
        group_size = 4
        batch_prompts = 2
        max_new_tokens = 4
        [engine]
        count = 1
        kv_cache_gib = 0.25
        [log]
        samples_per_step = 3
        eval_samples = 2
        tensorboard = true
    """))
    out = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(tmp_path / "run.toml")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    run_dir = tmp_path / "ds"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in metrics if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["reward/resp_chars"] >= 1 and 0 <= r["reward/carry"] <= 1 for r in steps)  # the reward's extras
    assert metrics[0]["step"] == 0 and "eval/reward/resp_chars" in metrics[0]
    assert metrics[-1]["env/bad_rows"] == 1  # the broken line was counted, not silently dropped
    samples = read_jsonl(run_dir / "samples.jsonl")
    train = [s for s in samples if s["kind"] == "train"]
    assert [s["step"] for s in train] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    prompts = {f"{i}+{i + 7}=" for i in range(40)}
    assert all(s["prompt"] in prompts and s["metrics"]["resp_chars"] == len(s["response"]) for s in train)
    assert all(s["policy_versions"] and max(s["policy_versions"]) <= s["step"] - 1 for s in train)
    assert {s["finish_reason"] for s in train} <= {"stop", "length"}
    evals = [s for s in samples if s["kind"] == "eval"]
    assert [s["step"] for s in evals] == [0, 0, 3, 3]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    shown = subprocess.run([sys.executable, "-m", "flashrl.cli", "samples", str(run_dir), "--step", "3"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0 and train[-1]["prompt"] in shown.stdout, shown.stdout + shown.stderr
