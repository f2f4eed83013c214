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

from typing import Any

from flashrl.moe.config import MoeSpec

__all__ = ["MoeSpec", "moe_shape"]  # MoeSpec: [moe.builtin], defined with the section (flashrl/moe/config.py)

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
