"""A MoE policy's weights in the layout its checkpoints (and vLLM's loader) use, for the weight sync.

transformers 5 holds a Qwen3-MoE layer's experts fused, as two 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), but writes them per expert
(``mlp.experts.<e>.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj``), the names every Qwen3-MoE
checkpoint has and vLLM's ``Qwen3MoeForCausalLM.load_weights`` maps onto its own fused ``w13`` / ``w2``.
``checkpoint_layout`` is that conversion (transformers' own ``revert_weight_conversion``, which
``save_pretrained`` runs), so the sync sends what a saved folder holds: the engine loads it as it loaded the
folder, and a sync's bytes equal the export's (tests/unit/test_moe_model.py).
"""

from __future__ import annotations

from typing import Any

import torch

from flashrl.moe.model import moe_shape


def checkpoint_layout(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (the trainer's, in memory names) renamed and split as ``save_pretrained`` writes it, for a
    MoE ``model``; a dense model's comes back as it is. ``model``: the HF module (FSDP2-wrapped or not)."""
    config = getattr(model, "config", None)
    if config is None or moe_shape(config) is None or not state_dict:
        return state_dict
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state_dict))
