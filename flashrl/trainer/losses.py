"""Policy losses for asynchronous RL (docs/algorithms.md, "Policy losses"), one pure function each.

    trainer forward --logp [B,T] (grad)--+
    trainer (step start) --prox_logp-----+--> LOSSES[cfg.loss](...) --> per-token loss [B,T], stats
    engine sampling --behav_logp---------+                                   |
    advantages.py / critics.py --A [B,T]-+                     aggregate(cfg.loss_agg) + entropy + KL
                                                                             v
                                                     compute_policy_loss -> (scalar loss, metrics)

Notation: r = exp(logp - prox_logp) (PPO ratio around the proximal policy), rb = exp(logp - behav_logp)
(ratio to the behaviour policy that sampled the token), w = exp(prox_logp - behav_logp). ``mask`` is 1
on tokens the policy generated. Every loss returns a per-token loss that is exactly 0, with exactly 0
gradient, on masked tokens: log-differences are replaced by 0 there *before* ``exp`` so that padding
garbage (``-inf`` logprobs) cannot leak NaN through ``0 * inf`` in the backward pass.

Left out on purpose: value losses (critics.py owns the AsyPPO critics), advantage computation
(advantages.py), and any distributed reduction: for micro-batching pass ``norm`` (the whole batch's
divisor) so that the sum of micro-batch losses equals the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from flashrl.config import AlgorithmConfig

Tensor = torch.Tensor
Stats = dict[str, Tensor]


class LossFn(Protocol):
    def __call__(self, *, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor,
                 mask: Tensor, rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]: ...


# --------------------------------------------------------------------------- helpers
def _diff(a: Tensor, b: Tensor, m: Tensor) -> Tensor:
    """a - b on valid tokens, 0 elsewhere (where() blocks gradient and NaN from padding)."""
    return torch.where(m, a - b, torch.zeros((), dtype=a.dtype, device=a.device))


def _ppo_term(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float) -> tuple[Tensor, Tensor]:
    """Per-token -min(r A, clip(r) A), optionally dual-clipped for A < 0; and which tokens were clipped."""
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip > 0:
        # Dual clip (Ye et al. 2020): for A < 0 a huge ratio would give an unbounded loss; cap it at -c A.
        capped = torch.minimum(loss, -dual_clip * adv)
        is_dual = (adv < 0) & (capped < loss)
        loss = torch.where(adv < 0, capped, loss)
        is_clipped = is_clipped | is_dual
    return loss, is_clipped


def _zero(loss: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


# --------------------------------------------------------------------------- losses
def ppo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
             rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]:
    """PPO clip (Schulman et al. 2017), also ``grpo``: L = -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    Defaults eps_low = eps_high = 0.2 (PPO paper). ``cfg.dual_clip`` = c > 0 adds the dual clip for A < 0,
    L = min(L, -c A) (Ye et al. 2020, c = 3 there; off by default). ``behav_logp`` is ignored: plain PPO
    treats the proximal policy as the sampler, which is exact only when sync (async_ratio = 0).
    """
    m = mask.bool()
    ratio = torch.exp(_diff(logp, prox_logp, m))
    loss, clipped = _ppo_term(ratio, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    return _zero(loss, m), {"ratio": ratio.detach(), "clipped": clipped.detach()}


def decoupled_ppo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                       rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]:
    """Decoupled PPO (Hilton et al. 2022; AReaL, ROLL Flash): L = -sg(min(w, w_max)) min(r A, clip(r) A).

    The trust region is around the proximal policy (the trainer's weights at step start); the behaviour
    weight w = pi_prox / pi_behav corrects for stale samples and is capped at ``cfg.decoupled_ppo.w_max`` (default 5,
    ROLL Flash / AReaL). Dual clip applies to the inner PPO term when ``cfg.dual_clip`` > 0.
    """
    m = mask.bool()
    ratio = torch.exp(_diff(logp, prox_logp, m))
    w = torch.exp(_diff(prox_logp, behav_logp, m)).detach()
    inner, clipped = _ppo_term(ratio, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    loss = w.clamp(max=cfg.decoupled_ppo.w_max) * inner
    return _zero(loss, m), {"ratio": ratio.detach(), "clipped": clipped.detach(), "iw": w,
                            "iw_clipped": (w > cfg.decoupled_ppo.w_max)}


def tis_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
             rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]:
    """Truncated importance sampling REINFORCE: L = -sg(min(rb, C)) A logp, C = ``cfg.tis.cap`` (default 2).

    rb = pi_theta / pi_behav corrects from the sampler directly (no proximal trust region).
    """
    m = mask.bool()
    rb = torch.exp(_diff(logp, behav_logp, m)).detach()
    lp = torch.where(m, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    loss = -rb.clamp(max=cfg.tis.cap) * advantages * lp
    return _zero(loss, m), {"ratio": rb, "clipped": rb > cfg.tis.cap, "iw": rb, "iw_clipped": rb > cfg.tis.cap}


def topr_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
              rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025).

    Samples with reward > 0: L = -A logp (no importance weight: pushing up a good sample is safe however
    stale). Reward <= 0: L = -sg(clip(rb, 0, 1)) A logp (the weight only ever shrinks the push-down).
    No tunable constants; the reward threshold 0 is the paper's.
    """
    m = mask.bool()
    rb = torch.exp(_diff(logp, behav_logp, m)).detach()
    positive = (rewards > 0).unsqueeze(-1).expand_as(m)
    weight = torch.where(positive, torch.ones_like(rb), rb.clamp(0.0, 1.0))
    lp = torch.where(m, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    loss = -weight * advantages * lp
    tapered = (~positive) & (rb > 1.0)
    return _zero(loss, m), {"ratio": rb, "clipped": tapered, "iw": weight, "iw_clipped": tapered}


def cispo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
               rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]:
    """CISPO (MiniMax-M1, 2025): L = -sg(clip(rb, 1-eps_low_is, 1+eps_high_is)) A logp.

    Unlike PPO no token's gradient is dropped; only the IS weight is clipped. Defaults
    ``cfg.cispo.eps_low`` = 1.0 (lower bound 0, i.e. no lower clip, as in the paper) and
    ``cfg.cispo.eps_high`` = 0.2 (the paper tunes it; 0.2 is our default, not a published constant).
    """
    m = mask.bool()
    rb = torch.exp(_diff(logp, behav_logp, m)).detach()
    lo, hi = max(0.0, 1.0 - cfg.cispo.eps_low), 1.0 + cfg.cispo.eps_high
    weight = rb.clamp(lo, hi)
    lp = torch.where(m, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    loss = -weight * advantages * lp
    clipped = (rb > hi) | (rb < lo)
    return _zero(loss, m), {"ratio": rb, "clipped": clipped, "iw": rb, "iw_clipped": clipped}


def sequence_ratio(logp: Tensor, prox_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's per-sequence ratio s_i = exp(mean over valid t of (logp - prox_logp)); shape [B]."""
    m = mask.bool()
    n = m.sum(-1).clamp(min=1)
    return torch.exp(_diff(logp, prox_logp, m).sum(-1) / n)


def gspo_loss(*, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
              rewards: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Stats]:
    """GSPO (Qwen, Zheng et al. 2025), token form: s_i,t = sg(s_i) exp(logp - sg(logp)).

    s_i = exp(mean_t (logp - prox_logp)) is one ratio per sequence; the value of s_i,t is s_i and its
    gradient is s_i * d logp_t, so per-token advantages (e.g. rhythm-scaled) still work. L_i,t =
    -min(s_i,t A, clip(s_i,t, 1-eps_low, 1+eps_high) A) with ``cfg.gspo.eps_low/high`` = 3e-4 / 4e-4
    (paper). The paper averages per sequence: use loss_agg = "seq-mean-token-mean" to match it exactly.
    """
    m = mask.bool()
    s = sequence_ratio(logp, prox_logp, m).detach()
    lp = torch.where(m, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    s_tok = s.unsqueeze(-1) * torch.exp(lp - lp.detach())
    loss, clipped = _ppo_term(s_tok, advantages, cfg.gspo.eps_low, cfg.gspo.eps_high, 0.0)
    return _zero(loss, m), {"ratio": s_tok.detach(), "clipped": clipped.detach(), "seq_ratio": s}


LOSSES: dict[str, Callable[..., tuple[Tensor, Stats]]] = {
    "ppo": ppo_loss,
    "grpo": ppo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
    "tis": tis_loss,
    "topr": topr_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    # AsyPPO's policy loss is PPO clip on critic (GAE) advantages with I^A applied to them: since
    # I^A is 0/1, I^A min(rA, clip(r)A) == min(r I^A A, clip(r) I^A A). critics.py builds that advantage.
    "asyppo": ppo_loss,
}


# --------------------------------------------------------------------------- aggregation
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(loss_tok: Tensor, mask: Tensor, mode: str, norm: float | None = None) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - "token-mean": sum over valid tokens / number of valid tokens (DAPO; long answers weigh more).
    - "seq-mean-token-mean": mean over sequences that have >= 1 valid token of each one's token mean.
    - "seq-mean-token-sum-norm" (Dr. GRPO): sum over valid tokens / (B * T), T = mask.shape[-1], a
      constant, so no length bias enters through the normalizer.
    ``norm`` replaces the divisor (valid tokens / non-empty sequences / B*T) with the whole batch's when
    the batch is split into micro-batches. An all-masked batch gives 0, not NaN.
    """
    m = mask.to(loss_tok.dtype)
    masked = torch.where(mask.bool(), loss_tok, torch.zeros((), dtype=loss_tok.dtype, device=loss_tok.device))
    if mode == "token-mean":
        denom = norm if norm is not None else m.sum().clamp(min=1.0)
        return masked.sum() / denom
    if mode == "seq-mean-token-mean":
        n_tok = m.sum(-1)
        per_seq = masked.sum(-1) / n_tok.clamp(min=1.0)
        denom = norm if norm is not None else (n_tok > 0).sum().clamp(min=1)
        return per_seq.sum() / denom
    if mode == "seq-mean-token-sum-norm":
        denom = norm if norm is not None else max(1, mask.shape[0] * mask.shape[-1])
        return masked.sum() / denom
    raise ValueError(f"loss_agg: unknown mode {mode!r}; expected one of {AGG_MODES}")


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) (Schulman 2020): exp(d) - d - 1, d = ref - logp."""
    d = _diff(ref_logp, logp, mask.bool()).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


# --------------------------------------------------------------------------- entry point
def compute_policy_loss(cfg: AlgorithmConfig, *, logp: Tensor, prox_logp: Tensor, behav_logp: Tensor,
                        advantages: Tensor, mask: Tensor, rewards: Tensor, entropy: Tensor | None = None,
                        ref_logp: Tensor | None = None, entropy_mask: Tensor | None = None,
                        norm: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The configured loss, aggregated, plus -beta H (entropy bonus) and kl_coef * k3 KL; and metrics.

    Shapes: logp/prox_logp/behav_logp/advantages/mask/entropy/ref_logp [B, T]; rewards [B]. ``entropy_mask`` [B, T]
    (AsyPPO's I^H) removes tokens from the entropy bonus only. ``norm``: see ``aggregate``.
    Metrics keys: loss/policy, loss/total, ratio/mean, ratio/clipped_frac, iw/mean, iw/max,
    iw/clipped_frac, entropy/mean, kl/mean (only those that apply). Staleness is not a loss metric:
    the controller reports it per step (flashrl/core/staleness.py, the one rule).
    """
    if cfg.loss not in LOSSES:
        raise ValueError(f"algorithm.loss: unknown loss {cfg.loss!r}; expected one of {sorted(LOSSES)}")
    shape = logp.shape
    for name, t in (("prox_logp", prox_logp), ("behav_logp", behav_logp), ("advantages", advantages), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"compute_policy_loss: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")
    if rewards.shape != shape[:1]:
        raise ValueError(f"compute_policy_loss: rewards has shape {tuple(rewards.shape)}, expected ({shape[0]},)")
    m = mask.bool()
    loss_tok, stats = LOSSES[cfg.loss](logp=logp, prox_logp=prox_logp.detach(), behav_logp=behav_logp.detach(),
                                       advantages=advantages.detach(), mask=m, rewards=rewards, cfg=cfg)
    policy = aggregate(loss_tok, m, cfg.loss_agg, norm)
    total = policy
    n = m.sum().clamp(min=1)
    metrics: dict[str, float] = {"loss/policy": float(policy.detach())}

    def mmean(x: Tensor) -> float:
        return float((x.to(torch.float64) * m).sum() / n)

    def mmax(x: Tensor) -> float:
        return float(x.masked_fill(~m, float("-inf")).max()) if bool(m.any()) else 0.0

    metrics["ratio/mean"] = mmean(stats["ratio"])
    metrics["ratio/clipped_frac"] = mmean(stats["clipped"])
    if "iw" in stats:
        metrics["iw/mean"] = mmean(stats["iw"])
        metrics["iw/max"] = mmax(stats["iw"])
        metrics["iw/clipped_frac"] = mmean(stats["iw_clipped"])
    if entropy is not None:
        metrics["entropy/mean"] = mmean(entropy.detach())
        if cfg.entropy_coef > 0:
            # I^H zeroes a token's bonus but keeps it in the normalizer: (1/|o|) sum_t I^H_t H_t (AsyPPO).
            h = entropy if entropy_mask is None else entropy * entropy_mask.to(entropy.dtype)
            ent = aggregate(h, m, cfg.loss_agg, norm)
            total = total - cfg.entropy_coef * ent
            metrics["loss/entropy"] = float(ent.detach())
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach(), m)
        metrics["kl/mean"] = mmean(kl.detach())
        if cfg.kl_coef > 0:
            total = total + cfg.kl_coef * aggregate(kl, m, cfg.loss_agg, norm)
    metrics["loss/total"] = float(total.detach())
    return total, metrics
