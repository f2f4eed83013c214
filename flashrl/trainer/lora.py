"""LoRA on the trainer's side: wrap a Hugging Face causal LM with adapters, and pack only the adapters.

    apply_lora(model, spec)        -> peft PeftModel: base weights frozen, lora_A / lora_B trainable
    adapter_state_dict(model)      -> {peft key: tensor}, adapter tensors only (what a sync sends)
    adapter_config(spec, base)     -> adapter_config.json as peft writes it (vLLM's loader reads it)
    save_adapter(folder, ...)      -> a peft adapter folder (adapter_model.safetensors + adapter_config.json)
    is_lora(model)                 -> whether the model carries peft adapters
    reference_disabled(model)      -> context manager: the base model (adapter off) = the reference policy
    adapter_dropout(model)         -> context manager: lora_dropout on (the training forwards only)
    adapter_entries(state)         -> the adapter's entries of a model state dict (an adapter-only checkpoint)
    base_fingerprint(model_dir)    -> XXH3-128 of the base weights (recorded in adapter checkpoints)
    base_mismatch(...)             -> why a recorded adapter does not go with a model folder (resume, export)

peft, not a module of our own: the adapter folder it writes is the format vLLM's LoRA loader
(``LoRARequest(lora_path=...)``), transformers' ``PeftModel.from_pretrained`` and ``flashrl export``
all read, its ``disable_adapter()`` gives the reference policy (the base model) from the same module
without a second copy of the weights, and ``merge_and_unload()`` gives the merged model. A module of
our own would have to reproduce peft's key names and scaling (alpha / rank) bit for bit to load in
either consumer.

The adapter tensors are packed for the weight sync with the full sync's own wire format
(``flashrl.wire.weights.build_manifest``: flat single-dtype buckets, one checksum per bucket), so the
engine verifies them before loading exactly as it verifies a full sync.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashrl.wire.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGET_MODULES, model_problems, save_adapter

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "TARGET_MODULES", "model_problems", "save_adapter"]  # re-exported for callers of this module


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape: rank r, scaling alpha / r, dropout on the adapter's input, target module names."""

    rank: int
    alpha: int
    dropout: float = 0.0
    target_modules: Sequence[str] = field(default_factory=lambda: TARGET_MODULES)

    def problems(self) -> list[str]:
        """What is wrong with this spec on its own (no model needed); empty when it is usable."""
        out = []
        if self.rank < 1:
            out.append(f"rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            out.append(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            out.append("target_modules is empty; name at least one of " + ", ".join(TARGET_MODULES))
        bad = [m for m in self.target_modules if m not in TARGET_MODULES]
        if bad:
            out.append(f"target_modules: unknown module(s) {bad}; use any of " + ", ".join(TARGET_MODULES))
        return out


def spec_of(lora: Any) -> LoraSpec:
    """The LoraSpec of a ``[model.lora]`` section (flashrl.config.LoraConfig) with rank > 0."""
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.target_modules))


def linear_sides(model_dir: str | Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """The architecture of the model folder ``model_dir`` and its linear layers by name (the last part of the
    module path, as peft matches target_modules) -> (in, out) features, the narrowest where layers differ;
    lm_head left out. Built on the meta device from config.json alone: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sides: dict[str, tuple[int, int]] = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf != "lm_head":
            side = (mod.in_features, mod.out_features)
            if leaf not in sides or min(side) < min(sides[leaf]):
                sides[leaf] = side
    return type(model).__name__, sides


def fit_problems(spec: LoraSpec, model_dir: str | Path) -> list[str]:
    """What keeps ``spec`` from fitting the model folder ``model_dir``: a target module the model lacks
    (naming the ones it has), a rank above a target's smaller side or above what vLLM serves."""
    from flashrl.wire.lora import VLLM_MAX_RANK, module_problems, rank_problems

    arch, sides = linear_sides(model_dir)
    out = [f"rank {spec.rank} is above the largest rank vLLM serves ({VLLM_MAX_RANK})"] if spec.rank > VLLM_MAX_RANK else []
    return out + module_problems(spec.target_modules, sides, f"{model_dir} ({arch})") + rank_problems(
        spec.rank, spec.target_modules, sides)


def peft_config(spec: LoraSpec) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """``model`` wrapped with adapters (peft's default init: lora_B = 0, so the wrapped model starts
    equal to the base); only the adapter parameters require grad."""
    problems = spec.problems()
    if problems:
        raise ValueError("model.lora: " + "; ".join(problems))
    from peft import get_peft_model

    return get_peft_model(model, peft_config(spec))  # peft freezes every non-adapter parameter


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``), the
    names vLLM's loader and ``PeftModel.from_pretrained`` expect; detached, on their own device."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def is_adapter_key(key: str) -> bool:
    """Whether ``key`` (a wrapped model's state-dict key or a peft saved name) is an adapter tensor."""
    return ".lora_A." in key or ".lora_B." in key


def adapter_entries(state: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter's entries of the wrapped model's state dict (keys unchanged): what an adapter-only
    checkpoint holds. The frozen base weights are left out: they are the model folder's, never trained."""
    return {k: v for k, v in state.items() if is_adapter_key(k)}


def adapter_from_state_dict(state: Mapping[str, torch.Tensor], adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors from a full state dict of the wrapped model (what FSDP2's
    ``get_model_state_dict(full_state_dict=True)`` gathers on rank 0), under the names
    ``adapter_state_dict`` gives: ``...lora_A.<adapter>.weight`` -> ``...lora_A.weight``; the base
    weights are left out."""
    out = {}
    for k, v in state.items():
        if is_adapter_key(k):
            out[k.replace(f".{adapter}.weight", ".weight")] = v
    return out


def adapter_config(spec: LoraSpec, base_model: str) -> dict[str, Any]:
    """adapter_config.json for ``spec`` on ``base_model`` (a folder), as peft writes it."""
    cfg = peft_config(spec).to_dict()
    cfg["base_model_name_or_path"] = base_model
    cfg["target_modules"] = sorted(cfg["target_modules"])  # peft keeps a set; JSON needs a list
    return json.loads(json.dumps(cfg, default=str))


def base_fingerprint(model_dir: str | Path) -> str:
    """A fingerprint of the base weights in the model folder ``model_dir``: XXH3-128 over every tensor's name,
    dtype, shape and full bytes, in name order (safetensors files; the raw bytes of ``*.bin`` / ``*.pt`` files
    where there are none). An adapter is a delta on exactly these weights: on another base it is another model.

    Every byte, not a sample: a base that differs in a few rows (new token embeddings) or a few tensors (a
    merged adapter) must not pass, and the trainer reads every byte at build anyway, so the hash reads them
    from the page cache (0.38 s for the 1.07 GB of the 0.27B model: docs/models.md). Names, dtypes and shapes
    from the safetensors headers, not the files' bytes: a re-save that shards or orders the tensors
    differently, or changes the header's free-form metadata, keeps the fingerprint."""
    import mmap

    import xxhash

    folder = Path(model_dir)
    h = xxhash.xxh3_128()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raw = sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
        if not raw:
            raise FileNotFoundError(f"{folder}: no weight files (*.safetensors, *.bin) to fingerprint")
        for f in raw:
            h.update(f.name.encode() + b"\n")
            with f.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(memoryview(mm))
        return "xxh3-128:" + h.hexdigest()
    entries: list[tuple[str, str, list[int], Path, int, int]] = []
    for f in files:
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                entries.append((name, info["dtype"], info["shape"], f, 8 + n + start, 8 + n + end))
    maps: dict[Path, Any] = {}
    try:
        for name, dtype, shape, f, a, b in sorted(entries, key=lambda e: e[0]):
            h.update(f"{name}|{dtype}|{shape}\n".encode())
            if b > a:
                if f not in maps:
                    fh = f.open("rb")
                    maps[f] = (fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
                h.update(memoryview(maps[f][1])[a:b])
    finally:
        for fh, mm in maps.values():
            mm.close()
            fh.close()
    return "xxh3-128:" + h.hexdigest()


def base_mismatch(recorded: str | None, recorded_dir: str | None, model_dir: str | Path, what: str) -> str | None:
    """Why the adapter ``what`` (trained on the base fingerprinted ``recorded``, at ``recorded_dir``) does not go
    with the model folder ``model_dir`` (None: it does, or nothing was recorded: an older checkpoint)."""
    if not recorded:
        return None
    here = base_fingerprint(model_dir)
    if here == recorded:
        return None
    return (f"{what} is a LoRA adapter of the base model fingerprinted {recorded} ({recorded_dir or 'folder not recorded'}), "
            f"and the model folder {model_dir} is another base ({here}): an adapter is a delta on the exact weights "
            f"it was trained on. Point model.path at the base the run trained (or restore that folder), or start a "
            f"fresh run on this base")


def merged_state_dict(base_dir: str | Path, adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """The base model at ``base_dir`` with the peft adapter at ``adapter_dir`` merged into its weights
    (W + (alpha / rank) B A, peft's ``merge_and_unload``), as a plain Hugging Face state dict in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def export_merged(base_dir: str | Path, adapter_dir: str | Path, out: str | Path, dtype: str = "float32",
                  replace: bool = False) -> Path:
    """A Hugging Face folder at ``out``: the base model with the adapter merged in, the base's tokenizer and
    generation config (trainer/hf.py save_hf_folder: atomic, ``replace`` as there)."""
    from flashrl.trainer.hf import save_hf_folder

    return save_hf_folder(merged_state_dict(base_dir, adapter_dir), base_dir, out, dtype=dtype, replace=replace)


def save_merged(state: Mapping[str, torch.Tensor], spec: LoraSpec, base_dir: str | Path, out: str | Path,
                dtype: str = "float32", replace: bool = False) -> Path:
    """From the wrapped model's full state dict: the merged model as a Hugging Face folder at ``out``
    (export_merged) and the adapter in peft format at ``<out>/adapter``."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=Path(out).parent))
    try:
        adapter = save_adapter(tmp / "adapter", adapter_from_state_dict(state), adapter_config(spec, str(base_dir)))
        export_merged(base_dir, adapter, out, dtype=dtype, replace=replace)
        adapter.rename(Path(out) / "adapter")
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return Path(out)


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft-wrapped model with adapters (apply_lora's; FSDP2 keeps the methods)."""
    return callable(getattr(model, "disable_adapter", None)) and callable(getattr(model, "get_base_model", None))


@contextlib.contextmanager
def reference_disabled(model: Any) -> Iterator[None]:
    """The base model inside the block (adapters bypassed): the reference policy of a LoRA run, computed
    by the same module with no second copy of the base weights."""
    with model.disable_adapter():
        yield


def dropout_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's adapter-input dropouts (``lora_dropout``) with p > 0; empty when model.lora.dropout is 0."""
    return [m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Dropout) and ".lora_dropout." in f".{n}." and m.p > 0]


@contextlib.contextmanager
def adapter_dropout(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """``modules`` (``dropout_modules``) in training mode inside the block, the rest of the model untouched
    (eval: the base model's own dropouts stay off). For the gradient forwards only: the proximal, reference
    and engine-matching logprobs are computed outside, with no dropout, as the engines sample."""
    for m in modules:
        m.train(True)
    try:
        yield
    finally:
        for m in modules:
            m.train(False)
