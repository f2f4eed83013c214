"""flashrl/vision: image references, the built-in VLM (builtin:vlm) and its warm-start, the digits env.

No process, no socket: the model is built and run in this process with transformers (the engine's side is
tests/integration/test_vision_process.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import pytest

from envs.digits import DigitsSuite, render, verify
from flashrl.env import Task
from flashrl.vision import (
    IMAGE_TOKEN,
    ImageLoadError,
    VisionSpec,
    as_ref,
    build_untrained,
    describe,
    image_expansion,
    load_image,
    load_processor,
    png_bytes,
)
from flashrl.vision.tokens import compact_images, expand_images
from flashrl.vision.warm import VisionWarmStart, greedy_answers, make_batch, warm_start


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:vlm untrained (seed 0), built once per module."""
    return build_untrained(tmp_path_factory.mktemp("vlm") / "model", seed=0)


@pytest.fixture(scope="module")
def suite() -> DigitsSuite:
    return DigitsSuite(DigitsSuite.Params(train_size=64), seed=0, eval_size=50)


# --------------------------------------------------------------------------- images
def test_references_are_bytes_or_paths_and_pil_images_and_arrays_become_png(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    img = Image.new("RGB", (5, 4), "red")
    ref = as_ref(img)
    assert isinstance(ref, bytes) and ref.startswith(b"\x89PNG") and ref == png_bytes(img)  # deterministic
    assert as_ref(np.zeros((4, 5, 3), dtype=np.uint8)).startswith(b"\x89PNG")
    assert as_ref("a.png") == "a.png" and as_ref(b"x") == b"x"
    with pytest.raises(TypeError, match="PNG/JPEG bytes, a file path"):
        as_ref(np.zeros((4, 5, 3), dtype=np.float32))
    assert load_image(ref).size == (5, 4) and load_image(ref).getpixel((0, 0)) == (255, 0, 0)
    (tmp_path / "a.png").write_bytes(ref)
    assert load_image(tmp_path / "a.png").size == (5, 4)
    assert describe(ref).startswith("png:") and describe("x/a.png") == "x/a.png"


def test_an_image_that_does_not_load_names_the_row_and_the_file(tmp_path: Path) -> None:
    with pytest.raises(ImageLoadError, match=r"row train-3: image file '.*nope\.png' does not exist"):
        load_image(tmp_path / "nope.png", "row train-3")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ImageLoadError, match=r"row 7: image '.*bad\.png' does not load"):
        load_image(tmp_path / "bad.png", "row 7")
    from PIL import Image

    truncated = png_bytes(Image.new("RGB", (32, 32), "blue"))[:40]
    with pytest.raises(ImageLoadError, match=r"image 'png:[0-9a-f]{12}' does not load"):
        load_image(truncated)


# --------------------------------------------------------------------------- the digits env
def test_digits_splits_are_disjoint_by_number_seeded_and_carry_one_image_each(suite: DigitsSuite) -> None:
    train, held = suite.train_tasks(), suite.eval_tasks()
    assert len(train) == 64 and len(held) == 50
    assert not {t.answer for t in train} & {t.answer for t in held}
    assert len({t.answer for t in held}) == 50 and all(len(t.answer) == 2 for t in held)
    for t in (train[0], held[0]):
        assert t.prompt == f"{IMAGE_TOKEN}read:" and len(t.meta["images"]) == 1
        assert load_image(t.meta["images"][0]).size == (64, 64)
    again = DigitsSuite(DigitsSuite.Params(train_size=64), seed=0, eval_size=50)
    assert msgspec.json.encode(list(again.eval_tasks())) == msgspec.json.encode(list(held))
    other = DigitsSuite(DigitsSuite.Params(train_size=64), seed=1, eval_size=50)
    assert [t.answer for t in other.eval_tasks()] != [t.answer for t in held]


def test_digits_renderings_differ_and_a_number_that_does_not_fit_is_refused() -> None:
    a, b = (png_bytes(render("407", 64, 22, random.Random(s))) for s in (0, 1))
    assert a != b  # a seeded offset
    with pytest.raises(ValueError, match="do not fit a 32-pixel image"):
        render("4071", 32, 22, random.Random(0))
    with pytest.raises(ValueError, match=r"env.eval_size: 100 held-out numbers leave none .*100 numbers with digits=2"):
        DigitsSuite(DigitsSuite.Params(), seed=0, eval_size=100)
    with pytest.raises(ValueError, match="env.params.confusions"):
        DigitsSuite(DigitsSuite.Params(confusions={"7": "12"}), seed=0, eval_size=10)


def test_digits_verifier_is_exact_and_the_env_scores_it(suite: DigitsSuite) -> None:
    assert verify("407<eos>", "407") and verify(" 407 ", "407") and verify("007", "007")
    assert not verify("7", "007") and not verify("4070", "407") and not verify("", "407")
    task = Task(id="t", prompt="<image>read:", answer="407")
    env = suite.make_env()

    async def play(action: str) -> float:
        assert await env.reset(task) == task.prompt
        return (await env.step(action)).reward

    assert asyncio.run(play("407")) == 1.0 and asyncio.run(play("401")) == 0.0


def test_the_teacher_misreads_only_the_confusable_digits_at_its_slip_rate() -> None:
    task = Task(id="t", prompt="", answer="787")
    exact = DigitsSuite(DigitsSuite.Params(train_size=1, teacher_slip=0.0), seed=0, eval_size=1)
    always = DigitsSuite(DigitsSuite.Params(train_size=1, teacher_slip=1.0), seed=0, eval_size=1)
    assert exact.teacher_answer(task, random.Random(0)) == "787"
    assert always.teacher_answer(task, random.Random(0)) == "131"
    assert always.teacher_answer(Task(id="u", prompt="", answer="450"), random.Random(0)) == "450"
    half = DigitsSuite(DigitsSuite.Params(train_size=1, teacher_slip=0.5), seed=0, eval_size=1)
    rng = random.Random(0)
    reads = [half.teacher_answer(Task(id="v", prompt="", answer="7"), rng) for _ in range(2000)]
    assert 0.45 < reads.count("1") / len(reads) < 0.55


# --------------------------------------------------------------------------- builtin:vlm
def test_the_spec_refuses_shapes_vllm_or_the_connector_cannot_take() -> None:
    assert VisionSpec().image_seq_len == 16
    with pytest.raises(ValueError, match="head size"):
        VisionSpec(hidden=96, heads=4)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        VisionSpec(image_size=60, patch_size=8)
    with pytest.raises(ValueError, match="scale_factor"):
        VisionSpec(image_size=56, patch_size=8, scale_factor=2)


def test_the_built_folder_has_a_processor_and_one_image_token_expands_to_the_processors_ids(vlm: Path) -> None:
    proc = load_processor(vlm)
    tok = proc.tokenizer
    assert type(proc).__name__ == "Idefics3Processor" and type(proc.image_processor).__name__.endswith("Pil")
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    fake, glob = (tok.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>"))
    assert image_expansion(proc) == [fake, glob] + [image_id] * 16 + [fake]
    from flashrl.vision.processor import image_token_ids

    assert image_token_ids(proc) == sorted({fake, glob, image_id})
    assert tok.encode("12 read:", add_special_tokens=False)[:2] == [5, 6]  # the char tokenizer's ids, unchanged
    assert tok.encode(IMAGE_TOKEN, add_special_tokens=False) == [image_id]


def test_a_folder_without_a_processor_is_refused_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no image processor"):
        load_processor(tmp_path)


def test_the_model_reads_the_pixels_and_masks_the_prompt_from_the_loss(vlm: Path, suite: DigitsSuite) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    proc = load_processor(vlm)
    expansion = image_expansion(proc)
    tasks = list(suite.eval_tasks()[:2])
    b = make_batch(proc, tasks, [t.answer for t in tasks], expansion)
    assert b.ids.shape == (2, 19 + 5 + 3) and b.pixel_values.shape == (2, 1, 3, 64, 64)
    assert b.loss_mask.sum(1).tolist() == [3, 3] and not b.loss_mask[:, :24].any()  # answer + EOS only
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32).eval()
    with torch.no_grad():
        a = model(input_ids=b.ids, pixel_values=b.pixel_values, pixel_attention_mask=b.pixel_attention_mask).logits
        swapped = model(input_ids=b.ids, pixel_values=b.pixel_values.flip(0),
                        pixel_attention_mask=b.pixel_attention_mask).logits
    assert torch.isfinite(a).all() and (a[0, -1] - swapped[0, -1]).abs().max() > 1e-4  # the image reaches the text
    assert expand_images([1, 92, 2], 92, [7, 8]) == [1, 7, 8, 2]


def test_a_short_warm_start_probes_saves_and_reports(tmp_path: Path, suite: DigitsSuite) -> None:
    import torch

    folder = build_untrained(tmp_path / "m", seed=0)
    torch.set_num_threads(1)
    lines: list[str] = []
    report = warm_start(folder, suite, VisionWarmStart(max_steps=4, batch=8, check_every=2, probe_size=8, min_steps=0,
                                                        target_accuracy=1.0), seed=0, log=lines.append)
    assert report["steps"] == 4 and 0 <= report["eval_accuracy"] <= 1 and report["preprocess_ms_per_image"] > 0
    assert len(lines) == 2 and "probe accuracy" in lines[0]
    proc = load_processor(folder)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    answers = greedy_answers(model, proc, list(suite.eval_tasks()[:3]), image_expansion(proc), max_new=4)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)


def test_builtin_vlm_is_built_once_per_key_and_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from flashrl.vision import build as vbuild
    from flashrl.vision import warm as vwarm

    def cfg(seed: int) -> SimpleNamespace:
        return SimpleNamespace(model=SimpleNamespace(cache_dir=str(tmp_path)), run=SimpleNamespace(seed=seed),
                               env=SimpleNamespace(name="envs.digits:DigitsSuite", eval_size=10,
                                                   params={"train_size": 16, "faults": {"crash": 0.5}}))

    tiny = VisionWarmStart(max_steps=1, batch=2, check_every=1, probe_size=2)
    builds: list[Path] = []
    real = vwarm.warm_start
    monkeypatch.setattr(vwarm, "warm_start", lambda folder, *a, **kw: builds.append(Path(folder)) or real(folder, *a, **kw))
    first = vbuild.ensure_vlm(cfg(0), warm=tiny)
    assert first.name.startswith("vlm-") and (first / "flashrl_warmstart.json").is_file() and len(builds) == 1
    report = __import__("json").loads((first / "flashrl_warmstart.json").read_text())
    assert report["params"] == {"train_size": 16} and report["steps"] == 1  # faults are not part of the model
    assert vbuild.ensure_vlm(cfg(0), warm=tiny) == first and len(builds) == 1  # cached
    assert vbuild.ensure_vlm(cfg(1), warm=tiny) != first and len(builds) == 2  # another seed, another model


def test_compacting_undoes_the_expansion_and_refuses_a_cut_one() -> None:
    exp = [90, 93, 92, 92, 92, 90]  # <fake> <global-img> <image> x 3 <fake>
    compact = [5, 92, 6, 7, 92, 92, 8]
    expanded = expand_images(compact, 92, exp)
    assert expanded == [5, *exp, 6, 7, *exp, *exp, 8]
    assert compact_images(expanded, 92, exp) == compact
    assert compact_images([5, 6], 92, exp) == [5, 6]
    with pytest.raises(ValueError, match="position 3 is not inside a whole image expansion"):
        compact_images([5, 90, 93, 92, 92, 90], 92, exp)  # one image token short
    with pytest.raises(ValueError, match="position 0"):
        compact_images([92, 92, 92, 90], 92, exp)  # its head cut off


def _row_logprobs(model, ids, kwargs, start):  # logprob of each token of ids from position start on
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]) if not torch.is_tensor(ids) else ids, **kwargs).logits
    lp = torch.log_softmax(logits[0, :-1].float(), -1)
    tgt = torch.tensor(ids[1:]) if not torch.is_tensor(ids) else ids[0, 1:]
    return lp.gather(1, tgt[:, None])[start - 1:, 0]


def test_a_right_padded_batch_with_image_and_text_only_rows_scores_each_row_as_alone(vlm: Path, suite: DigitsSuite) -> None:
    """The trainer's layout (trainer/batch.py pad_batch: right-padded rows, a prompt's images as references): each
    row's response logprobs in the batch equal its forward alone; a text-only row needs no image; each distinct
    image is processed once."""
    import torch
    from transformers import AutoModelForImageTextToText

    from flashrl.vision.batch import PixelCache, vision_inputs

    proc = load_processor(vlm)
    tok, exp = proc.tokenizer, image_expansion(proc)
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32).eval()
    a, b = suite.eval_tasks()[:2]
    rows = [(expand_images(tok.encode(a.prompt, add_special_tokens=False), image_id, exp), [5, 6, 2], a.meta["images"]),
            (tok.encode("12+3=", add_special_tokens=False), [7, 2], []),
            (expand_images(tok.encode(b.prompt, add_special_tokens=False), image_id, exp), [8, 9, 10, 11, 2],
             b.meta["images"])]
    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.full((3, width), tok.pad_token_id)
    attn = torch.zeros((3, width), dtype=torch.long)
    for i, (p, r, _) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
    pixels = PixelCache(proc)
    kw = vision_inputs(pixels, [imgs for _, _, imgs in rows], [f"row {i}" for i in range(3)])
    assert kw["pixel_values"].shape == (3, 1, 3, 64, 64) and not kw["pixel_values"][1].any()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, **kw).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    for i, (p, r, imgs) in enumerate(rows):
        alone = vision_inputs(PixelCache(proc), [imgs], ["alone"])
        want = _row_logprobs(model, p + r, alone, len(p))
        assert torch.allclose(lp[i, len(p) - 1:len(p) + len(r) - 1], want, atol=1e-5), i
    vision_inputs(pixels, [a.meta["images"], b.meta["images"]], ["x", "y"])
    assert (pixels.misses, pixels.hits) == (2, 2)
    with pytest.raises(ImageLoadError, match="row 1: image 'png:"):
        vision_inputs(pixels, [[], [b"broken"]], ["row 0", "row 1"])


def test_a_prompt_with_its_image_forwarded_once_then_continued_from_its_cache_scores_as_whole(vlm: Path, suite: DigitsSuite) -> None:
    """trainer/step.py's shared-prefix path (each distinct prompt forwarded once with use_cache, the samples'
    continuations against its keys and values): the image goes with the prompt only."""
    import torch
    from transformers import AutoModelForImageTextToText

    from flashrl.vision.batch import PixelCache, vision_inputs

    proc = load_processor(vlm)
    tok, exp = proc.tokenizer, image_expansion(proc)
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32).eval()
    task = suite.eval_tasks()[0]
    prompt = expand_images(tok.encode(task.prompt, add_special_tokens=False), tok.convert_tokens_to_ids(IMAGE_TOKEN), exp)
    cont = [5, 6, 2]
    kw = vision_inputs(PixelCache(proc), [task.meta["images"]], ["row 0"])
    whole = _row_logprobs(model, prompt + cont, kw, len(prompt))
    with torch.no_grad():
        pre = model(input_ids=torch.tensor([prompt]), use_cache=True, **kw)
        nxt = model(input_ids=torch.tensor([cont]), past_key_values=pre.past_key_values,
                    position_ids=torch.arange(len(prompt), len(prompt) + len(cont))[None])
    logits = torch.cat([pre.logits[:, -1:], nxt.logits[:, :-1]], 1)[0]
    split = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
    assert torch.allclose(split, whole, atol=1e-5)


def test_the_trainer_loads_a_vlm_as_image_text_to_text_shards_both_towers_and_can_freeze_vision(vlm: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from flashrl.models.tiny import build_untrained as build_text
    from flashrl.vision.model import auto_class, freeze_vision, is_vision_model, shard_blocks, vision_names

    text = build_text(tmp_path / "tiny", seed=0)
    assert is_vision_model(vlm) and not is_vision_model(text) and not is_vision_model(tmp_path / "none")
    assert auto_class(vlm) is AutoModelForImageTextToText and auto_class(text) is AutoModelForCausalLM
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32)
    kinds = [type(b).__name__ for b in shard_blocks(model)]
    assert kinds == ["Idefics3EncoderLayer"] * 2 + ["LlamaDecoderLayer"] * 2
    assert type(model)._no_split_modules == ["Idefics3VisionAttention"]  # why shard_blocks does not read it
    assert [type(b).__name__ for b in shard_blocks(AutoModelForCausalLM.from_pretrained(str(text)))] == ["LlamaDecoderLayer"] * 2
    frozen = freeze_vision(model)
    assert frozen == sorted(vision_names(model)) and len(frozen) == 38
    assert all(n.startswith(("model.vision_model.", "model.connector.")) for n in frozen)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("model.text_model.") for n in trainable)
    with pytest.raises(ValueError, match="not a vision-language model"):
        freeze_vision(AutoModelForCausalLM.from_pretrained(str(text)))


def test_qwen2_vl_layout_concatenates_every_images_patches_with_one_grid_per_image() -> None:
    """The Qwen2-VL image processor (its PIL backend: no torchvision) through vision_inputs: patches of all
    images in row order, one (t, h, w) grid per image; nothing padded."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from flashrl.vision.batch import PixelCache, vision_inputs

    proc = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56 * 4))
    small, wide = (png_bytes(Image.new("RGB", size, c)) for size, c in (((56, 28), "red"), ((112, 56), "blue")))
    kw = vision_inputs(PixelCache(proc), [[small], [], [wide, small]], ["r0", "r1", "r2"])
    assert kw["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 8], [1, 2, 4]]
    assert kw["pixel_values"].shape == (8 + 32 + 8, 3 * 2 * 14 * 14)
