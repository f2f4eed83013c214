"""Mixture-of-Experts policies: routes from the engines, routing replay in the trainer, the MoE's weight layout.

    config.py   [moe]: replay (off | r2 | r3), capture (auto | on | off); [moe.builtin]: builtin:moe's shape (MoeSpec)
    model.py    builtin:moe's shape (MoeSpec; flashrl/models/moe.py builds the folder) and a MoE config's route shape
    routes.py   routes packed per token (uint8 / int16), checked (never silent zeros), the engines' capture switch
    capture.py  the engine's side: forward hooks on vLLM's routers, read through flashrl's worker extension
    source.py   which capture an engine uses (vLLM's own on a cuda engine with Triton, else the hooks) and vLLM's rows -> routes
    reload.py   the engine's side: vLLM's CPU experts repacked after a weight sync's reload
    weights.py  the trainer's side: its fused experts in the per-expert layout the sync sends (vLLM's loader's)
    replay.py   the trainer's side: routing replay (forced experts, the router's softmax at them) and its metrics

docs/models.md (Mixture-of-Experts) and docs/algorithms.md (routing replay) tell the story.
"""
