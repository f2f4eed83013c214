"""The controller's side of images: a task's (or an observation's) images onto its token ids, token-exactly; the
controller never decodes an image, and encodes one only off its event loop.

    vp = VisionPrompts.of(folder)                 once per run (launch/driver.py, off the event loop): the model's
                                                  image token id, what one becomes (the processor's expansion) and
                                                  the expansion's special tokens, which sampling bans
    refs, err = await vp.refs(task, prompt_ids)   the task's meta["images"] as wire references
                                                  (wire.trajectory.Image: bytes, or an absolute path) and "" -- or
                                                  [] and the reason the row cannot be served (its <image> tokens
                                                  and its images do not pair up, an image of an unsupported
                                                  type): the rollout fails that sample, counted
    refs, err = await vp.observed(images, ids, where)   the same for a multi-turn observation (StepResult.images
                                                  against the observation turn's ids)
    vp.expand(ids) / vp.compact(ids)              compact (one image token per image: what an engine is sent) <->
                                                  expanded (what the trajectory, the trainer and lineage keep)

Only references pass through the controller (bytes or a path): the pixels are decoded by the engine (in a thread
of its own, flashrl/engine/server.py) and by the trainer (flashrl/vision/batch.py PixelCache), never on the
controller's event loop. A PIL image or an HxWx3 uint8 array is encoded to PNG bytes (lossless: the engine and
the trainer decode the same pixels) in a worker thread (``asyncio.to_thread``), never on the loop; a list of
bytes and paths costs no thread.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrl.vision.images import as_ref
from flashrl.vision.tokens import IMAGE_TOKEN, compact_images, expand_images
from flashrl.wire.trajectory import Image

__all__ = ["VisionPrompts", "encode_images"]

ACCEPTED = "PNG/JPEG bytes, a file path, a PIL image or an HxWx3 uint8 array"


@dataclass(frozen=True)
class VisionPrompts:
    image_id: int
    expansion: tuple[int, ...]
    banned: tuple[int, ...]  # the expansion's special tokens: sampling never picks one (processor.image_token_ids)

    @classmethod
    def of(cls, folder: str | Path) -> VisionPrompts:
        from flashrl.vision.processor import image_expansion, image_token_ids, load_processor

        proc = load_processor(folder)
        image_id = proc.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        return cls(image_id=int(image_id), expansion=tuple(image_expansion(proc)), banned=tuple(image_token_ids(proc)))

    async def refs(self, task: Any, prompt_ids: Sequence[int]) -> tuple[list[Image], str]:
        """``task``'s images as wire references, or the reason its row cannot be served (module docstring)."""
        images = (getattr(task, "meta", None) or {}).get("images") or []
        return await self.observed(images, prompt_ids, f"row {getattr(task, 'id', '?')}")

    async def observed(self, images: Sequence[Any], ids: Sequence[int], where: str,
                       source: str = "meta['images']") -> tuple[list[Image], str]:
        """``images`` (in the order of ``ids``' image tokens) as wire references, or why they cannot be served."""
        slots = sum(1 for t in ids if t == self.image_id)
        if slots != len(images):
            return [], (f"{where}: its text holds {slots} {IMAGE_TOKEN} token(s) for {len(images)} image(s) in "
                        f"{source}; put one {IMAGE_TOKEN} in the text where each image goes")
        refs, err = await encode_images(images)
        if err:
            return [], f"{where}: {err} in {source}; give {ACCEPTED}"
        return _wire(refs), ""

    def expand(self, ids: Sequence[int]) -> list[int]:
        return expand_images(ids, self.image_id, self.expansion)

    def compact(self, ids: Sequence[int]) -> list[int]:
        return compact_images(ids, self.image_id, self.expansion)


def _wire(refs: Sequence[Any]) -> list[Image]:
    """References as the wire carries them: bytes, or an absolute path (the engines and the trainer may run in
    another working directory)."""
    return [Image(data=r) if isinstance(r, bytes) else Image(path=os.path.abspath(os.fspath(r))) for r in refs]


def _is_ref(x: Any) -> bool:
    return isinstance(x, (bytes, str, os.PathLike))


def _encode(images: Sequence[Any]) -> tuple[list[Any], str]:
    """``images`` as references (a PIL image or an array as PNG bytes: flashrl.vision.images.as_ref), or the
    first one of an unsupported type named. Runs in a worker thread (encode_images)."""
    out = []
    for k, x in enumerate(images):
        try:
            out.append(as_ref(x))
        except TypeError:
            return [], f"image {k} is a {type(x).__name__}"
    return out, ""


async def encode_images(images: Sequence[Any]) -> tuple[list[Any], str]:
    """``images`` as references (bytes or paths), encoding any PIL image or array in a worker thread: never on the
    event loop (a 64x64 PNG takes ~0.3 ms, a photo tens of ms). Bytes and paths alone take no thread."""
    if all(_is_ref(x) for x in images):
        return list(images), ""
    return await asyncio.to_thread(_encode, images)
