"""What the trainer needs to know of a vision-language policy: its class, its blocks to shard, its vision part.

    is_vision_model(folder)        config.json has a vision_config (Idefics3, Qwen2-VL, ...)
    auto_class(folder)             AutoModelForImageTextToText for a VLM (transformers maps neither Idefics3 nor
                                   Qwen2-VL to AutoModelForCausalLM, which trainer/worker.py and trainer/hf.py load),
                                   AutoModelForCausalLM otherwise
    shard_blocks(model)            the blocks FSDP2 wraps one by one: every child of a ModuleList named ``layers``
                                   or ``blocks`` (the text decoder's layers, the vision encoder's layers / Qwen2-VL's
                                   visual blocks). trainer/worker.py's ``_decoder_layers`` reads ``_no_split_modules``,
                                   which for Idefics3ForConditionalGeneration is ["Idefics3VisionAttention"] only: it
                                   would shard the vision attention modules and none of the decoder layers.
    vision_names(model)            the parameter names of the vision tower and the connector (vision_model.*,
                                   connector.* for Idefics3; visual.* for Qwen2-VL, its merger included)
    freeze_vision(model)           requires_grad off on those (``freeze_vision``: they neither train nor need to be
                                   sent by a weight sync: the engines loaded them from the folder); their names
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["auto_class", "freeze_vision", "is_vision_model", "is_vision_param", "shard_blocks", "vision_names"]

_VISION_PARTS = ("vision_model", "connector", "visual", "vision_tower", "multi_modal_projector")
_BLOCK_LISTS = ("layers", "blocks")


def is_vision_model(folder: str | Path) -> bool:
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def auto_class(folder: str | Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(folder) else AutoModelForCausalLM


def shard_blocks(model: Any) -> list[Any]:
    """The per-layer blocks of ``model`` (text and vision), in module order; RuntimeError when there are none."""
    import torch

    blocks = [child for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList)
              and name.rsplit(".", 1)[-1] in _BLOCK_LISTS for child in mod]
    if not blocks:
        raise RuntimeError(f"{type(model).__name__}: no ModuleList named {' or '.join(_BLOCK_LISTS)}: no blocks to shard")
    return blocks


def _is_vision(name: str) -> bool:
    parts = name.split(".")
    return any(p in _VISION_PARTS for p in parts[:3])


def is_vision_param(name: str) -> bool:
    """``name`` (a parameter's, or a state dict key) is of the vision tower or the connector."""
    return _is_vision(name)


def vision_names(model: Any) -> list[str]:
    return [n for n, _ in model.named_parameters() if _is_vision(n)]


def freeze_vision(model: Any) -> list[str]:
    """Stop the vision tower and the connector training; return their parameter names."""
    names = set(vision_names(model))
    if not names:
        raise ValueError(f"freeze_vision: {type(model).__name__} has no vision parameters "
                         f"(none under {', '.join(_VISION_PARTS)}); it is not a vision-language model")
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return sorted(names)
