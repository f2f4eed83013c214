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
from flashrl.vision.warm import expand_images

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "<image>read:"


def _serve(folder: Path, images: list[Path]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLASHRL_CHECK_TOKENS="6")
    out = subprocess.run([sys.executable, "-m", "flashrl.vision.serve_check", str(folder), PROMPT, *map(str, images)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(images):]]


@pytest.mark.slow
def test_a_real_engine_serves_the_built_vlm_with_an_image_token_exactly(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    folder = build_untrained(tmp_path / "vlm", seed=0)
    images = []
    for i, number in enumerate(("407", "913")):
        images.append(tmp_path / f"{number}.png")
        images[-1].write_bytes(png_bytes(render(number, 64, 22, random.Random(i))))
    first, second = _serve(folder, images)

    proc = load_processor(folder)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert first["prompt_ids"].count(image_id) == 1
    assert first["served_prompt_ids"] == expand_images(first["prompt_ids"], image_id, image_expansion(proc))

    from flashrl.vision.images import load_image

    pixels = proc.image_processor(images=[[load_image(images[0])]], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([first["served_prompt_ids"] + first["tokens"]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"],
                       pixel_attention_mask=pixels["pixel_attention_mask"]).logits[0]
    n = len(first["served_prompt_ids"])
    ref = torch.log_softmax(logits[n - 1:-1], -1).gather(1, torch.tensor(first["tokens"])[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(ref.tolist(), first["logprobs"])) < 1e-4, (ref.tolist(), first["logprobs"])

    # the same request seed: only the image differs
    assert second["served_prompt_ids"] == first["served_prompt_ids"]
    assert second["logprobs"] != first["logprobs"]
