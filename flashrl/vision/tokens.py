"""Image placeholders in token ids: the compact form an engine takes, the expanded form the trainer and lineage keep.

    compact:  ... <image> read: ...                             one IMAGE_TOKEN per image (what vLLM is sent:
                                                                 it expands each itself)
    expanded: ... <fake> <global-img> <image> x N <fake> read:   the processor's ids (build.image_expansion):
                                                                 what the model forwards, token-exactly

    expand_images(ids, image_id, expansion)   compact -> expanded
    compact_images(ids, image_id, expansion)  expanded -> compact (exact inverse; ValueError on a broken run)

Why both: vLLM expands every IMAGE_TOKEN of a prompt, even one already expanded (Idefics3: 25 ids became
43; flashrl/vision/__init__.py), so a prompt that goes back to an engine (a multi-turn continuation, a
sample resumed after a weight update: prompt + response so far) must be compacted first, while the
trainer's forward and the per-sample record hold the expanded ids the engine reported.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IMAGE_TOKEN", "IMAGE_TOKENS", "compact_images", "expand_images"]

IMAGE_TOKEN = "<image>"  # one per image in a prompt's text, where the image goes (builtin:vlm's, Idefics3's)
# Idefics3Processor's tokens (its __init__ adds any missing; builtin:vlm saves them first so the ids are fixed)
IMAGE_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>")


def expand_images(ids: Sequence[int], image_id: int, expansion: Sequence[int]) -> list[int]:
    """``ids`` with each ``image_id`` replaced by ``expansion`` (the processor's, which vLLM applies too)."""
    out: list[int] = []
    for t in ids:
        out.extend(expansion if t == image_id else (t,))
    return out


def compact_images(ids: Sequence[int], image_id: int, expansion: Sequence[int]) -> list[int]:
    """``ids`` with each full ``expansion`` run replaced by one ``image_id``: ``expand_images``' inverse. An
    ``image_id`` outside a full run (a cut or edited expansion) is a ValueError naming its position."""
    ids, exp, n = list(ids), list(expansion), len(expansion)
    first = exp.index(image_id)  # where the expansion's first image token sits in it
    out: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i] == image_id:
            start = i - first
            if start < 0 or ids[start:start + n] != exp or out[len(out) - first:] != exp[:first]:
                raise ValueError(f"compact_images: the image token at position {i} is not inside a whole image "
                                 f"expansion ({n} ids); the prompt was cut or edited")
            del out[len(out) - first:]
            out.append(image_id)
            i = start + n
        else:
            out.append(ids[i])
            i += 1
    return out
