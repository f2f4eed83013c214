"""On-policy distillation's forward-KL term (flashrl/distill; ``distill.forward_kl_coef`` > 0): at every generated
position the student is pulled toward the teacher's top-k distribution there, beside the reverse-KL advantage.

    forward_with_top(model, b, temperature) -> logp [B, T], entropy [B, T], the student's log-probabilities of the
        teacher's top-k tokens [B, T, k] (one padded forward: this term needs each position's distribution, so
        trainer.share_prefix does not apply to these forwards)
    forward_kl(student_top, b, norm) -> (sum_t sum_j p_T(j) (log p_T(j) - log p_S(j)) over generated tokens, / norm,
        metrics): the KL from the teacher's top-k (its tail beyond k left out) to the student, a cross-entropy on
        the teacher's distribution at the states the student visited (GKD's on-policy forward KL, truncated to k)

The reverse-KL advantage says only whether the token the student sampled was a good one; this term also says which
tokens the teacher would have written there, when the student sampled another.
"""

from __future__ import annotations

import torch

from flashrl.trainer.batch import PaddedBatch, token_logprobs

__all__ = ["forward_kl", "forward_with_top"]


def forward_with_top(model: torch.nn.Module, b: PaddedBatch, entropy_grad: bool,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False, **b.vision_kwargs())
    logits = out.logits[:, :-1]
    logp, entropy = token_logprobs(logits, b.targets, entropy_grad=entropy_grad, temperature=temperature)
    ids = b.teacher_top_ids.to(logits.device)
    logp_all = torch.log_softmax(logits.float() / temperature if temperature != 1.0 else logits.float(), dim=-1)
    top = logp_all.gather(-1, ids.clamp(min=0)) * (ids >= 0)
    return logp, entropy, top


def forward_kl(student_top: torch.Tensor, b: PaddedBatch, norm: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The forward-KL loss of a micro-batch (token sum / ``norm``: the policy loss's divisor; None: its own token
    count) and its metric (distill/forward_kl: the mean per generated token)."""
    t_logp = b.teacher_top_logp.to(student_top.device)
    valid = (b.teacher_top_ids.to(student_top.device) >= 0) & (b.loss_mask.to(student_top.device) > 0).unsqueeze(-1)
    p = t_logp.exp() * valid
    per_tok = (p * (t_logp - student_top)).sum(-1)
    total = per_tok.sum()
    n = float(b.loss_mask.sum())
    loss = total / (norm if norm is not None else max(n, 1.0))
    return loss, {"distill/forward_kl": float(total.detach()) / max(n, 1.0)}
