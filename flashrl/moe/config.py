"""``[moe]``: Mixture-of-Experts policies (routing capture on the engines, routing replay in the trainer)."""

from __future__ import annotations

from typing import Annotated, Literal

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


class MoeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[moe]``: what a run does with the experts a Mixture-of-Experts policy routes each token to
    (docs/algorithms.md: routing replay). Ignored by a dense model. ``[moe.builtin]``: builtin:moe's shape."""

    replay: Annotated[Literal["off", "r2", "r3"], Meta(description=(
        "off: the trainer routes every token itself; r2: every forward of a step uses the routes of the trainer's "
        "own first forward of the batch; r3: every forward uses the routes the engine sampled each token with "
        "(rollout routing replay: the engines capture them)"))] = "off"
    capture: Annotated[Literal["auto", "on", "off"], Meta(description=(
        "engines record the top-k experts of every MoE layer per generated token: auto = when the model is a MoE "
        "(its routes are then checked and its routing disagreement logged), on = required (a dense model is an error), off = never"))] = "auto"
    capture_source: Annotated[Literal["auto", "vllm", "hooks"], Meta(description=(
        "where the engines' routes come from: auto = vLLM's own capture (enable_return_routed_experts) on a cuda "
        "engine with Triton, flashrl's worker-extension hooks elsewhere (each engine logs which and why); vllm = "
        "required (an error where vLLM cannot run it, e.g. on the CPU); hooks = always flashrl's hooks "
        "(flashrl/moe/source.py)"))] = "auto"
    builtin: MoeSpec = msgspec.field(default_factory=MoeSpec)
