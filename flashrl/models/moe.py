"""``builtin:moe``'s untrained folder: a Qwen3-MoE decoder of ``MoeSpec``'s shape with the built-in char tokenizer.

The shape, the design notes (why Qwen3-MoE keeps the char tokenizer, the expert width) and the route shape of a
MoE config are flashrl/moe/model.py's; the warm-start is builtin:tiny's (flashrl/models/tiny.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashrl.models.tokenizer import BOS, EOS, PAD, build_char_tokenizer
from flashrl.moe.model import MoeSpec

__all__ = ["build_untrained_moe"]


def build_untrained_moe(path: str | Path, seed: int = 0, spec: MoeSpec | None = None) -> Path:
    """Save a random-init (seeded) float32 Qwen3MoeForCausalLM + the char tokenizer to ``path``; return it."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = spec or MoeSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    config: Any = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim, rope_theta, torch_dtype: accepted as **kwargs
        vocab_size=len(tok),  # exactly the tokenizer: no id the tokenizer cannot decode can be sampled
        hidden_size=spec.hidden,
        intermediate_size=spec.expert_width,  # a dense MLP's width: no layer has one (mlp_only_layers empty)
        moe_intermediate_size=spec.expert_width,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,  # the RL trainer adds no load-balancing loss (the warm-start does)
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tok.convert_tokens_to_ids(PAD),
        bos_token_id=tok.convert_tokens_to_ids(BOS),
        eos_token_id=tok.convert_tokens_to_ids(EOS),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model: Any = Qwen3MoeForCausalLM(config)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out
