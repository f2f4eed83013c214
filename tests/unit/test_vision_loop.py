"""Images through flashrl's loop, on fakes (issue 54): the controller pairs a task's image references with its
prompt's image tokens, sends the engine the compact prompt with the references and the banned image tokens, keeps
the expanded ids and the references (never pixels) in the trajectory, checks the engine's expansion, and skips a
row whose images do not load or pair, counted; the wire carries references; the trainer's batch keeps each row's
pixels with its row. The real engine: tests/integration/test_vision_engine_process.py; the real loop:
tests/integration/test_vision_run.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flashrl.config import Config
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.env import Task
from flashrl.sim.fake import FakeSuite, FakeTokenizer
from flashrl.trainer.batch import pad_batch, with_images
from flashrl.vision import build_untrained, png_bytes
from flashrl.vision.batch import PixelCache
from flashrl.vision.processor import load_processor
from flashrl.vision.prompts import VisionPrompts
from flashrl.wire.protocol import ENGINE_REPLIES, ENGINE_REQUESTS, Generate, Generated, TrainBatch, encode
from flashrl.wire.trajectory import Image, Trajectory
from flashrl.wire.transport import RemoteError

IMG = 5  # the image token of these fakes (FakeTokenizer: one id per character, chr(5) here)
VP = VisionPrompts(image_id=IMG, expansion=(6, 7, IMG, IMG, IMG, 6), banned=(6, 7, IMG))
PNG = b"\x89PNG fake bytes: the controller never decodes them"


class ImageSuite(FakeSuite):
    def __init__(self, images: list[Any], prompt: str = "\x05read?") -> None:
        super().__init__()
        self.task = Task(id="row-7", prompt=prompt, answer="3", meta={"images": images})


class Engine:
    """An engine that expands the prompt's image tokens (or, ``wrong``, does not) and answers "3"."""

    def __init__(self, wrong: bool = False, refuse: str = "") -> None:
        self.name, self.wrong, self.refuse = "e0", wrong, refuse
        self.requests: list[Generate] = []

    async def generate(self, req: Generate) -> Generated:
        self.requests.append(req)
        if self.refuse:
            raise RemoteError(self.refuse, "bad_image")
        prompt = list(req.prompt_ids) if self.wrong else VP.expand(req.prompt_ids)
        return Generated(request_id=req.request_id, token_ids=[ord("3"), 0], logprobs=[-0.1, -0.2], versions=[0, 0],
                         finish_reason="stop", engine=self.name, prompt_ids=prompt)


def _sample(engine: Engine, suite: ImageSuite, vision: VisionPrompts | None = VP) -> tuple[Trajectory, RolloutContext]:
    cfg = msgspec.convert({"rollout": {"max_new_tokens": 4}, "model": {"max_model_len": 64}}, Config)
    ctx = RolloutContext(cfg=cfg, tokenizer=FakeTokenizer(), suite=suite, engines=[engine],  # type: ignore[list-item]
                         router=Router(1, 8), version=lambda: 0, vision=vision)
    spec = RolloutSpec(task=suite.task, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    return asyncio.run(run_sample(ctx, spec, 0)), ctx


def test_the_engine_gets_the_compact_prompt_the_references_and_the_banned_tokens_the_trajectory_the_expansion(
        tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    engine = Engine()
    traj, ctx = _sample(engine, ImageSuite([PNG, path], prompt="\x05\x05read?"))
    assert traj.status == "ok" and traj.reward == 1.0
    (req,) = engine.requests
    text = [ord(c) for c in "read?"]
    assert req.prompt_ids == [IMG, IMG, *text]
    assert req.images == [Image(data=PNG), Image(path=str(path))] and req.banned_token_ids == [6, 7, IMG]
    assert traj.prompt_ids == [*VP.expansion, *VP.expansion, *text]  # what the trainer forwards
    assert traj.images == req.images
    # a text-only policy's context (no vision) sends no images, whatever the task's meta holds
    engine = Engine()
    traj, _ = _sample(engine, ImageSuite([PNG]), vision=None)
    assert engine.requests[0].images == [] and engine.requests[0].banned_token_ids == [] and traj.images == []


def test_an_engine_that_expands_otherwise_is_a_bug_that_stops_the_run() -> None:
    with pytest.raises(RuntimeError, match="expanded .* images into other prompt ids"):
        _sample(Engine(wrong=True), ImageSuite([PNG]))


@pytest.mark.parametrize("images, prompt, why", [
    ([PNG, PNG], "\x05read?", "holds 1 .* token\\(s\\) for 2 image\\(s\\)"),
    ([], "\x05read?", "holds 1 .* for 0 image"),
    ([object()], "\x05read?", "image 0 is a object in meta.*; give PNG/JPEG bytes, a file path, a PIL image"),
])
def test_a_row_whose_images_do_not_pair_is_skipped_named_and_counted(images: list[Any], prompt: str, why: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    traj, ctx = _sample(engine, ImageSuite(images, prompt))
    assert traj.status == "failed" and traj.failure == "bad_image" and not engine.requests
    assert ctx.counters["rollout/failed_bad_image"] == 1
    assert "row row-7" in caplog.text
    import re

    assert re.search(why, caplog.text), caplog.text


def test_an_image_the_engine_cannot_decode_skips_the_sample_naming_the_row_counted(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(refuse="request 0-0.0.0 image 0: image '/data/x.png' does not load: truncated")
    traj, ctx = _sample(engine, ImageSuite(["/data/x.png"]))
    assert traj.status == "failed" and traj.failure == "bad_image"
    assert ctx.counters["rollout/failed_bad_image"] == 1 and ctx.counters["rollout/failed_engine_error"] == 0
    assert "task row-7" in caplog.text and "/data/x.png" in caplog.text


def test_images_travel_as_references_on_the_wire() -> None:
    req = Generate(request_id="r", prompt_ids=[IMG, 9], images=[Image(data=PNG), Image(path="/a.png")], banned_token_ids=[6])
    assert ENGINE_REQUESTS.decode(encode(req)) == req
    rep = Generated(request_id="r", token_ids=[1], logprobs=[0.0], versions=[0], prompt_ids=[6, IMG, 6, 9])
    assert ENGINE_REPLIES.decode(encode(rep)) == rep
    tb = TrainBatch(step=0, samples=[Trajectory(group=0, prompt_ids=[1], images=[Image(path="/a.png")])])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(tb), type=TrainBatch) == tb
    assert Image(data=PNG).ref() == PNG and Image(path="/a.png").ref() == "/a.png"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_untrained(tmp_path_factory.mktemp("vlm") / "vlm", seed=0)


def test_the_trainer_batch_keeps_each_rows_pixels_with_its_row_and_text_only_pays_nothing(vlm: Path) -> None:
    from PIL import Image as PIL

    proc = load_processor(vlm)
    vp = VisionPrompts.of(vlm)
    black, white = (png_bytes(PIL.new("RGB", (64, 64), c)) for c in ("black", "white"))
    rows = [Trajectory(group=0, sample_id=f"s{i}", prompt_ids=vp.expand([1, vp.image_id, 40]), response_ids=[41, 2],
                       loss_mask=[1, 1], behav_logp=[0.0, 0.0], versions=[0, 0], images=[Image(data=im)])
            for i, im in enumerate([black, white, black])]
    text = Trajectory(group=1, sample_id="t", prompt_ids=[1, 40], response_ids=[41], loss_mask=[1], behav_logp=[0.0], versions=[0])
    pixels = PixelCache(proc)
    b = with_images(pad_batch([*rows, text], 0), pixels, [*rows, text])
    assert b.pixel_values.shape[:2] == (4, 1) and pixels.misses == 2 and pixels.hits == 1  # each image once
    assert torch.equal(b.pixel_values[0], b.pixel_values[2]) and not torch.equal(b.pixel_values[0], b.pixel_values[1])
    assert not b.pixel_attention_mask[3].any()  # the text-only row: no image
    picked = b.select([1, 3])
    assert torch.equal(picked.pixel_values[0], b.pixel_values[1]) and set(picked.vision_kwargs()) == {
        "pixel_values", "pixel_attention_mask"}
    plain = with_images(pad_batch([text], 0), pixels, [text])
    assert plain.vision_kwargs() == {} and with_images(pad_batch(rows, 0), None, rows).vision_kwargs() == {}


def test_validate_names_a_model_that_cannot_see_the_envs_images(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from flashrl.envcheck import image_problem

    class Suite:
        def __init__(self, meta: dict[str, Any]) -> None:
            self.tasks = [Task(id="row-1", prompt="\x05read?", answer="3", meta=meta)]

        def train_tasks(self) -> list[Task]:
            return self.tasks

        def eval_tasks(self) -> list[Task]:
            return []

    def cfg(path: Any) -> Any:
        return SimpleNamespace(model=SimpleNamespace(path=str(path)))

    vision, text = tmp_path / "vision", tmp_path / "text"
    for folder, config in ((vision, '{"vision_config": {}}'), (text, '{"model_type": "llama"}')):
        folder.mkdir()
        (folder / "config.json").write_text(config)
    images = Suite({"images": [PNG]})
    assert "'builtin:tiny' is a text-only model" in image_problem(cfg("builtin:tiny"), images, "env x")
    assert "task 'row-1'" in image_problem(cfg(text), images, "env x")
    assert "has no image processor" in image_problem(cfg(vision), images, "env x")
    (vision / "processor_config.json").write_text("{}")
    assert image_problem(cfg(vision), images, "env x") == ""
    assert image_problem(cfg("builtin:vlm"), images, "env x") == ""
    assert image_problem(cfg(text), Suite({}), "env x") == ""  # no images: any model
    assert image_problem(cfg(tmp_path / "not-built"), images, "env x") == ""  # built later, checked then


def test_freezing_the_vision_of_a_model_without_one_is_a_config_error(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from flashrl.envcheck import freeze_problem

    def cfg(path: Any, freeze: bool = True) -> Any:
        return SimpleNamespace(model=SimpleNamespace(path=str(path)), vision=SimpleNamespace(freeze=freeze))

    text, vision = tmp_path / "text", tmp_path / "vision"
    for folder, config in ((vision, '{"vision_config": {}}'), (text, '{"model_type": "llama"}')):
        folder.mkdir()
        (folder / "config.json").write_text(config)
    assert "has no vision tower" in freeze_problem(cfg("builtin:tiny")) and "freeze = false" in freeze_problem(cfg(text))
    assert freeze_problem(cfg(vision)) == freeze_problem(cfg("builtin:vlm")) == freeze_problem(cfg(text, False)) == ""
