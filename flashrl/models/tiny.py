"""The built-in tiny model: a random-init Llama-architecture causal LM with the char-level tokenizer.

``build_untrained`` writes a Hugging Face model folder (config.json, model.safetensors,
generation_config.json, tokenizer files) that loads both in transformers and in vLLM
(``LLM(model=path, dtype="float32", enforce_eager=True)``), offline. The warm-start that turns it into
a useful RL starting point is ``ensure_model`` in ``flashrl/models/__init__.py``.

Why Llama and not Qwen2 (the same decoder, without q/k/v biases): transformers 5 (and vLLM, which calls
``AutoTokenizer``) force ``model_type == "qwen2"`` folders onto ``Qwen2Tokenizer``, which rebuilds a
byte-level BPE from the vocabulary and ignores our tokenizer.json (spaces and newlines vanish). For
``llama`` folders ``AutoTokenizer`` honours tokenizer.json. head_dim must be one vLLM's CPU attention
supports (32, 64, 80, ...), which ``TinySpec`` checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from flashrl.models.tokenizer import BOS, EOS, PAD, build_char_tokenizer

# vLLM CPU attention head sizes (vllm/v1/attention/backends/cpu_attn.py).
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class TinySpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Shape of the built-in model (a Llama decoder)."""

    layers: Annotated[int, Meta(ge=1, le=64, description="decoder layers")] = 2
    hidden: Annotated[int, Meta(ge=32, le=8192, description="hidden size")] = 128
    heads: Annotated[int, Meta(ge=1, le=128, description="attention heads")] = 4
    kv_heads: Annotated[int, Meta(ge=1, le=128, description="key/value heads (GQA)")] = 2
    intermediate: Annotated[int, Meta(ge=16, le=65536, description="MLP inner size")] = 512
    max_position: Annotated[int, Meta(ge=16, le=1 << 20, description="max positions (prompt + response)")] = 256

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"TinySpec: hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"TinySpec: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.hidden // self.heads not in _CPU_HEAD_SIZES:
            raise ValueError(f"TinySpec: head size hidden/heads={self.hidden // self.heads} is not one vLLM's CPU "
                             f"attention supports {_CPU_HEAD_SIZES}; change hidden or heads")


def build_untrained(path: str | Path, seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Save a random-init (seeded) float32 LlamaForCausalLM + char tokenizer to ``path``; return it."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = spec or TinySpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),  # exactly the tokenizer: no id the tokenizer cannot decode can be sampled
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tok.convert_tokens_to_ids(PAD),
        bos_token_id=tok.convert_tokens_to_ids(BOS),
        eos_token_id=tok.convert_tokens_to_ids(EOS),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out
