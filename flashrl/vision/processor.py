"""A model folder's processor, and what one image token of a prompt becomes.

    load_processor(folder)        the folder's processor (AutoProcessor, offline; builtin:vlm's: Idefics3Processor
                                  with the PIL image processor); a folder without one is a ValueError naming it
    image_expansion(processor)    the token ids one IMAGE_TOKEN of a prompt becomes (the processor's expansion,
                                  which vLLM applies too: flashrl/vision/__init__.py)
    image_token_ids(processor)    the ids of that expansion's special tokens: a policy must never sample one (an
                                  image token in a response has no pixels behind it: the model's forward then
                                  fails, "Number of elements of source < number of ones in mask"), so sampling
                                  bans them (warm.py; an engine would pass them as banned tokens)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashrl.vision.tokens import IMAGE_TOKEN

__all__ = ["image_expansion", "image_token_ids", "load_processor"]


def load_processor(folder: str | Path) -> Any:
    """The processor saved in ``folder`` (offline); a folder without one is a ValueError saying so."""
    from transformers import AutoProcessor

    p = Path(folder)
    if not (p / "processor_config.json").is_file() and not (p / "preprocessor_config.json").is_file():
        raise ValueError(f"{p}: no image processor (processor_config.json / preprocessor_config.json): a model "
                         "for tasks with images needs one; use builtin:vlm or a vision-language model folder")
    return AutoProcessor.from_pretrained(str(p), local_files_only=True)


def image_expansion(processor: Any) -> list[int]:
    """The ids one IMAGE_TOKEN of a prompt becomes once expanded (the processor's, which vLLM applies too):
    for this model ``<fake_token_around_image> <global-img> <image> x image_seq_len <fake_token_around_image>``."""
    from PIL import Image

    side = int(processor.image_processor.size["longest_edge"])
    ids = processor(text=IMAGE_TOKEN, images=[Image.new("RGB", (side, side))], return_tensors="pt")["input_ids"]
    return [int(i) for i in ids[0]]


def image_token_ids(processor: Any) -> list[int]:
    """The distinct special-token ids of an image's expansion (module docstring: never to be sampled)."""
    text = set(processor.tokenizer.encode("a", add_special_tokens=False))
    return sorted(set(image_expansion(processor)) - text)
