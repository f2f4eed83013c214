"""`flashrl run` with [model.lora]: a real engine and trainer rank train the built-in model's adapter; the
sync carries the adapter only (engine/sync_bytes), engine and trainer agree on the logprobs (the engine
serves the adapter the trainer has), `--resume` continues, and final/ holds the merged model and the
adapter, which give the same greedy output in transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashrl.metrics import read_jsonl

pytest.importorskip("peft")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, steps: int, *extra: str) -> str:
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), *extra,
           "--set", f"run.output_dir={tmp_path}", "--set", "run.name=lora", "--set", f"run.steps={steps}",
           "--set", "run.eval_every=0", "--set", "env.eval_size=32", "--set", "run.checkpoint_every=4",
           "--set", "run.dashboard=plain", "--set", "model.lora.rank=16", "--set", "trainer.lr=1e-3"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout


@pytest.mark.timeout(1800)
def test_lora_run_syncs_the_adapter_resumes_and_exports(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _run(tmp_path, 8)
    run_dir = tmp_path / "lora"
    out = _run(tmp_path, 12, "--resume")
    assert "done: lora 12 steps" in out or "done: lora" in out, out[-2000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) >= 1 and "loss" in r]
    assert [r["step"] for r in rows][-4:] == [9, 10, 11, 12]  # resumed after step 8
    final = run_dir / "final"
    full_bytes = (final / "model.safetensors").stat().st_size
    synced = [r["engine/sync_bytes"] for r in rows if "engine/sync_bytes" in r]
    assert synced and max(synced) < 0.2 * full_bytes  # the adapter only (rank 16: 18% of this narrow model)
    assert max(abs(r["mismatch/kl"]) for r in rows if "mismatch/kl" in r) < 1e-4  # the engines serve the trainer's adapter

    merged = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    cfg = (final / "adapter" / "adapter_config.json").read_text()
    assert '"r": 16' in cfg
    base_dir = __import__("json").loads(cfg)["base_model_name_or_path"]
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                        str(final / "adapter")).eval()
    ids = torch.tensor([[1, 12, 5, 13, 7, 14]])
    a = merged.generate(ids, max_new_tokens=6, do_sample=False)
    b = adapter.generate(ids, max_new_tokens=6, do_sample=False)
    assert a.tolist() == b.tolist()
