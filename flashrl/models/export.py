"""The trained policy as a Hugging Face model folder: what transformers and `vllm serve` load.

    end of `flashrl run`      trainer rank 0: full state dict -> save_hf_folder -> runs/<name>/final/
    flashrl export RUN_DIR --out DIR
        (no --step)           runs/<name>/final/ (the run finished), else the latest checkpoint
        --step N              runs/<name>/checkpoints/step-N/trainer/ (torch DCP, any world size)
                              -> model weights loaded without a process group -> save_hf_folder

A folder holds config.json, model.safetensors (``save_pretrained``), the tokenizer files and
generation_config.json of the run's model. Every folder appears atomically: it is written under a
temporary name next to its destination, fsynced, then renamed; a reader never sees half of one.
Checkpoint folders are read as the checkpoint writer lays them out (flashrl/checkpoint.py:
``step-N/trainer/`` holds the DCP state whose ``model`` entry is the policy).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

__all__ = ["ExportError", "export_run", "load_checkpoint_weights", "save_hf_folder"]

log = logging.getLogger(__name__)

FINAL = "final"
CHECKPOINTS = "checkpoints"
_STEP_RE = re.compile(r"^step-(\d+)$")


class ExportError(RuntimeError):
    """The run folder holds nothing to export as asked; the message names what is missing and the fix."""


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


def _publish(tmp: Path, out: Path, replace: bool) -> None:
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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    base, out = Path(base_dir), Path(out)
    if out.exists() and not replace:
        raise ExportError(f"{out} already exists; choose another --out or delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config = AutoConfig.from_pretrained(str(base), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
        _publish(tmp, out, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the complete checkpoints in ``run_dir`` (ascending)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name)))


def load_checkpoint_weights(trainer_dir: str | Path, base_dir: str | Path) -> dict[str, Any]:
    """The policy weights of a trainer DCP checkpoint, loaded in this process (no process group needed).

    The model of ``base_dir`` gives the names and shapes; DCP reads only the ``model`` entry (not the
    optimizer state) from whatever world size wrote it.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, local_files_only=True)
    sd = {k: v for k, v in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": sd}, checkpoint_id=str(trainer_dir), no_dist=True)
    except Exception as e:
        raise ExportError(f"{trainer_dir}: cannot read the policy weights of this checkpoint "
                          f"({type(e).__name__}: {str(e)[:300]})") from None
    return sd


def _run_model_dir(run_dir: Path) -> Path:
    """The model folder a run trained (from its resolved config.toml): config, tokenizer, generation config."""
    from flashrl.config import ConfigError, load
    from flashrl.models import ModelPathError, ensure_model

    cfg_path = run_dir / "config.toml"
    try:
        cfg = load(cfg_path)
        return Path(ensure_model(cfg))
    except (ConfigError, ModelPathError) as e:
        raise ExportError(f"{run_dir}: cannot find the run's model folder: {e}") from None


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, str]:
    """Export the policy of ``run_dir`` to the new folder ``out``; returns (out, what was exported)."""
    from flashrl.config import load

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.toml").is_file():
        raise ExportError(f"{run_dir}: not a run folder (no config.toml); give runs/<name>")
    if out.exists():
        raise ExportError(f"{out} already exists; choose another --out or delete it")
    final = run_dir / FINAL
    steps = checkpoint_steps(run_dir)
    if step is None and (final / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            shutil.copytree(final, tmp, dirs_exist_ok=True)
            _publish(tmp, out, replace=False)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out, f"final policy ({final})"
    if step is None:
        if not steps:
            raise ExportError(f"{run_dir}: no final policy ({final} is missing: the run did not finish) and no "
                              f"checkpoints in {run_dir / CHECKPOINTS}")
        step = steps[-1]
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise ExportError(f"{run_dir}: no checkpoint for step {step} (checkpoints: {have})")
    trainer_dir = run_dir / CHECKPOINTS / f"step-{step}" / "trainer"
    base = _run_model_dir(run_dir)
    weights = load_checkpoint_weights(trainer_dir, base)
    save_hf_folder(weights, base, out, dtype=load(run_dir / "config.toml").model.dtype)
    return out, f"checkpoint step {step} ({trainer_dir})"
