"""An image in the second turn of a multi-turn environment, through a real vLLM engine process over ZeroMQ and the
controller's rollout code (issue 54): the task's first image comes as a uint8 array in Task.meta, the second as a
PIL image in the observation (StepResult.images), both encoded to PNG off the event loop; the engine expands every
image of the whole sequence exactly as the controller does (the rollout checks the engine's expanded ids on every
request), and the trainer's forward of the finished sample (its batch, its pixels for both images, the engines'
banned-token bias) gives the engine's logprob of every generated token, both turns; the second turn's tokens
depend on the second image. Fakes of the same path: tests/unit/test_vision_turns.py."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from envs.digits import render
from flashrl.config import Config
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.models.tokenizer import load_tokenizer
from flashrl.trainer.batch import pad_batch, token_logprobs, with_images
from flashrl.trainer.worker import banned_bias
from flashrl.vision import build_untrained, png_bytes
from flashrl.vision.batch import PixelCache
from flashrl.vision.processor import load_processor
from flashrl.vision.prompts import VisionPrompts
from flashrl.wire.trajectory import Image
from tests.helpers import running_engine
from tests.unit.test_vision_turns import LookAgainSuite

pytestmark = pytest.mark.slow
TOL = 1e-4  # float32 on both sides; measured max |d| 4.8e-7 on the 2-core AVX2 host


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_untrained(tmp_path_factory.mktemp("vlm") / "vlm", seed=0)


def _trainer_logprobs(model: Any, proc: Any, vp: VisionPrompts, traj: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The trainer's view of ``traj``: its padded batch with both images' pixels, scored with the engines' bias."""
    b = with_images(pad_batch([traj], 0), PixelCache(proc), [traj])
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, **b.vision_kwargs()).logits[:, :-1]
    logits = logits + banned_bias(list(vp.banned), logits.shape[-1], torch.device("cpu"))
    logp, _ = token_logprobs(logits, b.targets)
    return logp, b.loss_mask > 0, b


def test_an_image_in_turn_two_is_expanded_exactly_served_and_scored_alike_by_engine_and_trainer(
        vlm: Path, tmp_path: Path) -> None:
    from PIL import Image as PIL
    from transformers import AutoModelForImageTextToText

    rng = random.Random(0)
    first = np.asarray(render("37", 64, 36, rng), dtype=np.uint8)  # an array in Task.meta
    second = render("81", 64, 36, rng)  # a PIL image in the observation
    suite = LookAgainSuite(observation="\n<image>and:", images=[second], meta_images=[first], prompt="<image>read:")
    cfg = msgspec.convert({"rollout": {"max_new_tokens": 6, "max_turns": 2}, "model": {"max_model_len": 128}}, Config)
    tok, proc, vp = load_tokenizer(vlm), load_processor(vlm), VisionPrompts.of(vlm)
    with running_engine(tmp_path, vlm, "vlm-turns", max_model_len=128, max_num_seqs=4, kv_cache_gib=0.1) as ep:
        async def body() -> Any:
            client = ep.new_client()
            try:
                ctx = RolloutContext(cfg=cfg, tokenizer=tok, suite=suite, engines=[client],  # type: ignore[arg-type]
                                     router=Router(1, 4), version=lambda: 0, vision=vp)
                ctx.router.take(0)
                spec = RolloutSpec(task=suite.task, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
                return await run_sample(ctx, spec, 0)
            finally:
                await client.close()

        traj = asyncio.run(body())
    assert traj.status == "ok" and traj.turns == 2, traj
    assert traj.images == [Image(data=png_bytes(PIL.fromarray(first))), Image(data=png_bytes(second))]
    # token-exact: the prompt and the observation each hold one whole expansion where their <image> stood (the
    # rollout also checked the engine's expanded ids against these on both requests)
    gen1 = traj.response_ids[:traj.loss_mask.index(0)]
    obs = vp.expand(tok.encode("\n<image>and:"))
    assert traj.prompt_ids == vp.expand(tok.encode("<image>read:"))
    assert traj.response_ids[len(gen1):len(gen1) + len(obs)] == obs
    assert traj.loss_mask == [1] * len(gen1) + [0] * len(obs) + [1] * (len(traj.response_ids) - len(gen1) - len(obs))
    assert sum(traj.loss_mask) > len(gen1) and not set(traj.response_ids) & set(vp.banned) - set(obs)
    # the trainer's forward of the whole sample equals the engine's logprobs, both turns
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32).eval()
    logp, gen, b = _trainer_logprobs(model, proc, vp, traj)
    assert b.pixel_values.shape[:2] == (1, 2)  # both images' pixels forwarded
    d = (logp[gen] - b.behav_logp[gen]).abs().max().item()
    assert d < TOL, f"trainer vs engine logprob: max |d| {d}"
    # the second image reaches the second turn's tokens: another image there gives other logprobs
    other = msgspec.structs.replace(traj, images=[traj.images[0], Image(data=png_bytes(render("05", 64, 36, rng)))])
    logp2, _, _ = _trainer_logprobs(model, proc, vp, other)
    turn2 = gen.clone()
    turn2[0, :b.prompt_lens[0] - 1 + len(gen1) + len(obs)] = False
    assert (logp2[turn2] - b.behav_logp[turn2]).abs().max().item() > 10 * TOL
    print(f"max |trainer - engine| = {d:.2e} over {int(gen.sum())} tokens")
