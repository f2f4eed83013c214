"""Images in later turns and images given as pixels (issue 54), on fakes: a multi-turn observation's images
(StepResult.images) are paired with its image tokens, expanded in the trajectory (loss mask 0), sent to the engine
with the prompt's, in sequence order, and named in samples.jsonl; an observation whose images do not pair is a
bad_image skip naming the row and the turn; a text-only policy given one is refused by name; an image expansion
is never cut by max_model_len; image tokens are banned in every turn. A PIL image or a uint8 array (in
Task.meta or an observation) is encoded to PNG off the event loop, losslessly. The real engine:
tests/integration/test_vision_turns_process.py."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from flashrl.config import Config
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.env import StepResult, Task
from flashrl.sim.fake import FakeTokenizer
from flashrl.trainer.batch import pad_batch, with_images
from flashrl.vision import build_untrained, load_image, png_bytes
from flashrl.vision import images as images_mod
from flashrl.vision.batch import PixelCache
from flashrl.vision.images import ImageLoadError
from flashrl.vision.processor import load_processor
from flashrl.vision.prompts import VisionPrompts, encode_images
from flashrl.wire.trajectory import Image, Trajectory
from tests.unit.test_vision_loop import IMG, PNG, VP, Engine

PNG2 = b"\x89PNG the second turn's image"


class LookAgainSuite:
    """Turn 1: the task's prompt (its images in meta); the env answers with ``observation`` and ``images``
    (turn 2's), then ends after the second action with reward 1."""

    def __init__(self, observation: str = "\nagain\x05:", images: list[Any] | None = None,
                 meta_images: list[Any] | None = None, prompt: str = "\x05read?") -> None:
        self.task = Task(id="row-3", prompt=prompt, answer="3", meta={"images": [PNG] if meta_images is None else meta_images})
        self.observation, self.images = observation, [PNG2] if images is None else images

    def make_env(self) -> Any:
        suite = self

        class Env:
            turn = 0

            async def reset(self, task: Task) -> str:
                return task.prompt

            async def step(self, action: str) -> StepResult:
                self.turn += 1
                if self.turn == 1:
                    return StepResult(observation=suite.observation, images=suite.images, done=False)
                return StepResult(reward=1.0, done=True)

            async def close(self) -> None:
                pass

        return Env()


def _run(suite: LookAgainSuite, vision: VisionPrompts | None = VP, max_len: int = 64) -> tuple[Any, RolloutContext, Engine]:
    cfg = msgspec.convert({"rollout": {"max_new_tokens": 4, "max_turns": 2}, "model": {"max_model_len": max_len}}, Config)
    engine = Engine()
    ctx = RolloutContext(cfg=cfg, tokenizer=FakeTokenizer(), suite=suite, engines=[engine],  # type: ignore[list-item, arg-type]
                         router=Router(1, 8), version=lambda: 0, vision=vision)
    spec = RolloutSpec(task=suite.task, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    return asyncio.run(run_sample(ctx, spec, 0)), ctx, engine


def test_an_observations_image_is_expanded_kept_out_of_the_loss_and_sent_with_the_prompts() -> None:
    traj, ctx, engine = _run(LookAgainSuite())
    assert traj.status == "ok" and traj.turns == 2 and traj.reward == 1.0
    first, second = engine.requests
    answer = [ord("3"), 0]
    obs = [ord("\n"), *map(ord, "again"), *VP.expansion, ord(":")]
    assert traj.prompt_ids == [*VP.expansion, *map(ord, "read?")]
    assert traj.response_ids == [*answer, *obs, *answer]  # the observation's image expanded where its token stood
    assert traj.loss_mask == [1, 1] + [0] * len(obs) + [1, 1]  # the placeholder tokens (all of obs) out of the loss
    assert traj.images == [Image(data=PNG), Image(data=PNG2)]  # sequence order: the prompt's, then turn 2's
    assert first.images == [Image(data=PNG)] and second.images == traj.images
    # turn 2 goes compacted: one image token per image of the whole sequence, the engine expands them
    assert second.prompt_ids == [IMG, *map(ord, "read?"), *answer, ord("\n"), *map(ord, "again"), IMG, ord(":")]
    assert first.banned_token_ids == second.banned_token_ids == list(VP.banned)
    line = _ledger_line(traj)
    assert line["images"] == [f"png:{h}" for h in (_sha(PNG), _sha(PNG2))]  # samples.jsonl names every image


def test_a_text_only_prompt_bans_the_image_tokens_before_its_first_image_arrives() -> None:
    traj, _, engine = _run(LookAgainSuite(meta_images=[], prompt="read?"))
    assert traj.status == "ok" and traj.images == [Image(data=PNG2)]
    assert engine.requests[0].images == [] and engine.requests[0].banned_token_ids == list(VP.banned)


@pytest.mark.parametrize("observation, images, why", [
    ("\nagain:", [PNG2], "row row-3 turn 2: its text holds 0 .* for 1 image"),
    ("\nagain\x05\x05:", [PNG2], "holds 2 .* for 1 image"),
    ("\nagain\x05:", [3.5], "image 0 is a float in the observation's StepResult.images"),
])
def test_an_observation_whose_images_do_not_pair_skips_the_sample_naming_row_and_turn(
        observation: str, images: list[Any], why: str, caplog: pytest.LogCaptureFixture) -> None:
    import re

    traj, ctx, engine = _run(LookAgainSuite(observation, images))
    assert traj.status == "failed" and traj.failure == "bad_image" and len(engine.requests) == 1
    assert ctx.counters["rollout/failed_bad_image"] == 1
    assert re.search(why, caplog.text), caplog.text


def test_a_text_only_policy_given_an_observations_image_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="observation carries 1 image.* text-only model"):
        _run(LookAgainSuite(meta_images=[], prompt="read?"), vision=None)


def test_an_image_that_would_not_fit_ends_the_trajectory_before_it_never_cut() -> None:
    base = len(VP.expansion) + len("read?") + 2
    traj, _, engine = _run(LookAgainSuite(), max_len=base + 8)  # the observation's expansion needs 13
    assert traj.status == "ok" and traj.finish_reason == "max_model_len" and traj.turns == 1
    assert traj.images == [Image(data=PNG)] and len(engine.requests) == 1 and len(traj.response_ids) == 2


def test_pil_images_and_arrays_are_encoded_off_the_event_loop_losslessly(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image as PIL

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    pic = PIL.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    threads: Counter[int] = Counter()
    real = images_mod.png_bytes

    def spy(img: Any) -> bytes:
        threads[threading.get_ident()] += 1
        return real(img)

    monkeypatch.setattr(images_mod, "png_bytes", spy)

    async def body() -> tuple[list[Any], str, int]:
        refs, err = await encode_images([arr, PNG, pic, "/a.png"])
        return refs, err, threading.get_ident()

    refs, err, loop_thread = asyncio.run(body())
    assert not err and sum(threads.values()) == 2 and loop_thread not in threads  # a worker thread encoded both
    assert refs[1] == PNG and refs[3] == "/a.png"
    assert np.array_equal(np.asarray(load_image(refs[0])), arr)  # the same pixels the engine and trainer decode
    assert np.array_equal(np.asarray(load_image(refs[2])), np.asarray(pic))
    threads.clear()
    assert asyncio.run(encode_images([PNG, "/a.png"])) == ([PNG, "/a.png"], "") and not threads  # refs: no encoding


def test_pixels_in_task_meta_and_observations_reach_the_engine_as_png() -> None:
    from PIL import Image as PIL

    arr = np.full((8, 8, 3), 200, dtype=np.uint8)
    pic = PIL.new("RGB", (8, 8), "red")
    traj, _, engine = _run(LookAgainSuite(images=[pic], meta_images=[arr]))
    assert traj.status == "ok" and engine.requests[1].images == [Image(data=png_bytes(PIL.fromarray(arr))),
                                                                 Image(data=png_bytes(pic))]


def test_the_default_idefics3_configs_pad_warning_is_dropped_and_no_other() -> None:
    import flashrl.vision  # noqa: F401  # installs the filter

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    target = logging.getLogger("transformers.configuration_utils")
    handler = Keep()
    target.addHandler(handler)
    try:
        target.warning("Model config: pad_token_id must be `None` or an integer within the vocabulary "
                       "(between 0 and 31999), got 128002. This may result in unexpected behavior.")
        target.warning("Model config: pad_token_id must be `None` or an integer within the vocabulary "
                       "(between 0 and 95), got 128002.")
    finally:
        target.removeHandler(handler)
    assert seen == ["Model config: pad_token_id must be `None` or an integer within the vocabulary (between 0 and 95), "
                    "got 128002."]


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(data).hexdigest()[:12]


def _ledger_line(traj: Any) -> dict[str, Any]:
    from flashrl.controller.ledger import Ledger

    ledger = Ledger.__new__(Ledger)  # sample_line reads only the tokenizer
    ledger.tokenizer = FakeTokenizer()
    return ledger.sample_line("train", 1, traj, None)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_untrained(tmp_path_factory.mktemp("vlm") / "vlm", seed=0)
    load_processor(folder)  # transformers' first processor load imports urllib3, which probes IPv6 with a socket
    return folder


def test_an_image_the_trainer_cannot_process_takes_its_sample_out_of_the_loss_not_the_step(
        vlm: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The trainer's batch (trainer/batch.py with_images, as Trainer._prepare calls it): a sample whose image file
    is gone by the time the trainer reads it is blanked (every shape kept) and masked out of the loss, named and
    listed; without ``skipped`` (or with a processor of no fixed size) the error is raised as before."""
    from PIL import Image as PIL


    proc, vp = load_processor(vlm), VisionPrompts.of(vlm)
    good = png_bytes(PIL.new("RGB", (64, 64), "white"))
    refs = [Image(data=good), Image(path=str(tmp_path / "gone.png")), Image(data=good)]
    rows = [Trajectory(group=0, sample_id=f"s{i}", prompt_ids=vp.expand([1, vp.image_id, 40]), response_ids=[41, 2],
                       loss_mask=[1, 1], behav_logp=[0.0, 0.0], versions=[0, 0], images=[im]) for i, im in enumerate(refs)]
    skipped: list[int] = []
    b = with_images(pad_batch(rows, 0), PixelCache(proc), rows, skipped)
    assert skipped == [1] and b.pixel_values.shape[:2] == (3, 1)
    assert b.loss_mask[1].sum() == 0 and b.loss_mask[0].sum() == b.loss_mask[2].sum() == 2
    blank = b.pixel_values[1]  # a black image of the processor's size stands in (normalized: all one value)
    assert bool((blank == blank.flatten()[0]).all()) and not torch.equal(blank, b.pixel_values[0])
    assert bool(b.pixel_attention_mask[1].all())
    assert "s1" in caplog.text and "gone.png" in caplog.text
    with pytest.raises(ImageLoadError, match="s1: image file .*gone.png.* does not exist"):
        with_images(pad_batch(rows, 0), PixelCache(proc), rows)
    proc.image_processor.do_image_splitting = True  # tiles of a variable count: no blank fits
    with pytest.raises(ImageLoadError):
        with_images(pad_batch(rows, 0), PixelCache(proc), rows, [])


def test_a_training_step_with_an_image_the_trainer_cannot_load_trains_the_rest_and_counts_it(
        vlm: Any, tmp_path: Any) -> None:
    """The real training step (PolicyTrainer over builtin:vlm's architecture, its pixels and bias set as the worker
    sets them): one sample's image is gone; the step trains the others and reports vision/skipped_bad_image."""
    from transformers import AutoModelForImageTextToText

    from flashrl.config import from_dict
    from flashrl.trainer.step import PolicyTrainer
    from flashrl.trainer.worker import banned_bias
    from flashrl.vision.processor import image_token_ids
    from flashrl.wire.protocol import TrainBatch

    proc, vp = load_processor(vlm), VisionPrompts.of(vlm)
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32)
    cfg = from_dict({"trainer": {"lr": 1e-3, "threads": 1, "warmup_steps": 0}, "algorithm": {"loss": "ppo"}})
    t = PolicyTrainer(cfg, model, torch.device("cpu"))
    t.pixels = PixelCache(proc)
    t.logit_bias = banned_bias(image_token_ids(proc), model.config.get_text_config().vocab_size, torch.device("cpu"))
    good = png_bytes(_white())
    refs = [Image(data=good), Image(path=str(tmp_path / "gone.png")), Image(data=good), Image(data=good)]
    samples = [Trajectory(group=0, sample_id=f"s{i}", prompt_ids=vp.expand([1, vp.image_id, 40]), response_ids=[41, 2],
                          loss_mask=[1, 1], behav_logp=[-3.0, -3.0], versions=[0, 0], reward=float(i % 2), images=[im])
               for i, im in enumerate(refs)]
    r = t.train_step(TrainBatch(step=0, samples=samples))
    assert r is not None and r.metrics["vision/skipped_bad_image"] == 1 and t.version == 1
    assert r.metrics["tokens"] == 6  # the skipped sample's 2 tokens are out of the loss


def _white() -> Any:
    from PIL import Image as PIL

    return PIL.new("RGB", (64, 64), "white")
