"""What `flashrl validate` checks of [judge] against lengths: a judge whose text cannot fit is refused per
verdict at run time (env/judge_refused, judge.unparsable_reward), and one whose engines cannot take their
max_model_len never starts (JudgeDown after judge.max_restarts): both are said before the run, with the keys
and the fix.

    judge_max_model_len(cfg)  the judge engines' max_model_len: 2 x max(model.max_model_len, 64), room for the
                              template, the policy's longest prompt + response and the verdict
    length_problems(cfg, tok, model_max)
        the template's own tokens + the policy's longest text (model.max_model_len: a prompt and its response
        never exceed it) + judge.max_new_tokens > the judge's max_model_len   -> a problem naming them
        the judge's max_model_len > the judge model's max_position_embeddings -> a problem (vLLM refuses it)
    check_lengths(cfg)        the judge's tokenizer and positions (builtin:judge: the built-in's; a folder: its
                              tokenizer files and config.json), then length_problems; a folder that cannot be read
                              is left to the model checks

The policy's text is counted in the policy's tokens: a judge whose tokenizer splits the same text into more
tokens can still refuse a verdict the check let through (the run counts it as env/judge_refused).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["check_lengths", "judge_max_model_len", "length_problems"]


def judge_max_model_len(cfg: Any) -> int:
    """The judge engines' max_model_len: twice the policy's (at least 64), room for the template around the
    policy's longest prompt and response, and the verdict."""
    return max(cfg.model.max_model_len, 64) * 2


def length_problems(cfg: Any, tok: Any, model_max: int | None) -> list[str]:
    """Why verdicts of this config cannot fit the judge (each with its keys and the fix); [] when they do.
    ``tok``: the judge's tokenizer; ``model_max``: the judge model's max_position_embeddings (None: unknown)."""
    jc = cfg.judge
    limit = judge_max_model_len(cfg)
    out: list[str] = []
    if model_max is not None and limit > model_max:
        out.append(f"judge: the judge engines' max_model_len = 2 x model.max_model_len = {limit} is past the judge "
                   f"model's max_position_embeddings = {model_max}: vLLM would refuse to start them; lower "
                   f"model.max_model_len to {model_max // 2} or less, or use a judge model with more positions")
    template = len(tok.encode(jc.template.format(prompt="", response=""), add_special_tokens=False))
    policy = cfg.model.max_model_len
    need = template + policy + jc.max_new_tokens
    if need > limit:
        out.append(f"judge.template: its {template} tokens + the policy's longest prompt and response (model.max_model_len "
                   f"= {policy}) + judge.max_new_tokens = {jc.max_new_tokens} = {need} tokens, past the judge's "
                   f"max_model_len = {limit} (2 x model.max_model_len): the longest answers would be refused "
                   f"(env/judge_refused, judge.unparsable_reward); shorten judge.template by {need - limit} tokens, "
                   f"lower judge.max_new_tokens, or raise model.max_model_len to {template + jc.max_new_tokens} or more")
    return out


def check_lengths(cfg: Any) -> list[str]:
    """length_problems with the judge's own tokenizer and positions; [] without a judge, or with a judge
    folder whose tokenizer cannot be read (the model checks name that)."""
    jc = cfg.judge
    if not jc.model:
        return []
    from flashrl.judge.build import BUILTIN_JUDGE

    if jc.model == BUILTIN_JUDGE:
        from flashrl.models.tiny import TinySpec
        from flashrl.models.tokenizer import build_char_tokenizer

        return length_problems(cfg, build_char_tokenizer(), TinySpec().max_position)
    from pathlib import Path

    folder = Path(jc.model).expanduser()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return []
    positions = conf.get("max_position_embeddings") or conf.get("n_positions")
    return length_problems(cfg, tok, int(positions) if positions else None)
