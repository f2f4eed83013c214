"""End to end with images (issue 54): `flashrl run` trains a vision-language model (a random builtin:vlm-shaped
Idefics3 folder, built in seconds) on a data file whose rows are image paths, with real vLLM engine and trainer
processes. The engine is sent the images as references and decodes them; the trainer forwards their pixels and
scores the engine's tokens to the engine's logprobs; one row's image is not an image: that row is skipped,
named in the log with its file and counted (rollout/failed_bad_image), and the run trains to its end; samples.jsonl
names the images (paths), never their pixels; `flashrl export` writes a folder transformers loads as the VLM."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from envs.digits import render
from flashrl.metrics import read_jsonl
from flashrl.vision import build_untrained

pytestmark = pytest.mark.slow


def _data(tmp_path: Path) -> tuple[Path, Path]:
    img = tmp_path / "img"
    img.mkdir()
    rng = random.Random(0)
    rows = []
    for k in range(7):
        number = f"{(k * 37) % 100:02d}"
        render(number, 64, 36, rng).save(img / f"{k}.png")
        rows.append({"id": f"r{k}", "q": "read:", "a": number, "image": f"img/{k}.png"})
    (img / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this file is cut short")
    rows.insert(2, {"id": "bad-row", "q": "read:", "a": "12", "image": "img/broken.png"})
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    held.write_text("".join(json.dumps(r) + "\n" for r in rows[6:]))
    return train, held


@pytest.mark.timeout(900)
@pytest.mark.parametrize("freeze", [False, True])
def test_a_vlm_trains_on_image_rows_skipping_an_unreadable_image_and_exports(tmp_path: Path, freeze: bool) -> None:
    """``freeze``: [vision] freeze = true: the vision tower neither trains nor syncs (the engines keep the loaded
    one: the trainer's logprobs are still the engines'), the exported one is the loaded one; else it trains."""
    model = build_untrained(tmp_path / "model", seed=0)
    _write_config(tmp_path, model, steps=4, extra=f"[vision]\nfreeze = {str(freeze).lower()}\n")
    run = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(tmp_path / "run.toml")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    _check_run(tmp_path / "vlm", steps=4)
    run_dir = tmp_path / "vlm"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    samples = read_jsonl(run_dir / "samples.jsonl")
    # the final policy, exported, loads in transformers as the vision-language model with its processor
    out = subprocess.run([sys.executable, "-m", "flashrl.cli", "export", str(run_dir), "--out", str(tmp_path / "hf")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    _export_answers_as_the_engine(tmp_path / "hf", tmp_path, [s for s in samples if s["kind"] == "eval" and s["step"] == 4])
    from safetensors.torch import load_file

    from flashrl.vision.model import is_vision_param

    before, after = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    vision = [k for k in before if is_vision_param(k)]
    assert vision and all(k in after for k in vision)
    moved = [k for k in vision if not torch.equal(before[k], after[k])]
    assert (not moved) if freeze else moved, moved[:3]
    assert any(not torch.equal(before[k], after[k]) for k in before if not is_vision_param(k) and k in after)
    # frozen, the vision tower is out of the weight sync: each sync carries the text weights only
    full = sum(t.numel() * 4 for t in before.values())
    text = sum(t.numel() * 4 for k, t in before.items() if not is_vision_param(k))
    sent = [r["engine/sync_bytes"] for r in metrics if r.get("engine/sync_bytes")]
    assert sent and all((b < (full + text) / 2) == freeze for b in sent), (sent, full, text)


@pytest.mark.timeout(900)
def test_a_vlm_trains_on_two_fsdp2_ranks(tmp_path: Path) -> None:
    """trainer.ranks = 2 (FSDP2 over gloo, text and vision blocks sharded): each rank processes its rows' images,
    the trainer's logprobs are still the engine's, the bad row is skipped and counted, every step trains."""
    model = build_untrained(tmp_path / "model", seed=0)
    _write_config(tmp_path, model, steps=3, extra="[trainer]\nranks = 2\n")
    run = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(tmp_path / "run.toml")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    _check_run(tmp_path / "vlm", steps=3)
    assert (tmp_path / "vlm" / "logs" / "trainer1.log").is_file()  # the second rank ran


def _check_run(run_dir: Path, steps: int) -> None:
    """Every step trained, the unreadable image counted and named, trainer logprobs = engine's, images named."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if r["step"] >= 1] == list(range(1, steps + 1))
    assert metrics[-1]["count/rollout/failed_bad_image"] >= 1  # the unreadable image: counted ...
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "task bad-row" in log and "broken.png" in log  # ... and named, row and file
    # the trainer's logprobs of the engine's tokens, on the same pixels, are the engine's
    mism = [r["mismatch/max_abs"] for r in metrics if "mismatch/max_abs" in r]
    assert mism and max(mism) < 1e-3, mism
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples and all(s["images"] and s["images"][0].endswith(".png") for s in samples)
    assert all(not any(k in s for k in ("pixel_values", "pixels")) for s in samples)


def _write_config(tmp_path: Path, model: Path, steps: int, extra: str = "") -> None:
    train, held = _data(tmp_path)
    # an untrained model reads no number: reward its answers' first character, so that groups differ and train
    (tmp_path / "reward.py").write_text("def score(row, response):\n    return float(response[:1] in '02468')\n")
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        [run]
        name = "vlm"
        output_dir = "{tmp_path}"
        steps = {steps}
        eval_every = 2
        dashboard = "plain"
        [model]
        path = "{model}"
        max_model_len = 64
        [env]
        name = "dataset"
        eval_size = 2
        [env.params]
        path = "{train}"
        eval_path = "{held}"
        prompt = "q"
        answer = "a"
        id = "id"
        images = "image"
        reward = "{tmp_path / 'reward.py'}:score"
        [rollout]
        group_size = 4
        batch_prompts = 2
        max_new_tokens = 3
        temperature = 1.0
        [scheduler]
        async_ratio = 0  # on-policy: every step compares the trainer's logprobs with the engine's (mismatch/*)
        [engine]
        count = 1
        kv_cache_gib = 0.1
        [log]
        samples_per_step = 4
    """) + extra)


def _export_answers_as_the_engine(folder: Path, data: Path, evals: list[dict]) -> None:
    """The exported model, in transformers, answers each held-out image of the last evaluation (greedy, the image
    tokens banned as the engines ban them) with the engine's answer; it loads as the VLM with its processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.trainer.worker import banned_bias
    from flashrl.vision.batch import PixelCache, vision_inputs
    from flashrl.vision.processor import load_processor
    from flashrl.vision.prompts import VisionPrompts

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    proc, vp, tok = load_processor(folder), VisionPrompts.of(folder), load_tokenizer(folder)
    bias = banned_bias(list(vp.banned), model.config.get_text_config().vocab_size, torch.device("cpu"))
    assert evals
    for line in evals:
        ids = vp.expand(tok.encode("<image>read:"))
        pixels = vision_inputs(PixelCache(proc), [[str(data / line["images"][0])]], ["eval"])
        out: list[int] = []
        with torch.no_grad():
            for _ in range(3):  # rollout.max_new_tokens
                nxt = int((model(input_ids=torch.tensor([ids + out]), **pixels).logits[0, -1] + bias).argmax())
                out.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        assert tok.decode(out) == line["response"], (line, out)
