"""The shared-prefix forward (trainer.share_prefix): each distinct prompt of a micro-batch forwarded once, every
sample's continuation against its keys and values (batch.PrefixSplit says the layout). PolicyTrainer.forward_logprobs
calls it; the logprobs equal the padded forward's up to float rounding (tests/unit/test_batch.py)."""

from __future__ import annotations

import torch

from flashrl.trainer.batch import PaddedBatch, PrefixSplit, to_aligned, token_logprobs

__all__ = ["shared_prefix_logprobs"]


def shared_prefix_logprobs(model: torch.nn.Module, b: PaddedBatch, s: PrefixSplit, entropy_grad: bool,
                            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PolicyTrainer.forward_logprobs with each distinct prompt forwarded once (batch.PrefixSplit): the prompts'
    keys and values are gathered to their samples (index_select: the gradient of every sample
    flows back into its prompt's one forward), then the continuations run against them."""
    pre = model(input_ids=s.prefix_ids, attention_mask=s.prefix_attention, use_cache=True)
    cache = pre.past_key_values
    cache.reorder_cache(s.row_prefix)  # [G] prompts -> [B] samples
    cont = model(input_ids=s.cont_ids, attention_mask=s.cont_attention, position_ids=s.cont_positions,
                 past_key_values=cache, use_cache=True)
    first = pre.logits[s.row_prefix, s.prefix_last[s.row_prefix]]  # [B, V]: predicts continuation token 0
    logits = torch.cat([first.unsqueeze(1), cont.logits[:, :-1]], dim=1)  # [B, R, V]
    logp, entropy = token_logprobs(logits, s.cont_ids, entropy_grad=entropy_grad, temperature=temperature)
    width = b.targets.shape[1]
    return to_aligned(logp, s, width), to_aligned(entropy, s, width)
