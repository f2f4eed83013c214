"""``builtin:moe``'s untrained folder: a Qwen3-MoE decoder of ``MoeSpec``'s shape with the built-in char tokenizer.

The shape, the design notes (why Qwen3-MoE keeps the char tokenizer, the expert width) and the route shape of a
MoE config are flashrl/moe/model.py's; the warm-start is builtin:tiny's (flashrl/models/tiny.py).
"""

from __future__ import annotations

from pathlib import Path

from flashrl.models.tiny import save_char_model
from flashrl.moe.model import MoeSpec

__all__ = ["build_untrained_moe"]


def build_untrained_moe(path: str | Path, seed: int = 0, spec: MoeSpec | None = None) -> Path:
    """Save a random-init (seeded) float32 Qwen3MoeForCausalLM + the char tokenizer to ``path``; return it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = spec or MoeSpec()
    return save_char_model(
        path, seed, Qwen3MoeConfig, Qwen3MoeForCausalLM,
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
    )
