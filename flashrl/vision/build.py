"""The built-in tiny vision-language model (``builtin:vlm``): built locally, nothing downloaded, cached.

    build_untrained(path, seed, spec)  a random-init (seeded) float32 Idefics3ForConditionalGeneration:
                                       a SigLIP-style vision encoder (patches of spec.patch_size over a
                                       spec.image_size square), a pixel-shuffle connector (spec.scale_factor)
                                       and a Llama decoder, with the char tokenizer plus the image tokens
                                       (IMAGE_TOKENS) and an Idefics3Processor (PIL image processor: no
                                       torchvision) saved beside it: config.json, model.safetensors,
                                       tokenizer files, processor_config.json
    ensure_vlm(cfg, spec, warm)        "builtin:vlm" -> <cache_dir>/vlm-<key>/ (key = hash of the recipe, spec,
                                       warm-start, env, its params but faults, its code, eval size, seed;
                                       the env a suite names with wrapped_env, if it does: _warm_env):
                                       built once under a file lock (flashrl.models.build_folder), warm-started
                                       on the env's train split (flashrl/vision/warm.py), its report in
                                       flashrl_warmstart.json

Why Idefics3 and not Qwen2-VL on the CPU: flashrl/vision/__init__.py (vLLM 0.32's Qwen2-VL needs torchvision).
Why the char tokenizer: the built-in text model's (flashrl/models/tokenizer.py), so prompts and answers are
the characters they print; the image tokens are added special tokens after it (ids 91..94).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from flashrl.models.tokenizer import BOS, EOS, PAD, build_char_tokenizer
from flashrl.vision.tokens import IMAGE_TOKEN, IMAGE_TOKENS

__all__ = ["BUILTIN_VLM", "VisionSpec", "build_untrained", "ensure_policy", "ensure_vlm"]

BUILTIN_VLM = "builtin:vlm"
WARMSTART_FILE = "flashrl_warmstart.json"
_RECIPE_VERSION = 1
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # vLLM's CPU attention (flashrl/models/tiny.py)

log = logging.getLogger("flashrl.vision")


class VisionSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Shape of the built-in vision-language model (Idefics3: vision encoder, connector, Llama decoder)."""

    layers: Annotated[int, Meta(ge=1, le=64, description="decoder layers")] = 2
    hidden: Annotated[int, Meta(ge=32, le=8192, description="decoder hidden size")] = 128
    heads: Annotated[int, Meta(ge=1, le=128, description="decoder attention heads")] = 4
    kv_heads: Annotated[int, Meta(ge=1, le=128, description="decoder key/value heads (GQA)")] = 2
    intermediate: Annotated[int, Meta(ge=16, le=65536, description="decoder MLP inner size")] = 512
    max_position: Annotated[int, Meta(ge=16, le=1 << 20, description="max positions (prompt + response)")] = 256
    vision_layers: Annotated[int, Meta(ge=1, le=64, description="vision encoder layers")] = 2
    vision_hidden: Annotated[int, Meta(ge=16, le=4096, description="vision encoder hidden size")] = 64
    vision_heads: Annotated[int, Meta(ge=1, le=64, description="vision encoder attention heads")] = 2
    vision_intermediate: Annotated[int, Meta(ge=16, le=16384, description="vision encoder MLP inner size")] = 128
    image_size: Annotated[int, Meta(ge=8, le=4096, description="images are resized to this square")] = 64
    patch_size: Annotated[int, Meta(ge=2, le=64, description="vision patch side in pixels")] = 8
    scale_factor: Annotated[int, Meta(ge=1, le=8, description="pixel-shuffle factor of the connector")] = 2

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"VisionSpec: hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: "
                             "hidden must be a multiple of heads and heads of kv_heads")
        if self.hidden // self.heads not in _CPU_HEAD_SIZES:
            raise ValueError(f"VisionSpec: head size hidden/heads={self.hidden // self.heads} is not one vLLM's CPU "
                             f"attention supports {_CPU_HEAD_SIZES}; change hidden or heads")
        if self.vision_hidden % self.vision_heads:
            raise ValueError(f"VisionSpec: vision_hidden={self.vision_hidden} must be a multiple of "
                             f"vision_heads={self.vision_heads}")
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"VisionSpec: image_size={self.image_size} must be a multiple of patch_size="
                             f"{self.patch_size}, and the patches per side ({side}) of scale_factor={self.scale_factor}")

    @property
    def image_seq_len(self) -> int:
        """Image tokens per image: the patches, merged scale_factor x scale_factor by the connector."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


def build_untrained(path: str | Path, seed: int = 0, spec: VisionSpec | None = None) -> Path:
    """Save a random-init (seeded) float32 Idefics3 model, its tokenizer and its processor to ``path``."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    spec = spec or VisionSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    pad, bos, eos = (tok.convert_tokens_to_ids(t) for t in (PAD, BOS, EOS))
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.max_position, tie_word_embeddings=True, rope_theta=10000.0,
                pad_token_id=pad, bos_token_id=bos, eos_token_id=eos)
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                  image_size=spec.image_size, patch_size=spec.patch_size, num_channels=3)
    config: Any = Idefics3Config(  # type: ignore[call-arg]  # bos/eos_token_id: accepted as **kwargs
        vision_config=vision, text_config=text, scale_factor=spec.scale_factor, tie_word_embeddings=True,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), pad_token_id=pad, bos_token_id=bos, eos_token_id=eos)
    torch.manual_seed(seed)
    model: Any = Idefics3ForConditionalGeneration(config)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(str(out), safe_serialization=True)
    # One image is one square of image_size, never split into tiles (do_image_splitting off): a fixed
    # image_seq_len tokens per image, the same in the processor, vLLM and the trainer.
    size = {"longest_edge": spec.image_size}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size)
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=spec.image_seq_len).save_pretrained(str(out))
    return out


# --------------------------------------------------------------------------- builtin:vlm, cached
def _task_params(cfg: Any) -> dict[str, Any]:
    return {k: v for k, v in cfg.env.params.items() if k != "faults"}


def _warm_env(cfg: Any) -> tuple[str, dict[str, Any]]:
    """(env name, params) of the suite the warm-start reads: cfg's env, or the one it names with ``wrapped_env``
    (envs/digits_turns.py: the digits tasks in turns share the digits warm-start, so one build serves both)."""
    from flashrl.plugins import suite_class

    name, params = cfg.env.name, _task_params(cfg)
    hook = getattr(suite_class(name), "wrapped_env", None)
    while hook is not None:
        name, params, key = hook(params)
        params = {k: v for k, v in params.items() if k != "faults"}
        hook = getattr(suite_class(name, key), "wrapped_env", None)
    return name, params


def _key(cfg: Any, spec: VisionSpec, warm: Any) -> str:
    from flashrl.plugins import code_fingerprint

    env, params = _warm_env(cfg)
    blob = {"recipe": _RECIPE_VERSION, "spec": msgspec.to_builtins(spec), "warm": msgspec.to_builtins(warm),
            "env": env, "params": params, "code": code_fingerprint(env, params),
            "eval_size": cfg.env.eval_size, "seed": cfg.run.seed}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _is_built(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / WARMSTART_FILE).is_file()


def ensure_vlm(cfg: Any, spec: VisionSpec | None = None, warm: Any = None) -> Path:
    """The folder of ``builtin:vlm`` for ``cfg``'s env and seed: built, warm-started and cached once."""
    from flashrl.models import _one_torch_thread, build_folder
    from flashrl.plugins import make_suite
    from flashrl.vision.warm import VisionWarmStart, warm_start

    spec = spec or VisionSpec()
    warm = warm or VisionWarmStart()
    final = Path(cfg.model.cache_dir).expanduser() / f"vlm-{_key(cfg, spec, warm)}"
    if _is_built(final):
        return final

    def fill(tmp: Path) -> None:
        env, params = _warm_env(cfg)
        suite = make_suite(env, params, seed=cfg.run.seed, eval_size=cfg.env.eval_size)
        with _one_torch_thread():
            build_untrained(tmp, seed=cfg.run.seed, spec=spec)
            report = warm_start(tmp, suite, warm, seed=cfg.run.seed, log=log.info)
        report |= {"env": env, "params": params, "seed": cfg.run.seed,
                   "spec": msgspec.to_builtins(spec), "warm": msgspec.to_builtins(warm)}
        (tmp / WARMSTART_FILE).write_text(json.dumps(report, indent=2, default=str))
        log.info("built %s: held-out greedy accuracy %.3f", final, report["eval_accuracy"])

    return build_folder(final, _is_built, fill)


def ensure_policy(cfg: Any, progress: Any = None, build: bool = True) -> Path:
    """``flashrl.models.ensure_model`` that also knows ``builtin:vlm`` (flashrl.models sits below this package):
    what ``flashrl init-model``, ``validate`` and ``run`` resolve ``model.path`` with. ``build`` False: a
    builtin:vlm not built yet is ModelNotBuilt (validate notes it)."""
    from flashrl.models import ModelNotBuilt, ensure_model

    if cfg.model.path != BUILTIN_VLM:
        return ensure_model(cfg, progress=progress, build=build)
    from flashrl.vision.warm import VisionWarmStart

    final = Path(cfg.model.cache_dir).expanduser() / f"vlm-{_key(cfg, VisionSpec(), VisionWarmStart())}"
    if _is_built(final):
        return final
    if not build:
        raise ModelNotBuilt(f"{BUILTIN_VLM} for this config is not built yet ({final}); `flashrl init-model CONFIG` "
                            "(or `flashrl run`) builds it (10-15 minutes on 2 CPU cores)")
    if progress is not None:
        with progress.phase(f"building and warm-starting {BUILTIN_VLM} on env {cfg.env.name}"):
            return ensure_vlm(cfg)
    return ensure_vlm(cfg)
