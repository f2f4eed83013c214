"""``[moe]``: Mixture-of-Experts policies (routing capture on the engines, routing replay in the trainer)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from flashrl.moe.model import MoeSpec


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
