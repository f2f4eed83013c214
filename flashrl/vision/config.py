"""``[vision]``: vision-language policies (flashrl/vision): what the trainer does with the vision tower."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class VisionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[vision]``: a vision-language policy's vision tower in training (docs/models.md: vision-language
    models). A text-only model with ``freeze = true`` is a config error (flashrl validate)."""

    freeze: Annotated[bool, Meta(description=(
        "keep the vision encoder and the connector at their loaded weights: they neither train nor travel in a "
        "weight sync (the engines keep the ones they loaded); checkpoints and export still hold them"))] = False
