"""LoRA adapters on the wire and on disk, shared by the trainer's end (trainer/lora.py) and the engine's
(engine/lora.py) and owned by neither.

- The sync: the adapter's tensors (peft names, ``...lora_A.weight`` / ``...lora_B.weight``) travel in the
  full sync's format (``flashrl.wire.weights.build_manifest``: flat single-dtype buckets, a checksum each);
  ``verify_adapter`` checks every bucket before any tensor is handed out.
- The folder: ``save_adapter`` writes peft's adapter folder (``adapter_model.safetensors`` +
  ``adapter_config.json``), the one format vLLM's LoRA loader, ``PeftModel.from_pretrained`` and
  ``flashrl export`` read.
- The ranks vLLM serves (``max_lora_rank`` takes one of ``VLLM_RANKS``; an adapter may have any rank up
  to it) and the module names an adapter may target.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flashrl.wire.protocol import WeightManifest
from flashrl.wire.weights import unpack_bucket, verify_checksum

# The linear projections of the decoder layers of the architectures flashrl builds and tests (Llama,
# Qwen2, Qwen3): the names peft matches against module names, and vLLM's LoRA layers cover.
TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# vLLM's LoRAConfig.max_lora_rank takes one of these (vllm/config/lora.py MaxLoRARanks, vLLM 0.32).
VLLM_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_MAX_RANK = VLLM_RANKS[-1]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def vllm_max_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that serves an adapter of rank ``rank``."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above the largest rank vLLM serves ({VLLM_MAX_RANK}); use a smaller model.lora.rank")


def model_problems(rank: int, target_modules: Sequence[str], hf_config: Mapping[str, Any]) -> list[str]:
    """What keeps an adapter of ``rank`` on ``target_modules`` from fitting the model whose config.json is
    ``hf_config``: a rank above a target projection's smaller side (the adapter would not be low-rank: a full-rank update costs more than the
    weight it adapts), or a rank above what vLLM serves."""
    out = []
    if rank > VLLM_MAX_RANK:
        out.append(f"rank {rank} is above the largest rank vLLM serves ({VLLM_MAX_RANK})")
    hidden = int(hf_config.get("hidden_size", 0))
    heads = int(hf_config.get("num_attention_heads", 0))
    head_dim = int(hf_config.get("head_dim") or (hidden // heads if heads else 0))
    kv = int(hf_config.get("num_key_value_heads") or heads)
    inter = int(hf_config.get("intermediate_size", 0))
    sides = {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return out + rank_problems(rank, target_modules, sides)


def rank_problems(rank: int, target_modules: Sequence[str], sides: Mapping[str, tuple[int, int]]) -> list[str]:
    """A rank above a target projection's smaller side; ``sides``: projection name -> (in, out) features."""
    out = []
    for m in target_modules:
        small = min(sides.get(m, (0, 0)))
        if small and rank > small:
            out.append(f"rank {rank} is above {m}'s smaller side ({small}: {m} is {sides[m][0]} -> {sides[m][1]}); "
                       f"use a rank <= {small}, or leave {m} out of target_modules")
    return out


def module_problems(target_modules: Sequence[str], sides: Mapping[str, tuple[int, int]], model: str) -> list[str]:
    """Target names the model at ``model`` has no linear projection of (``sides``: the model's projection
    names -> (in, out) features), naming the ones it has."""
    missing = [m for m in target_modules if m not in sides]
    if not missing:
        return []
    can = [m for m in TARGET_MODULES if m in sides]
    others = sorted(set(sides) - set(TARGET_MODULES))
    return [f"target_modules: {', '.join(map(repr, missing))} not in {model}: its projections LoRA can target are "
            f"{', '.join(can) or 'none'}" + (f" (its other linear layers, not served with LoRA: {', '.join(others)})"
                                              if others else "") + "; set model.lora.target_modules to those"]


def verify_adapter(manifest: WeightManifest, flats: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors from received buckets, each bucket's checksum verified first; raises
    ValueError naming the first bucket that does not match (nothing is returned from a bad sync)."""
    if len(flats) != len(manifest.buckets):
        raise ValueError(f"adapter v{manifest.version}: {len(flats)} buckets received, the manifest lists {len(manifest.buckets)}")
    out: dict[str, torch.Tensor] = {}
    for i, (bucket, flat) in enumerate(zip(manifest.buckets, flats)):
        got = verify_checksum(flat, bucket.checksum)
        if got != bucket.checksum:
            raise ValueError(f"adapter v{manifest.version}: bucket {i} checksum {got} != {bucket.checksum} (corrupted in transit)")
        out.update(unpack_bucket(bucket, flat))
    bad = [k for k in out if ".lora_A." not in k and ".lora_B." not in k]
    if bad:
        raise ValueError(f"adapter v{manifest.version}: tensors that are not LoRA weights: {bad[:3]}")
    return out


def save_adapter(folder: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """Write a peft adapter folder at ``folder`` atomically (a reader never sees half of one): written in
    a sibling temporary folder, then renamed into place (an existing folder is replaced)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2))
    if folder.exists():
        old = folder.with_name(f".{folder.name}-old-{os.getpid()}")
        folder.rename(old)
        tmp.rename(folder)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(folder)
    return folder
