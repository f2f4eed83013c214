"""builtin:vlm served by a real vLLM engine process with an image (flashrl/vision/serve_check.py, the project's
EngineArgs): vLLM expands the prompt's one <image> token exactly as the processor does, its logprobs are
transformers' on the same tokens and pixels, and the image reaches the model (another image, other logprobs)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from envs.digits import render
from flashrl.vision import build_untrained, image_expansion, load_processor, png_bytes
from flashrl.vision.tokens import expand_images

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "<image>read:"


def _serve(folder: Path, images: list[Path], reload: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLASHRL_CHECK_TOKENS="6",
               FLASHRL_CHECK_RELOAD=str(reload))
    out = subprocess.run([sys.executable, "-m", "flashrl.vision.serve_check", str(folder), PROMPT, *map(str, images)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-2 * len(images):]]


def _hf_logprobs(folder: Path, image: Path, served: dict) -> list[float]:
    """transformers' logprobs of the served tokens, same ids and pixels, the weights in ``folder``."""
    import torch
    from transformers import AutoModelForImageTextToText

    from flashrl.vision.images import load_image

    pixels = load_processor(folder).image_processor(images=[[load_image(image)]], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([served["served_prompt_ids"] + served["tokens"]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"],
                       pixel_attention_mask=pixels["pixel_attention_mask"]).logits[0]
    n = len(served["served_prompt_ids"])
    return torch.log_softmax(logits[n - 1:-1], -1).gather(1, torch.tensor(served["tokens"])[:, None])[:, 0].tolist()


def _close(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


@pytest.mark.slow
def test_a_real_engine_serves_the_built_vlm_with_images_token_exactly_and_takes_new_weights(tmp_path: Path) -> None:
    """One engine: two images with the seed-0 weights, then the seed-1 weights loaded as a weight sync loads
    them (vision tower included) and the same two images again: every answer's logprobs are transformers' for
    the weights then loaded."""
    old, new = (build_untrained(tmp_path / f"vlm{s}", seed=s) for s in (0, 1))
    images = []
    for i, number in enumerate(("47", "91")):
        images.append(tmp_path / f"{number}.png")
        images[-1].write_bytes(png_bytes(render(number, 64, 36, random.Random(i))))
    reports = _serve(old, images, reload=new)
    assert [(r["image"], r["reloaded"]) for r in reports] == [(str(p), r) for r in (False, True) for p in images]

    proc = load_processor(old)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    first = reports[0]
    assert first["prompt_ids"].count(image_id) == 1  # one <image> sent, vLLM expands it as the processor does
    assert all(r["served_prompt_ids"] == expand_images(first["prompt_ids"], image_id, image_expansion(proc))
               for r in reports)
    assert reports[1]["logprobs"] != first["logprobs"]  # the same request seed: only the image differs
    for r, image in zip(reports, images * 2):
        weights = new if r["reloaded"] else old
        assert _close(r["logprobs"], _hf_logprobs(weights, image, r)), (r, _hf_logprobs(weights, image, r))
