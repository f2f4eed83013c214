"""Images as a task carries them, and their loading: a reference on the wire, pixels only where a model needs them.

    ImageRef  = bytes (an encoded PNG/JPEG) | str / os.PathLike (a file path)   what a task, a wire message and a
                                                                                 per-sample record carry
    load_image(ref, where) -> PIL.Image (RGB)                                   ImageLoadError naming ``where`` and
                                                                                 the file on any failure
    as_ref(x)              -> ImageRef                                          a PIL image or an HxWx3 uint8 array
                                                                                 becomes PNG bytes; bytes/paths pass
    png_bytes(img)         -> bytes                                             deterministic PNG (no metadata)
    describe(ref)          -> str                                               a short name for logs and lineage:
                                                                                 the path, or "png:<sha1[:12]>"

Why references: a task's images travel from the dataset to the engine (vLLM's multimodal input) and to the
trainer (pixel values), and a sample's lineage records them; pixels (a 64x64 image is 48 KiB as float32) would
bloat every message and record. Encoded bytes or a path are wire-safe (msgspec, no pickle) and decode to the
same pixels everywhere. An image that does not load is the row's problem, not the run's: ImageLoadError says
which row and which file, and the caller counts and skips it (never a crash).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

__all__ = ["ImageLoadError", "ImageRef", "as_ref", "describe", "load_image", "png_bytes"]

ImageRef = bytes | str | os.PathLike


class ImageLoadError(ValueError):
    """An image of a row did not load (missing file, not an image, truncated bytes); the message names both."""


def png_bytes(img: Any) -> bytes:
    """``img`` (a PIL image) as PNG bytes, deterministic: no metadata, fixed compression."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def as_ref(x: Any) -> ImageRef:
    """A wire-safe reference for ``x``: bytes and paths as they are; a PIL image or an HxWx3 (or HxW) uint8
    array as PNG bytes. Anything else is a TypeError naming what is accepted."""
    if isinstance(x, (bytes, str, os.PathLike)):
        return x
    from PIL import Image

    if isinstance(x, Image.Image):
        return png_bytes(x)
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) in (2, 3) and str(getattr(x, "dtype", "")) == "uint8":
        return png_bytes(Image.fromarray(x))
    raise TypeError(f"an image must be PNG/JPEG bytes, a file path, a PIL image or an HxWx3 uint8 array, "
                    f"not {type(x).__name__}")


def describe(ref: ImageRef) -> str:
    """A short, stable name of ``ref`` for logs and lineage (never its pixels)."""
    if isinstance(ref, bytes):
        return f"png:{hashlib.sha1(ref).hexdigest()[:12]}"
    return str(ref)


def load_image(ref: ImageRef, where: str = "") -> Any:
    """``ref`` decoded to an RGB PIL image; ImageLoadError naming ``where`` (e.g. "row train-12") and the file."""
    from PIL import Image, UnidentifiedImageError

    at = f"{where}: " if where else ""
    try:
        if isinstance(ref, bytes):
            img = Image.open(io.BytesIO(ref))
        else:
            img = Image.open(Path(ref))
        img.load()  # decode now: a truncated file fails here, not later in a processor
        return img.convert("RGB")
    except FileNotFoundError:
        raise ImageLoadError(f"{at}image file {describe(ref)!r} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageLoadError(f"{at}image {describe(ref)!r} does not load: {e}") from None
