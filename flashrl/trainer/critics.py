"""AsyPPO mini-critics (arXiv 2510.01656; docs/algorithms.md, "AsyPPO mini-critics"), algorithm.loss = "asyppo".

One training step, as the trainer drives it::

    batch (input_ids [B,L], attention_mask [B,L], loss_mask [B,T], rewards [B], groups [B])
       |
       +--> MiniCritics.advantages_and_masks()   (no grad)
       |       V_m = critic m (all M critics see every sample) ........ [M,B,T]
       |       V_bar = mean_m V_m, sigma = std_m V_m .................. [B,T]
       |       GAE(V_bar, reward at the last response token) -> A, returns R
       |       A whitened over valid tokens (veRL's PPO does the same)
       |       I^A = 0 on the lowest k_A of sigma, I^H = 0 on the top k_H (ranked over valid tokens)
       |       -> CriticTargets(advantages = I^A * A, entropy_mask = I^H, returns = R, ...)
       |
       +--> losses.compute_policy_loss(loss="asyppo", advantages=..., entropy_mask=...)   (policy step)
       |
       +--> MiniCritics.update(returns=R)   critic m regresses on its share D_m of each group only:
                sum_m mean_{t in D_m} (V_m(s_t) - R_t)^2, own AdamW (asyppo.lr), not the policy's optimizer

Tensor layout is the trainer's (flashrl/trainer/batch.py): per-token tensors have length T = L - 1 and
index j is the state after reading input_ids[..., :j+1], i.e. the state in which token j+1 is chosen.
The critic's value head at position j therefore gives V(s) for the token the logits at j predict.

Choices that are ours (the paper does not fix them for tiny models): each critic is a Qwen2 decoder of
``asyppo.layers`` x ``asyppo.hidden`` over the policy's token ids, trained from scratch, each with its
own seed (disagreement needs different inits); returns are GAE lambda-returns on V_bar; ties in sigma are
broken by position. Write-ups of the method differ on the partition (one speaks of a prompt-level one);
flashrl splits each group's responses among the critics (docs/algorithms.md), which is what
``split_by_group`` does.

Multi-rank: the critics are tiny, so every rank holds an identical replica (same seeds) and runs both
calls on the *whole* batch: the sigma quantiles are then exact over the batch and the replicas stay
equal without any collective. Only if ranks feed different samples, pass ``all_reduce=True`` to
``update`` (the critics must then sit on a device the process group's backend supports), and the
quantiles become per-rank (an approximation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flashrl.config import AlgorithmConfig

Tensor = torch.Tensor
CRITIC_HEADS = 4  # attention heads per critic layer; asyppo.hidden must be a multiple


# --------------------------------------------------------------------------- pure functions
def gae(values: Tensor, rewards: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    values [B, T] (V(s_t) on valid tokens), rewards [B] (paid at the last valid token), mask [B, T].
    Masked tokens (prompt, padding, environment observations) are skipped: the next state of a valid
    token is the next *valid* token, so multi-turn trajectories chain across observations.
    Returns (advantages, returns = advantages + values), both 0 on masked tokens.
    """
    m = mask.bool()
    b, t = values.shape
    v = values.detach().to(torch.float64)
    last = _last_valid(m)
    r_tok = torch.zeros(b, t, dtype=torch.float64, device=values.device)
    has = last >= 0
    r_tok[has, last[has]] = rewards.detach().to(torch.float64)[has]
    adv = torch.zeros_like(v)
    next_v = torch.zeros(b, dtype=torch.float64, device=values.device)
    next_a = torch.zeros(b, dtype=torch.float64, device=values.device)
    for j in range(t - 1, -1, -1):
        delta = r_tok[:, j] + gamma * next_v - v[:, j]
        a = delta + gamma * lam * next_a
        valid = m[:, j]
        adv[:, j] = torch.where(valid, a, 0.0)
        next_v = torch.where(valid, v[:, j], next_v)
        next_a = torch.where(valid, a, next_a)
    ret = torch.where(m, adv + v, 0.0)
    return adv.to(values.dtype), ret.to(values.dtype)


def _last_valid(m: Tensor) -> Tensor:
    """Index of the last True per row, -1 for an all-False row."""
    t = m.shape[-1]
    idx = torch.arange(t, device=m.device).expand_as(m)
    return torch.where(m, idx, -1).max(-1).values


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over valid tokens (veRL's masked_whiten); 0 on masked tokens."""
    m = mask.bool()
    n = int(m.sum())
    if n < 2:
        return torch.where(m, x, 0.0)
    vals = x[m].to(torch.float64)
    out = (x.to(torch.float64) - vals.mean()) / (vals.std() + eps)
    return torch.where(m, out, 0.0).to(x.dtype)


def split_by_group(groups: Tensor, num_critics: int) -> Tensor:
    """Critic index [B] for each sample: each group's responses dealt round-robin over the critics.

    Disjoint and covering by construction (every sample gets exactly one critic); within a group the
    shares differ by at most one. The starting critic rotates from group to group (in order of first
    appearance) so odd-sized groups do not all favour critic 0.
    """
    if num_critics < 1:
        raise ValueError(f"split_by_group: num_critics={num_critics} must be >= 1")
    out = torch.empty_like(groups)
    order: dict[int, int] = {}
    seen: dict[int, int] = {}
    for i, g in enumerate(groups.tolist()):
        start = order.setdefault(g, len(order))
        rank = seen.get(g, 0)
        seen[g] = rank + 1
        out[i] = (start + rank) % num_critics
    return out


def _count(frac: float, n: int) -> int:
    # floor with a guard so 0.2 * 10 gives 2, not 1 (0.2 * 10 = 2.0000000000000004 is fine, 0.3*10 is not)
    return min(n, int(math.floor(frac * n + 1e-9)))


def uncertainty_masks(sigma: Tensor, mask: Tensor, k_adv: float, k_ent: float) -> tuple[Tensor, Tensor]:
    """AsyPPO's masks from critic disagreement sigma [B, T], ranked over valid tokens.

    I^A = 0 on the floor(k_adv * N) valid tokens with the lowest sigma (critics agree: the advantage is
    treated as noise); I^H = 0 on the floor(k_ent * N) with the highest sigma (left out of the entropy
    bonus). Both are 0 on masked tokens. Returns (adv_mask, ent_mask) as float tensors [B, T].
    """
    m = mask.bool()
    flat_m = m.reshape(-1)
    pos = torch.nonzero(flat_m).squeeze(-1)
    n = int(pos.numel())
    adv_mask = flat_m.clone()
    ent_mask = flat_m.clone()
    if n:
        s = sigma.reshape(-1)[pos].to(torch.float64)
        order = torch.argsort(s, stable=True)  # ascending; ties keep position order
        k_a, k_h = _count(k_adv, n), _count(k_ent, n)
        adv_mask[pos[order[:k_a]]] = False
        if k_h:
            ent_mask[pos[order[n - k_h:]]] = False
    return adv_mask.reshape(m.shape).to(sigma.dtype), ent_mask.reshape(m.shape).to(sigma.dtype)


def critic_loss(values: Tensor, returns: Tensor, mask: Tensor, assignment: Tensor) -> Tensor:
    """sum_m mean over valid tokens of critic m's samples of (V_m - R)^2. values [M, B, T]."""
    m = mask.bool()
    total = values.new_zeros(())
    for k in range(values.shape[0]):
        sel = m & (assignment == k).unsqueeze(-1)
        n = sel.sum()
        if int(n) == 0:
            continue
        err = torch.where(sel, values[k] - returns.detach(), 0.0)
        total = total + (err**2).sum() / n
    return total


# --------------------------------------------------------------------------- the critics
@dataclass(frozen=True)
class CriticTargets:
    """What one step of AsyPPO needs from the critics (all [B, T], logits-aligned, detached)."""

    advantages: Tensor  # I^A * whitened GAE advantage: pass as compute_policy_loss(advantages=...)
    entropy_mask: Tensor  # I^H: pass as compute_policy_loss(entropy_mask=...)
    returns: Tensor  # regression targets: pass to MiniCritics.update(returns=...)
    values: Tensor  # V_bar
    sigma: Tensor  # std over critics
    metrics: dict[str, float]


class _ValueModel(nn.Module):
    """A small Qwen2 decoder with a scalar head per position."""

    def __init__(self, vocab_size: int, layers: int, hidden: int) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2Model

        if hidden % CRITIC_HEADS:
            raise ValueError(f"algorithm.asyppo.hidden={hidden} must be a multiple of {CRITIC_HEADS} (critic heads)")
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=CRITIC_HEADS,
                             num_key_value_heads=CRITIC_HEADS, max_position_embeddings=1 << 16,
                             tie_word_embeddings=False, use_cache=False)
        self.body = Qwen2Model(config)
        self.head = nn.Linear(hidden, 1)
        # Small but random (not zero): critics with different seeds must disagree from step 0, or sigma
        # is 0 everywhere and the masks would rank ties.
        with torch.no_grad():
            self.head.weight.mul_(0.1)
            self.head.bias.zero_()

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1)[:, :-1]  # [B, L-1]: the value at j is the state that chooses token j+1


class MiniCritics(nn.Module):
    """M small value models, their own AdamW, and the AsyPPO step (see the module docstring)."""

    def __init__(self, vocab_size: int, cfg: AlgorithmConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        critics = []
        # fork_rng: building the critics must not shift the policy's or the sampler's random stream
        with torch.random.fork_rng(devices=[]):
            for k in range(cfg.asyppo.num_critics):
                torch.manual_seed(seed * 1009 + k)
                critics.append(_ValueModel(vocab_size, cfg.asyppo.layers, cfg.asyppo.hidden))
        self.critics = nn.ModuleList(critics)
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=cfg.asyppo.lr, weight_decay=0.0)

    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """V_m for every critic and sample: [M, B, L-1] (with gradient; wrap in no_grad to evaluate)."""
        return torch.stack([c(input_ids, attention_mask) for c in self.critics])

    @torch.no_grad()
    def advantages_and_masks(self, input_ids: Tensor, attention_mask: Tensor, mask: Tensor,
                             rewards: Tensor) -> CriticTargets:
        """GAE advantages on V_bar, the I^A / I^H masks and the returns, for one batch (no gradient)."""
        v = self.values(input_ids, attention_mask).float()
        m = mask.bool()
        v_bar = v.mean(0)
        sigma = v.std(0, unbiased=False) if v.shape[0] > 1 else torch.zeros_like(v_bar)
        adv, ret = gae(v_bar, rewards.float(), m, self.cfg.asyppo.gamma, self.cfg.asyppo.gae_lambda)
        adv = whiten(adv, m)
        adv_mask, ent_mask = uncertainty_masks(sigma, m, self.cfg.asyppo.k_adv, self.cfg.asyppo.k_ent)
        n = m.sum().clamp(min=1)
        metrics = {
            "critic/value_mean": float((v_bar * m).sum() / n),
            "critic/sigma_mean": float((sigma * m).sum() / n),
            "critic/adv_masked_frac": float(((1 - adv_mask) * m).sum() / n),
            "critic/ent_masked_frac": float(((1 - ent_mask) * m).sum() / n),
        }
        return CriticTargets(advantages=adv * adv_mask, entropy_mask=ent_mask, returns=ret,
                             values=torch.where(m, v_bar, 0.0), sigma=torch.where(m, sigma, 0.0), metrics=metrics)

    def update(self, input_ids: Tensor, attention_mask: Tensor, mask: Tensor, returns: Tensor,
               groups: Tensor, *, all_reduce: bool = False) -> dict[str, float]:
        """``cfg.asyppo.updates`` regression steps; critic m sees only its share of each group.

        ``all_reduce``: average the critics' gradients over the default process group (only when ranks
        feed different samples; see the module docstring).
        """
        assignment = split_by_group(groups, len(self.critics)).to(input_ids.device)
        loss = torch.zeros(())
        for _ in range(self.cfg.asyppo.updates):
            self.optimizer.zero_grad(set_to_none=True)
            loss = critic_loss(self.values(input_ids, attention_mask), returns, mask, assignment)
            loss.backward()
            if all_reduce:
                self._sync_grads()
            self.optimizer.step()
        return {"critic/loss": float(loss.detach())}

    def _sync_grads(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(world)
