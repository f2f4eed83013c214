"""GRPO advantages (docs/algorithms.md, "Advantages") as pure torch functions.

    rewards [B], group ids [B] --group_stats--> mean_G, std_G, tied_G per sample
                               --grpo_advantages--> A [B] = (r - mean_G) / (std_G + eps)   (scale_std)
                                                    A [B] = r - mean_G                     (Dr. GRPO)
    A [B], loss mask [B, T]    --token_advantages--> A [B, T] (same value on every generated token)

std_G is the sample standard deviation (Bessel's n - 1), as TRL's and veRL's GRPO compute it; a group
of one sample has std 0 and advantage 0. A group whose rewards all tie carries no signal (every A is
0); ``tied_groups`` finds them so the trainer can drop them (DAPO dynamic sampling) and count them.
Group ids need not be contiguous or sorted: samples of one group may sit anywhere in the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from flashrl.trainer.batch import BatchError, PaddedBatch

EPS = 1e-6  # GRPO (DeepSeekMath) denominator guard


def _group_index(groups: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index per sample (0 .. G-1) and G."""
    _, inverse = torch.unique(groups, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def group_stats(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's mean reward, sample std (n - 1; 0 for a group of one) and size."""
    if rewards.shape != groups.shape or rewards.dim() != 1:
        raise ValueError(f"group_stats: rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} "
                         "must be the same 1-D shape [B]")
    r = rewards.to(torch.float64)
    idx, g = _group_index(groups)
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, idx, r) / count
    sq = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, idx, (r - mean[idx]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[idx], std[idx], count[idx]


def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, scale_std: bool = True,
                    eps: float = EPS) -> torch.Tensor:
    """A_i = (r_i - mean_G) / (std_G + eps); with ``scale_std=False`` (Dr. GRPO) A_i = r_i - mean_G. [B]."""
    mean, std, _ = group_stats(rewards, groups)
    adv = rewards.to(torch.float64) - mean
    if scale_std:
        adv = adv / (std + eps)
    return adv.to(rewards.dtype)


def tied_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[B] bool: True for every sample whose group's rewards are all equal (no learning signal)."""
    idx, g = _group_index(groups)
    r = rewards.to(torch.float64)
    lo = torch.full((g,), float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, idx, r, "amin")
    hi = torch.full((g,), float("-inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, idx, r, "amax")
    return (hi == lo)[idx]


def count_groups(groups: torch.Tensor, which: torch.Tensor | None = None) -> int:
    """Number of distinct groups (among the samples where ``which`` is True, if given)."""
    g = groups if which is None else groups[which]
    return int(torch.unique(g).numel())


def token_advantages(adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample A [B] to every token [B, T]; 0 where the mask is 0."""
    return adv.unsqueeze(-1).to(loss_mask.dtype) * loss_mask


def distill_advantages(adv_tok: torch.Tensor, behav_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       loss_mask: torch.Tensor, *, kl_weight: float, with_reward: bool) -> torch.Tensor:
    """On-policy distillation's advantages [B, T] (flashrl/distill): on every generated token the reverse-KL estimate
    on the sampled token, k_t = log pi_student(x_t) - log pi_teacher(x_t) (the student's behaviour log-probability,
    the one it was sampled with), enters as -kl_weight * k_t: added to the reward's ``adv_tok`` (``with_reward``)
    or alone. Tokens the teacher prefers get a positive advantage, tokens it finds unlikely a negative one."""
    kl = (behav_logp - teacher_logp) * loss_mask
    base = adv_tok if with_reward else torch.zeros_like(adv_tok)
    return base - kl_weight * kl


def distill_step(full: PaddedBatch, adv_tok: torch.Tensor, dc: Any, extra: dict[str, float]) -> torch.Tensor:
    """The teacher's per-token term in a step's advantages (``distill_advantages``; ``dc`` is [distill]), and its
    metrics in ``extra``. A sample without its teacher's scores is refused (BatchError): never trained with a
    signal it did not get."""
    if not bool(full.scored.all()):
        missing = int((~full.scored).sum())
        raise BatchError(f"distillation: {missing} of {full.size} samples carry no teacher scores "
                         "(Trajectory.teacher_logp); every training sample must be scored before it is trained")
    out = distill_advantages(adv_tok, full.behav_logp, full.teacher_logp, full.loss_mask, kl_weight=dc.kl_weight,
                             with_reward=dc.mode == "reward+kl")
    n = max(float(full.loss_mask.sum()), 1.0)
    kl = (full.behav_logp - full.teacher_logp) * full.loss_mask
    extra["distill/reverse_kl"] = float(kl.sum()) / n
    extra["distill/reverse_kl_seq"] = float(kl.sum(-1).mean())  # per sample, summed over its tokens
    extra["distill/teacher_logp"] = float((full.teacher_logp * full.loss_mask).sum()) / n
    return out
