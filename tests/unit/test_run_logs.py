"""What a run leaves to read: samples.jsonl and `flashrl samples`, TensorBoard event files and an
offline W&B run from the same records as metrics.jsonl, and the [log] keys."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import ConfigError, load
from flashrl.metrics import MetricsWriter, SamplesWriter, read_jsonl
from flashrl.samples import load as load_samples

RECORDS = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5, "reward/parsed": 1.0, "note": "text"},
           {"step": 2, "reward/mean": 0.75, "reward/parsed": 0.5, "eval/accuracy": 0.5}]


def sample(step: int, kind: str, prompt: str, response: str, reward: float) -> dict:
    return {"step": step, "kind": kind, "sample_id": f"{kind}{step}", "task_id": "t", "prompt": prompt, "response": response,
            "answer": "19", "reward": reward, "correct": reward >= 1, "metrics": {"parsed": 1.0}, "policy_versions": [step - 1],
            "finish_reason": "stop", "turns": 1, "response_tokens": 3, "engine": "engine0"}


def test_samples_jsonl_and_the_samples_command(tmp_path: Path) -> None:
    w = SamplesWriter(tmp_path / "samples.jsonl")
    w.write([sample(1, "train", "12+7=", "18", 0.0), sample(1, "train", "3+4=", "7", 1.0)])
    w.write([sample(2, "train", "40+2=", "42", 1.0), sample(2, "eval", "9+9=", "18", 1.0)])
    w.close()
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"step": 3, "kind": "tr')  # a run killed mid-write: the partial last line is skipped
    assert len(load_samples(tmp_path)) == 4
    runner = CliRunner()
    r = runner.invoke(app, ["samples", str(tmp_path)], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "step 2" in r.output and "40+2=" in r.output and "9+9=" in r.output and "12+7=" not in r.output
    r = runner.invoke(app, ["samples", str(tmp_path), "--step", "1", "--kind", "train"], terminal_width=200)
    assert r.exit_code == 0 and "12+7=" in r.output and "3+4=" in r.output and "parsed=1" in r.output
    r = runner.invoke(app, ["samples", str(tmp_path), "--step", "7"])
    assert r.exit_code == 2 and "no samples at that step; logged steps: 1, 2" in r.output
    r = runner.invoke(app, ["samples", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no samples.jsonl" in r.output


def test_tensorboard_event_files_hold_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tb") as w:
        assert w.tensorboard_enabled
        for r in RECORDS:
            w.write(r)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"reward/mean", "reward/parsed", "eval/accuracy"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(0, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("reward/parsed")] == [(1, 1.0), (2, 0.5)]
    assert read_jsonl(tmp_path / "metrics.jsonl") == RECORDS


def test_log_keys_are_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[log]\ntensorboard = "yes"\n')
    with pytest.raises(ConfigError, match=r"log\.tensorboard: Expected `bool`"):
        load(p)
    p.write_text("[log]\nsamples_per_step = -1\n")
    with pytest.raises(ConfigError, match=r"log\.samples_per_step: Expected `int` >= 0"):
        load(p)
    p.write_text("[log]\nwandb = true\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log\.wandb: the wandb package is not installed; pip install 'flashrl\[log\]'"):
        load(p)
