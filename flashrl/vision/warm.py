"""The warm-start (SFT) of the built-in vision-language model on a visual env's train split.

    warm_start(folder, suite, warm, seed) -> report
      each step: ``batch`` train tasks drawn (seeded) -> images loaded from their references
                 (flashrl/vision/images.py) -> the processor's pixel values -> prompt ids with each image
                 token expanded as vLLM expands it (build.image_expansion) + the teacher's answer + EOS
                 -> cross-entropy on the answer and EOS only (the prompt and the image tokens are masked)
      every ``check_every`` steps from ``min_steps`` on: greedy accuracy on ``probe_size`` train tasks against
      the true answers; stop once it reaches ``target_accuracy`` (or at ``max_steps``)
      -> the model saved in place; report: steps, probe and held-out greedy accuracy, held-out accuracy of one
         sample at temperature 1, seconds, and the time spent turning images into pixel values per image
         (``preprocess_ms_per_image``)

The teacher is the suite's ``teacher_answer(task, rng)`` when it has one (envs/digits.py: a reader that
misreads look-alike digits, the handicap RL corrects), else the task's answer. Everything is seeded and
runs on one torch thread (build.ensure_vlm), so a key builds the same weights everywhere.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from flashrl.env import Task
from flashrl.vision.tokens import IMAGE_TOKEN, expand_images

__all__ = ["Batch", "VisionWarmStart", "greedy_answers", "make_batch", "warm_start"]


class VisionWarmStart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Supervised warm-start of builtin:vlm (prompt with image -> the teacher's answer + EOS)."""

    max_steps: Annotated[int, Meta(ge=0, description="most optimizer steps")] = 1500
    batch: Annotated[int, Meta(ge=1, description="sequences per step")] = 32
    lr: Annotated[float, Meta(gt=0, description="AdamW learning rate (constant)")] = 1e-3
    target_accuracy: Annotated[float, Meta(ge=0, le=1, description="stop once probe accuracy reaches this")] = 0.5
    min_steps: Annotated[int, Meta(ge=0, description="never stop before this many steps")] = 750
    check_every: Annotated[int, Meta(ge=1, description="steps between probe evaluations")] = 250
    probe_size: Annotated[int, Meta(ge=1, description="train tasks in the probe")] = 256


class Batch(msgspec.Struct, kw_only=True):
    """Model inputs of a batch: token ids (all rows the same length), the loss mask, processed images."""

    ids: Any  # LongTensor (B, T)
    loss_mask: Any  # BoolTensor (B, T): True where the token is a trained target
    pixel_values: Any  # FloatTensor (B, images, 3, H, W)
    pixel_attention_mask: Any  # BoolTensor (B, images, H, W)


def _pixels(processor: Any, tasks: Sequence[Task]) -> tuple[Any, Any]:
    from flashrl.vision.images import load_image

    images = [[load_image(ref, f"row {t.id}") for ref in t.meta.get("images", [])] for t in tasks]
    out = processor.image_processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["pixel_attention_mask"]


def make_batch(processor: Any, tasks: Sequence[Task], answers: Sequence[str], expansion: Sequence[int]) -> Batch:
    """Inputs for ``tasks`` with ``answers`` (+ EOS) as targets; every row must come out the same length."""
    import torch

    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    rows, masks = [], []
    for task, answer in zip(tasks, answers):
        prompt = expand_images(tok.encode(task.prompt, add_special_tokens=False), image_id, expansion)
        target = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        rows.append(prompt + target)
        masks.append([False] * len(prompt) + [True] * len(target))
    if len({len(r) for r in rows}) != 1:
        raise ValueError("make_batch: rows of different lengths (prompts and answers must have fixed lengths)")
    pixel_values, pixel_mask = _pixels(processor, tasks)
    return Batch(ids=torch.tensor(rows), loss_mask=torch.tensor(masks), pixel_values=pixel_values,
                 pixel_attention_mask=pixel_mask)


def _loss(model: Any, b: Batch) -> Any:
    import torch

    logits = model(input_ids=b.ids, pixel_values=b.pixel_values, pixel_attention_mask=b.pixel_attention_mask).logits
    pred, target, mask = logits[:, :-1], b.ids[:, 1:], b.loss_mask[:, 1:]
    return torch.nn.functional.cross_entropy(pred[mask], target[mask])


def greedy_answers(model: Any, processor: Any, tasks: Sequence[Task], expansion: Sequence[int], max_new: int,
                   sample: Any = None) -> list[str]:
    """Greedy answers of ``model`` (no KV cache: the whole sequence each token, at this size not slower);
    ``sample`` (a torch.Generator): sampled at temperature 1 instead. Image tokens are never drawn
    (processor.image_token_ids)."""
    import torch

    from flashrl.vision.processor import image_token_ids

    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    ids = torch.tensor([expand_images(tok.encode(t.prompt, add_special_tokens=False), image_id, expansion) for t in tasks])
    pixel_values, pixel_mask = _pixels(processor, tasks)
    done = torch.zeros(len(tasks), dtype=torch.bool)
    banned = torch.tensor(image_token_ids(processor))
    new: list[Any] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=ids, pixel_values=pixel_values, pixel_attention_mask=pixel_mask).logits
            last = logits[:, -1].index_fill(1, banned, float("-inf"))
            nxt = last.argmax(-1) if sample is None else torch.multinomial(last.softmax(-1), 1, generator=sample)[:, 0]
            nxt = torch.where(done, torch.full_like(nxt, tok.eos_token_id), nxt)
            new.append(nxt)
            done |= nxt == tok.eos_token_id
            ids = torch.cat([ids, nxt[:, None]], 1)
            if bool(done.all()):
                break
    eos = tok.eos_token_id
    cut = [row[: row.index(eos)] if eos in row else row for row in torch.stack(new, 1).tolist()]
    return [tok.decode(row, skip_special_tokens=True) for row in cut]


def _accuracy(model: Any, processor: Any, tasks: Sequence[Task], expansion: Sequence[int], chunk: int = 64,
              sample: Any = None) -> float:
    if not tasks:
        return 0.0
    max_new = max(len(t.answer) for t in tasks) + 1
    right = 0
    for i in range(0, len(tasks), chunk):
        part = tasks[i:i + chunk]
        got = greedy_answers(model, processor, part, expansion, max_new, sample)
        right += sum(a.strip() == t.answer for a, t in zip(got, part))
    return right / len(tasks)


def warm_start(folder: str | Path, suite: Any, warm: VisionWarmStart, seed: int = 0,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the model saved in ``folder`` on ``suite``'s train split (module docstring); save it; the report."""
    import torch
    from transformers import AutoModelForImageTextToText

    from flashrl.vision.processor import image_expansion, load_processor

    t0 = time.monotonic()
    processor = load_processor(folder)
    expansion = image_expansion(processor)
    model: Any = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    train, held = list(suite.train_tasks()), list(suite.eval_tasks())
    rng = random.Random(seed)
    torch.manual_seed(seed)
    probe = rng.sample(train, min(warm.probe_size, len(train)))
    teacher = getattr(suite, "teacher_answer", None)
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr)
    step, probe_acc, prep_s, prep_n = 0, 0.0, 0.0, 0
    model.train()
    while step < warm.max_steps:
        tasks = [train[rng.randrange(len(train))] for _ in range(warm.batch)]
        answers = [teacher(t, rng) if callable(teacher) else t.answer for t in tasks]
        p0 = time.monotonic()
        b = make_batch(processor, tasks, answers, expansion)
        prep_s, prep_n = prep_s + time.monotonic() - p0, prep_n + len(tasks)
        loss = _loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step >= warm.min_steps and step % warm.check_every == 0:
            model.eval()
            probe_acc = _accuracy(model, processor, probe, expansion)
            model.train()
            log(f"vlm warm-start step {step}: loss {loss.item():.3f}, probe accuracy {probe_acc:.3f}")
            if probe_acc >= warm.target_accuracy:
                break
    model.eval()
    eval_acc = _accuracy(model, processor, held, expansion)
    # one sample per held-out task at temperature 1: what a rollout draws (RL's signal is where it beats greedy)
    sampled = _accuracy(model, processor, held, expansion, sample=torch.Generator().manual_seed(seed))
    model.save_pretrained(str(folder), safe_serialization=True)
    return {"steps": step, "probe_accuracy": probe_acc, "eval_accuracy": eval_acc, "eval_sampled_accuracy": sampled,
            "seconds": round(time.monotonic() - t0, 1),
            "preprocess_ms_per_image": round(1000 * prep_s / max(prep_n, 1), 3)}
