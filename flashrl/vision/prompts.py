"""The controller's side of images: a task's image references onto its prompt, token-exactly, never decoded here.

    vp = VisionPrompts.of(folder)            once per run (launch/driver.py, off the event loop): the model's
                                             image token id, what one becomes (the processor's expansion) and the
                                             expansion's special tokens, which sampling bans
    refs, err = vp.refs(task, prompt_ids)    the task's meta["images"] as wire references (wire.trajectory.Image:
                                             bytes, or an absolute path) and "" -- or [] and the reason the row cannot be served (its
                                             <image> tokens and its images do not pair up, an image of an
                                             unsupported type): the rollout fails that sample, counted
    vp.expand(ids) / vp.compact(ids)         compact (one image token per image: what an engine is sent) <->
                                             expanded (what the trajectory, the trainer and lineage keep)

Only references pass through the controller (bytes or a path): the pixels are decoded by the engine (in a thread
of its own, flashrl/engine/server.py) and by the trainer (flashrl/vision/batch.py PixelCache), never on the
controller's event loop. A PIL image or a uint8 array in meta["images"] would have to be encoded here (on the
loop), so it is refused with the fix: give PNG/JPEG bytes (flashrl.vision.png_bytes) or a file path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrl.vision.tokens import IMAGE_TOKEN, compact_images, expand_images
from flashrl.wire.trajectory import Image

__all__ = ["VisionPrompts"]


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

    def refs(self, task: Any, prompt_ids: Sequence[int]) -> tuple[list[Image], str]:
        """``task``'s images as wire references, or the reason its row cannot be served (module docstring)."""
        images = (getattr(task, "meta", None) or {}).get("images") or []
        slots = sum(1 for t in prompt_ids if t == self.image_id)
        where = f"row {getattr(task, 'id', '?')}"
        if slots != len(images):
            return [], (f"{where}: its prompt holds {slots} {IMAGE_TOKEN} token(s) for {len(images)} image(s) in "
                        f"meta['images']; put one {IMAGE_TOKEN} in the prompt's text where each image goes")
        out: list[Image] = []
        for k, ref in enumerate(images):
            if isinstance(ref, bytes):
                out.append(Image(data=ref))
            elif isinstance(ref, (str, os.PathLike)):
                out.append(Image(path=os.path.abspath(os.fspath(ref))))  # the engines and the trainer may run elsewhere (cwd)
            else:
                return [], (f"{where}: image {k} is a {type(ref).__name__}; meta['images'] takes PNG/JPEG bytes "
                            "(flashrl.vision.png_bytes(img)) or a file path, so the controller never encodes pixels")
        return out, ""

    def expand(self, ids: Sequence[int]) -> list[int]:
        return expand_images(ids, self.image_id, self.expansion)

    def compact(self, ids: Sequence[int]) -> list[int]:
        return compact_images(ids, self.image_id, self.expansion)
