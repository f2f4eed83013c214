"""Digits: the built-in visual RLVR task (an image of a number -> the number as text), generated with PIL.

    suite = DigitsSuite(Params(digits=2), seed=0, eval_size=30)
    task = suite.eval_tasks()[0]      # Task(prompt="<image>read:", answer="47", meta={"images": [PNG bytes]})
    env = suite.make_env(); prompt = await env.reset(task); res = await env.step("47")  # reward 1.0

The prompt's text holds one ``<image>`` (flashrl.vision.build.IMAGE_TOKEN) where the image goes; the image
itself travels as a reference beside it, ``meta["images"]`` (flashrl/vision/images.py: PNG bytes here,
a file path in a dataset), never as pixels. Each image is the number drawn in Pillow's built-in font
(FreeType, size ``font_size``) black on white, centred and moved by a seeded offset of up to ``jitter``
pixels, so two renderings of one number differ. The held-out split's numbers are never in the training split: ``random.Random(seed)`` permutes
all ``10**digits`` numbers, the first ``eval_size`` are held out, the rest train, each drawn
``train_size // len`` times at new offsets. The verifier compares the text up to the end-of-sequence mark,
stripped, with the number's digits exactly (leading zeros count: "007").

The handicap RL corrects (``teacher_answer``): the warm-start imitates a teacher that misreads look-alike
digits (``confusions``, default 7 -> 1 and 8 -> 3) with probability ``teacher_slip`` at each occurrence,
so a well-imitating policy reads every number holding a 7 or an 8 wrong greedily (36% of the 2-digit
numbers) and right in a 1 - slip fraction of samples; the exact verifier then rewards the right reading.
The probe and the reported accuracies always score against the true number.

Why 2 digits in font 36 (a glyph ~21 x 27 pixels in the 64-pixel image): the built-in model's vision
encoder learns from scratch, and on 3 digits in font 22 or 28 (glyphs of 13-16 pixels over 8-pixel
patches) its loss stayed at the digits' prior for 700-1000 SFT steps; 2 digits in font 36 broke away from
it after ~300 steps (1 digit in font 48: ~50). The held-out numbers are then at most 99: env.eval_size
is a few dozen (e.g. 30).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from flashrl.env import SingleTurnEnv, StepResult, Task, cut_at_eos

IMAGE_TOKEN = "<image>"  # flashrl.vision.build.IMAGE_TOKEN (not imported: an env loads without the vision package)


def verify(action: str, answer: str) -> bool:
    """The text of ``action`` up to the end-of-sequence mark, stripped, is exactly ``answer``'s digits."""
    return cut_at_eos(action).strip() == answer


@functools.lru_cache(maxsize=8)
def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)  # FreeType: Pillow's built-in font, the same on every machine


def render(number: str, size: int, font_size: int, rng: random.Random, jitter: int = 2) -> Any:
    """``number`` drawn black on white in a ``size`` x ``size`` RGB image, centred, then moved by up to
    ``jitter`` pixels in x and in y (seeded; within the image) (PIL image)."""
    from PIL import Image, ImageDraw

    font = _font(font_size)
    left, top, right, bottom = font.getbbox(number)
    room_x, room_y = size - (right - left), size - (bottom - top)
    if room_x < 0 or room_y < 0:
        raise ValueError(f"env.params: {len(number)} digits in font_size {font_size} do not fit a {size}-pixel image; "
                         "lower font_size or digits, or raise image_size")
    img = Image.new("RGB", (size, size), "white")
    dx, dy = (min(jitter, room // 2) for room in (room_x, room_y))
    x = room_x // 2 + rng.randint(-dx, dx) - left
    y = room_y // 2 + rng.randint(-dy, dy) - top
    ImageDraw.Draw(img).text((x, y), number, font=font, fill="black")
    return img


class DigitsEnv(SingleTurnEnv):
    """One episode: the prompt is the image and the question, the single step is the number read."""

    async def judge(self, task: Task, action: str) -> StepResult:
        ok = verify(action, task.answer)
        return StepResult(reward=1.0 if ok else 0.0, done=True, info={"correct": ok})


class DigitsSuite:
    WARM_START: ClassVar[dict[str, Any]] = {}

    class Params(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        """``[env.params]`` of the digits environment."""

        digits: Annotated[int, Meta(ge=1, le=4, description="digits of each number (leading zeros kept)")] = 2
        train_size: Annotated[int, Meta(ge=1, le=1_000_000, description="training images (numbers repeat at new offsets)")] = 8000
        image_size: Annotated[int, Meta(ge=16, le=1024, description="image side in pixels")] = 64
        font_size: Annotated[int, Meta(ge=6, le=512, description="font size in pixels")] = 36
        jitter: Annotated[int, Meta(ge=0, le=512, description="the number moves up to this many pixels from the centre in x and y")] = 2
        prompt: Annotated[str, Meta(description="the text after the image")] = "read:"
        teacher_slip: Annotated[float, Meta(ge=0, le=1, description=(
            "chance the warm-start's teacher misreads a confusable digit (confusions), drawn at each occurrence"))] = 0.65
        confusions: Annotated[dict[str, str], Meta(description="digit -> the digit the teacher misreads it as")] = (
            msgspec.field(default_factory=lambda: {"7": "1", "8": "3"}))

    def __init__(self, params: DigitsSuite.Params, seed: int, eval_size: int) -> None:
        bad = {k: v for k, v in params.confusions.items() if not (k.isdigit() and v.isdigit() and len(k) == len(v) == 1)}
        if bad:
            raise ValueError(f"env.params.confusions: {bad} is not single digit -> single digit")
        self.params = params
        space = 10**params.digits
        if eval_size >= space:
            raise ValueError(f"env.eval_size: {eval_size} held-out numbers leave none to train on ({space} numbers "
                             f"with digits={params.digits}); lower eval_size or raise digits")
        rng = random.Random(seed)
        numbers = [f"{n:0{params.digits}d}" for n in rng.sample(range(space), space)]
        held, rest = numbers[:eval_size], numbers[eval_size:]
        self._eval = [self._task(f"eval-{i}", n, rng) for i, n in enumerate(held)]
        self._train = [self._task(f"train-{i}", rest[i % len(rest)], rng) for i in range(params.train_size)]

    def _task(self, tid: str, number: str, rng: random.Random) -> Task:
        from flashrl.vision.images import png_bytes

        img = render(number, self.params.image_size, self.params.font_size, rng, self.params.jitter)
        return Task(id=tid, prompt=f"{IMAGE_TOKEN}{self.params.prompt}", answer=number,
                    meta={"images": [png_bytes(img)]})

    def teacher_answer(self, task: Task, rng: random.Random) -> str:
        """The warm-start teacher's reading of ``task``: each confusable digit misread with teacher_slip."""
        conf, slip = self.params.confusions, self.params.teacher_slip
        return "".join(conf[d] if d in conf and rng.random() < slip else d for d in task.answer)

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    def make_env(self) -> DigitsEnv:
        return DigitsEnv()
