"""Mixture-of-Experts policies: the built-in MoE model, routes from the engines, routing replay in the trainer.

    config.py   [moe]: replay (off | r2 | r3) and capture (auto | on | off)
    model.py    builtin:moe: a Qwen3-MoE decoder with the built-in char tokenizer (the warm-start is builtin:tiny's)

docs/models.md (MoE) tells the story. Nothing here imports torch at module import time.
"""
