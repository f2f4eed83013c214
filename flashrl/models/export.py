"""The trained policy as a Hugging Face model folder: what transformers and `vllm serve` load.

    end of `flashrl run`      trainer rank 0: full state dict -> save_hf_folder -> runs/<name>/final/
    flashrl export RUN_DIR --out DIR
        (no --step)           runs/<name>/final/ (the run finished), else the latest checkpoint
        --step N              runs/<name>/checkpoints/step-N/trainer/ (torch DCP, any world size)
                              -> model weights loaded without a process group -> save_hf_folder
    a LoRA run (model.lora.rank > 0): its checkpoints hold the adapter only (trainer/worker.py)
        (default)             the merged model (base + (alpha / rank) B A, peft's merge_and_unload), a HF folder
        --adapter             the adapter folder in peft format (adapter_model.safetensors + adapter_config.json,
                              base_model_name_or_path = the run's model folder): PeftModel.from_pretrained and
                              vLLM's LoRARequest load it

A folder holds config.json, model.safetensors (``save_pretrained``), the tokenizer files and
generation_config.json of the run's model. Every folder appears atomically: it is written under a
temporary name next to its destination, fsynced, then renamed; a reader never sees half of one.
Checkpoint folders are read as the checkpoint writer lays them out (flashrl/checkpoint.py:
``step-N/trainer/`` holds the DCP state whose ``model`` entry is the policy).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from flashrl.checkpoint import TRAINER_DIR, list_checkpoints, step_dir
from flashrl.trainer.hf import ExportError, publish, save_hf_folder

__all__ = ["ExportError", "export_run", "load_checkpoint_adapter", "load_checkpoint_weights", "save_hf_folder"]

log = logging.getLogger(__name__)

FINAL = "final"
CHECKPOINTS = "checkpoints"


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the complete checkpoints in ``run_dir`` (ascending; flashrl/checkpoint.py's layout)."""
    return [step for step, _ in list_checkpoints(Path(run_dir) / CHECKPOINTS)]


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


def load_checkpoint_adapter(trainer_dir: str | Path, base_dir: str | Path, spec: Any) -> dict[str, Any]:
    """The LoRA adapter of a trainer DCP checkpoint (``spec``: trainer/lora.py LoraSpec, the run's), under peft's
    saved names (what save_adapter writes); loaded in this process, without a process group. Reads the
    adapter entries only, so both an adapter-only checkpoint and an older full one give it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from flashrl.trainer.lora import adapter_entries, adapter_from_state_dict, apply_lora

    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, local_files_only=True),
                       spec)
    sd = adapter_entries(model.state_dict())
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": sd}, checkpoint_id=str(trainer_dir), no_dist=True)
    except Exception as e:
        raise ExportError(f"{trainer_dir}: cannot read the LoRA adapter of this checkpoint ({type(e).__name__}: "
                          f"{str(e)[:300]}); was it written by a run with the same model.lora?") from None
    return {k: v.detach().clone() for k, v in adapter_from_state_dict(sd).items()}


def _check_base(trainer_dir: Path, base: Path) -> None:
    """Refuse to export an adapter checkpoint with a base other than the one it was trained on (its recorded
    fingerprint, trainer/lora.py base_fingerprint); an older checkpoint without one is exported as before."""
    import json

    from flashrl.trainer.ckpt_writer import CHECKPOINT_META
    from flashrl.trainer.lora import base_mismatch

    meta_file = trainer_dir / CHECKPOINT_META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    bad = base_mismatch(meta.get("base_fingerprint"), meta.get("base_model"), base, str(trainer_dir))
    if bad:
        raise ExportError(bad)
    if meta.get("adapter_only") and not meta.get("base_fingerprint"):
        log.warning("%s records no base fingerprint (written before flashrl recorded one): the adapter is merged "
                    "into %s unchecked", trainer_dir, base)


def _copy_folder(src: Path, out: Path) -> None:
    """``src`` copied to the new folder ``out``, atomically (a temporary sibling, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        publish(tmp, out, replace=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, adapter: bool = False) -> tuple[Path, str]:
    """Export the policy of ``run_dir`` to the new folder ``out``; returns (out, what was exported).

    ``adapter`` (LoRA runs only): the peft adapter folder instead of the merged model."""
    from flashrl.config import load

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.toml").is_file():
        raise ExportError(f"{run_dir}: not a run folder (no config.toml); give runs/<name>")
    if out.exists():
        raise ExportError(f"{out} already exists; choose another --out or delete it")
    cfg = load(run_dir / "config.toml")
    lora = cfg.model.lora
    if adapter and not lora.rank:
        raise ExportError(f"{run_dir}: --adapter exports a LoRA adapter, and this run trained the full model "
                          "(model.lora.rank = 0); export without --adapter")
    final = run_dir / FINAL
    steps = checkpoint_steps(run_dir)
    if step is None and (final / "config.json").is_file():
        if adapter:
            if not (final / "adapter" / "adapter_config.json").is_file():
                raise ExportError(f"{final / 'adapter'}: missing (the final folder holds no adapter); export a "
                                  "checkpoint with --step N")
            _copy_folder(final / "adapter", out)
            return out, f"final adapter ({final / 'adapter'})"
        _copy_folder(final, out)
        return out, f"final policy ({final})"
    if step is None:
        if not steps:
            raise ExportError(f"{run_dir}: no final policy ({final} is missing: the run did not finish) and no "
                              f"checkpoints in {run_dir / CHECKPOINTS}")
        step = steps[-1]
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise ExportError(f"{run_dir}: no checkpoint for step {step} (checkpoints: {have})")
    trainer_dir = step_dir(run_dir / CHECKPOINTS, step) / TRAINER_DIR
    base = _run_model_dir(run_dir)
    if not lora.rank:
        weights = load_checkpoint_weights(trainer_dir, base)
        save_hf_folder(weights, base, out, dtype=cfg.model.dtype)
        return out, f"checkpoint step {step} ({trainer_dir})"
    from flashrl.trainer.lora import adapter_config, export_merged, save_adapter, spec_of

    _check_base(trainer_dir, base)
    spec = spec_of(lora)
    tensors = load_checkpoint_adapter(trainer_dir, base, spec)
    if adapter:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_adapter(out, tensors, adapter_config(spec, str(base)))
        return out, f"checkpoint step {step}'s adapter ({trainer_dir})"
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.adapter-", dir=out.parent if out.parent.exists() else None))
    try:
        export_merged(base, save_adapter(tmp / "adapter", tensors, adapter_config(spec, str(base))), out,
                      dtype=cfg.model.dtype)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, f"checkpoint step {step}, adapter merged ({trainer_dir})"
