"""The trainer's side of images: a padded batch's rows' image references -> the model's image inputs.

    pixels = PixelCache(processor)                      one per trainer rank: each distinct image is decoded and
                                                        processed once (a GRPO group's samples share their prompt's
                                                        images), the least recently used dropped past ``limit``
    kwargs = vision_inputs(pixels, rows, where)         rows[i]: the image references of batch row i, in prompt
                                                        order (none for a text-only row); where[i] names the row
                                                        in errors. -> keyword arguments of the model's forward:
      Idefics3 layout  pixel_values [B, N, 3, H, W], pixel_attention_mask [B, N, H, W]  (N = most images of a row;
                       a row's missing images are all zero, which the model skips)
      Qwen2-VL layout  pixel_values [patches of every image, in row order, dim], image_grid_thw [images, 3]
                       (the forward then also needs mm_token_type_ids: flashrl/vision/__init__.py)
      {}               when no row has an image

The batch's token ids are the expanded ones (flashrl/vision/tokens.py): a row holds image_seq_len image tokens
per image, in the order of its references, and the model fills them from these inputs in that order. A
reference that does not load or process raises ImageLoadError naming the row and the file -- or, given
``skipped`` (the trainer's batch: trainer/batch.py with_images), that row's images become a blank image of the
processor's fixed size (so every tensor keeps its shape, on every rank) and the row's index is appended to
``skipped``: the caller takes the row out of the loss, counted. A processor that splits images into a
variable number of tiles (or Qwen2-VL's variable grid) has no blank of the right size: the error is raised.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from flashrl.vision.images import ImageLoadError, ImageRef, describe, load_image

log = logging.getLogger(__name__)

__all__ = ["PixelCache", "vision_inputs"]


class PixelCache:
    """Processed images by reference (``describe(ref)``: a path, or the bytes' hash), least recently used out."""

    def __init__(self, processor: Any, limit: int = 1024) -> None:
        self.processor = processor
        self.limit = limit
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, ref: ImageRef, where: str) -> dict[str, Any]:
        """``ref`` processed alone: the image processor's tensors for a batch of one image."""
        key = describe(ref)
        item = self._items.get(key)
        if item is not None:
            self.hits += 1
            self._items.move_to_end(key)
            return item
        self.misses += 1
        image = load_image(ref, where)
        try:
            out = self.processor.image_processor(images=[[image]], return_tensors="pt")
        except Exception as e:  # a decoded image the processor refuses: the row's problem, named like a load error
            raise ImageLoadError(f"{where}: image {describe(ref)!r} does not process: {type(e).__name__}: {e}") from None
        item = {k: v for k, v in out.items()}
        self._items[key] = item
        if len(self._items) > self.limit:
            self._items.popitem(last=False)
        return item

    def blank(self) -> dict[str, Any] | None:
        """A black image of the processor's fixed size, processed (what a skipped row's images become); None when
        the processor's image size is not fixed (image splitting, or no square ``longest_edge``)."""
        ip = self.processor.image_processor
        edge = (getattr(ip, "size", None) or {}).get("longest_edge")
        if getattr(ip, "do_image_splitting", False) or not edge:
            return None
        if "\0blank" not in self._items:
            from PIL import Image

            out = ip(images=[[Image.new("RGB", (edge, edge))]], return_tensors="pt")
            self._items["\0blank"] = {k: v for k, v in out.items()}
        return self._items["\0blank"]


def vision_inputs(pixels: PixelCache, rows: Sequence[Sequence[ImageRef]], where: Sequence[str],
                  skipped: list[int] | None = None) -> dict[str, Any]:
    """The forward's image keyword arguments for a batch whose row i holds the images ``rows[i]``; ``skipped``:
    rows whose images fail are blanked and listed there instead of raising (module doc)."""
    import torch

    per_row = [_row(pixels, refs, where[i], i, skipped) for i, refs in enumerate(rows)]
    flat = [item for row in per_row for item in row]
    if not flat:
        return {}
    if "image_grid_thw" in flat[0]:  # Qwen2-VL: patches of all images concatenated, one grid per image
        return {"pixel_values": torch.cat([item["pixel_values"] for item in flat]),
                "image_grid_thw": torch.cat([item["image_grid_thw"] for item in flat])}
    if "pixel_attention_mask" not in flat[0]:
        raise ValueError(f"vision_inputs: an image processor returning {sorted(flat[0])} is neither the Idefics3 "
                         "layout (pixel_values, pixel_attention_mask) nor Qwen2-VL's (pixel_values, image_grid_thw)")
    n = max(len(row) for row in per_row)
    values = torch.zeros((len(rows), n, *flat[0]["pixel_values"].shape[2:]), dtype=flat[0]["pixel_values"].dtype)
    mask = torch.zeros((len(rows), n, *flat[0]["pixel_attention_mask"].shape[2:]),
                       dtype=flat[0]["pixel_attention_mask"].dtype)
    for i, row in enumerate(per_row):
        for j, item in enumerate(row):
            values[i, j] = item["pixel_values"][0, 0]
            mask[i, j] = item["pixel_attention_mask"][0, 0]
    return {"pixel_values": values, "pixel_attention_mask": mask}


def _row(pixels: PixelCache, refs: Sequence[ImageRef], where: str, i: int, skipped: list[int] | None) -> list[Any]:
    """Row ``i``'s processed images; on a failure, with ``skipped`` given and a blank of the right size, blanks
    (row i listed in ``skipped``, the failure logged with its row and file)."""
    try:
        return [pixels.get(ref, where) for ref in refs]
    except ImageLoadError as e:
        blank = pixels.blank() if skipped is not None else None
        if skipped is None or blank is None:
            raise
        log.warning("trainer: sample skipped (out of the loss): %s", e)
        skipped.append(i)
        return [blank for _ in refs]
