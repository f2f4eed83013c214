"""The trainer's policy as a Hugging Face model folder, written atomically (``save_hf_folder``).

Used by the trainer (``SaveModel``: runs/<name>/final/) and by ``flashrl export``
(flashrl/models/export.py). The folder is written under a temporary name next to its destination,
fsynced, then renamed: a reader never sees half of one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ExportError", "publish", "save_hf_folder"]


class ExportError(RuntimeError):
    """Nothing to export as asked, or weights that do not fit; the message names what and the fix."""


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in [*sorted(p for p in path.rglob("*") if p.is_dir()), path]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(tmp: Path, out: Path, replace: bool) -> None:
    """Rename the complete folder ``tmp`` to ``out``; ``replace``: an existing ``out`` is swapped out first."""
    _fsync_tree(tmp)
    old = None
    if out.exists():
        if not replace:
            raise ExportError(f"{out} already exists; choose another --out or delete it")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    os.rename(tmp, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_hf_folder(state_dict: dict[str, Any], base_dir: str | Path, out: str | Path, dtype: str = "float32",
                   replace: bool = False) -> Path:
    """Write ``state_dict`` (full, unsharded) as a Hugging Face folder at ``out``, atomically.

    Architecture, tokenizer and generation config come from ``base_dir`` (the run's model folder);
    weights are cast to ``dtype`` (model.dtype). ``replace``: an existing ``out`` is replaced, else refused.
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from flashrl.vision.model import auto_class

    base, out = Path(base_dir), Path(out)
    if out.exists() and not replace:
        raise ExportError(f"{out} already exists; choose another --out or delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config = AutoConfig.from_pretrained(str(base), local_files_only=True)
        with torch.device("meta"):
            model = auto_class(base).from_config(config, dtype=torch.float32)  # a VLM: AutoModelForImageTextToText
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ExportError(f"weights do not fit {type(model).__name__} of {base}: missing {sorted(missing)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}")
        if tied:
            model.tie_weights()
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(base), local_files_only=True).save_pretrained(str(tmp))
        if (base / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(str(base), local_files_only=True).save_pretrained(str(tmp))
        for name in ("processor_config.json", "preprocessor_config.json", "chat_template.jinja"):  # a VLM's processor
            if (base / name).is_file() and not (tmp / name).is_file():
                shutil.copy2(base / name, tmp / name)
        publish(tmp, out, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
