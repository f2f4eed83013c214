"""``builtin:moe``'s shape (``MoeSpec``; flashrl/models/moe.py builds it) and a MoE config's route shape (``moe_shape``).

``builtin:moe`` is the built-in model as a Mixture-of-Experts (transformers' Qwen3MoeForCausalLM).

The same character tokenizer as ``builtin:tiny`` (flashrl/models/tokenizer.py) and the same warm-start on
the environment (flashrl/models/tiny.py ``warm_start``, the carry-slipping teacher included): only the
decoder differs. Its MLP is a sparse MoE block in every layer: ``experts`` experts of width
``expert_width``, ``top_k`` of them per token, the top-k weights renormalized (``norm_topk_prob``).
Defaults: 8 experts of width 128, top-2 (~0.9M parameters, 256 active MLP units per token against the
dense model's 512). With experts of width 64 the warm-start's loss sat at the teacher-noise plateau (0.83)
for 2400 steps on arithmetic (probe 4-8%); at 128 it left it after ~1050 steps, as the dense model does.

Why Qwen3-MoE keeps the char tokenizer while Qwen2 does not (tiny.py's docstring): ``qwen3_moe`` is in
neither transformers' ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` nor vLLM's
``_MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS`` (transformers 5.19, vLLM 0.32), so ``AutoTokenizer`` and vLLM
read the folder's tokenizer.json (checked: "12 + 3=\\n4" round-trips; tests/unit/test_moe_model.py).

transformers writes the experts per expert (``mlp.experts.<e>.{gate,up,down}_proj.weight``) however it holds
them in memory (fused 3-D ``gate_up_proj`` / ``down_proj``): the layout vLLM's Qwen3-MoE loader reads.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

# vLLM CPU attention head sizes (vllm/v1/attention/backends/cpu_attn.py), as tiny.py.
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# vLLM's CPU MoE kernel (CPUUnquantizedExperts, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py, vllm 0.32)
# takes hidden and expert widths that are multiples of its output alignment (32): another hidden size it refuses,
# another expert width it pads, which flashrl's weight sync cannot repack (flashrl/moe/reload.py).
_CPU_MOE_ALIGN = 32


class MoeSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """``[moe.builtin]``: the shape of ``builtin:moe`` (a Qwen3-MoE decoder, a sparse MoE block in every layer;
    part of its cache key: another shape builds another model). Only for model.path = "builtin:moe"."""

    layers: Annotated[int, Meta(ge=1, le=64, description="decoder layers (each with a MoE block)")] = 2
    hidden: Annotated[int, Meta(ge=32, le=8192, description="hidden size (a multiple of 32: vLLM's CPU MoE kernel)")] = 128
    heads: Annotated[int, Meta(ge=1, le=128, description="attention heads")] = 4
    kv_heads: Annotated[int, Meta(ge=1, le=128, description="key/value heads (GQA)")] = 2
    experts: Annotated[int, Meta(ge=2, le=256, description="experts per MoE layer")] = 8
    top_k: Annotated[int, Meta(ge=1, le=32, description="experts each token is routed to")] = 2
    expert_width: Annotated[int, Meta(ge=8, le=65536, description="inner size of one expert (moe_intermediate_size; a multiple of 32: vLLM's CPU MoE kernel)")] = 128
    max_position: Annotated[int, Meta(ge=16, le=1 << 20, description="max positions (prompt + response)")] = 256

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"MoeSpec: hidden={self.hidden} must be a multiple of heads={self.heads}, and heads of "
                             f"kv_heads={self.kv_heads}")
        if self.hidden // self.heads not in _CPU_HEAD_SIZES:
            raise ValueError(f"MoeSpec: head size hidden/heads={self.hidden // self.heads} is not one vLLM's CPU "
                             f"attention supports {_CPU_HEAD_SIZES}; change hidden or heads")
        if self.top_k > self.experts:
            raise ValueError(f"MoeSpec: top_k={self.top_k} is more than experts={self.experts}; lower top_k or "
                             "raise experts")
        for name, width in (("hidden", self.hidden), ("expert_width", self.expert_width)):
            if width % _CPU_MOE_ALIGN:
                fix = -(-width // _CPU_MOE_ALIGN) * _CPU_MOE_ALIGN
                raise ValueError(f"MoeSpec: {name}={width} is not a multiple of {_CPU_MOE_ALIGN}, which vLLM's CPU MoE "
                                 f"kernel needs (hidden: refused; expert width: padded, which the weight sync cannot "
                                 f"repack); set {name} = {fix}")


def moe_shape(config: Any) -> tuple[int, int, int] | None:
    """(MoE layers, experts, top-k) of a transformers config (or config.json dict), None for a dense model.
    Only models with a sparse block in every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``) are
    supported: their route rows are then one per decoder layer."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    experts = get("num_experts") or get("num_local_experts") or 0
    top_k = get("num_experts_per_tok") or 0
    if not experts or not top_k:
        return None
    if (get("decoder_sparse_step") or 1) != 1 or get("mlp_only_layers"):
        raise ValueError("a MoE model with dense layers between its sparse ones (decoder_sparse_step != 1 or "
                         "mlp_only_layers) is not supported by flashrl's routing capture and replay yet")
    return int(get("num_hidden_layers") or 0), int(experts), int(top_k)
