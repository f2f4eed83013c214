"""Attention-rhythm credit assignment (arXiv 2510.13554; docs/algorithms.md, "Attention-rhythm credit").

    batch (input_ids [B,L], attention_mask [B,L], response mask [B,T]) + current policy
       | one extra no-grad forward, eager attention, output_attentions
       v
    attentions of sampled layers  --head_distances--> d per head --split_heads--> local / global sets
       | A_loc = mean of local maps, A_glob = mean of global maps            [B, L, L]
       +--> waad(A_loc, W) --> WAAD_t, delta_t = |WAAD_t - WAAD_{t+1}|      [B, L]
       +--> fai(A_glob, response positions) --> FAI_s                       [B, L]
       v
    top rhythm.top_frac of response tokens by delta (T_loc) / by FAI (T_glob)
       v
    gamma [B, T] (logits-aligned) --> the trainer scales A~ = gamma * A before the policy loss

Positions: metrics are computed per *input* position p (row p of an attention map is token p reading its
past). The trainer's per-token tensors are logits-aligned (flashrl/trainer/batch.py): the response token
at input position p has index p - 1. ``credit_scale`` converts both ways; the pure functions work on
input positions. Everything here is detached: credit is a fixed per-token weight, not a gradient path.

Constants from the paper (docs/algorithms.md): up to 5 layers from the middle third, 30% local / global
heads, W = 10, FAI window [s+10, s+50], top 40%, amplification 1.5. Not published, so config fields with
our defaults: tau_waad, tau_delta, the coupling share a, and which token "introduces" a dominated anchor
(here: the WAAD peak among the 3 tokens before it).

Left out: the paper runs a separate ``actor_attn`` copy of the policy; here the trainer's own model is
switched to eager attention for this one forward and switched back, which costs the L x L maps of every
layer at once (HF returns all layers), so ``credit_scale`` forwards in chunks of ``chunk`` samples.
"""

from __future__ import annotations

import math

import torch

from flashrl.config import AlgorithmConfig

Tensor = torch.Tensor

MAX_LAYERS = 5  # layers sampled from the middle third (paper)
HEAD_FRAC = 0.3  # bottom / top share of heads by mean backward distance (paper)
FAI_MIN_GAP = 10  # T(s) starts 10 tokens after s (paper)
FAI_MAX_GAP = 50  # ... and ends 50 tokens after s (paper)
INTRO_LOOKBACK = 3  # k in {1, 2, 3}: how far back a dominated anchor's introducing token may sit (paper)


def sample_layers(num_layers: int, max_layers: int = MAX_LAYERS) -> list[int]:
    """Up to ``max_layers`` layer indices spread evenly over [floor(L/3), floor(2L/3)]; all if L <= max_layers."""
    if num_layers < 1:
        raise ValueError(f"sample_layers: num_layers={num_layers} must be >= 1")
    if num_layers <= max_layers:
        return list(range(num_layers))
    lo, hi = num_layers // 3, (2 * num_layers) // 3
    count = min(max_layers, hi - lo + 1)
    return sorted({lo + round(i * (hi - lo) / max(1, count - 1)) for i in range(count)})


def _distance(n: int, device: torch.device) -> Tensor:
    """[n, n] matrix of t - s (clamped at 0 above the diagonal, where causal maps are 0 anyway)."""
    idx = torch.arange(n, device=device, dtype=torch.float32)
    return (idx.unsqueeze(1) - idx.unsqueeze(0)).clamp(min=0)


def head_distances(attn: Tensor, valid: Tensor) -> Tensor:
    """Mean backward distance per head: d = mean over valid rows t of sum_s A[t, s] (t - s).

    attn [B, H, N, N] (rows sum to 1 over s <= t), valid [B, N] (real tokens). Returns [B, H].
    """
    n = attn.shape[-1]
    per_row = (attn.float() * _distance(n, attn.device)).sum(-1)  # [B, H, N]
    v = valid.to(per_row.dtype).unsqueeze(1)
    return (per_row * v).sum(-1) / v.sum(-1).clamp(min=1.0)


def _k(frac: float, n: int) -> int:
    return min(n, int(math.floor(frac * n + 1e-9)))


def split_heads(dist: Tensor, frac: float = HEAD_FRAC) -> tuple[Tensor, Tensor]:
    """Per sample, the bottom / top ``frac`` of heads by distance (at least one each): bool [B, H] x 2."""
    b, h = dist.shape
    k = max(1, _k(frac, h))
    order = torch.argsort(dist, dim=-1, stable=True)
    local = torch.zeros(b, h, dtype=torch.bool, device=dist.device)
    glob = torch.zeros_like(local)
    local.scatter_(1, order[:, :k], True)
    glob.scatter_(1, order[:, h - k:], True)
    return local, glob


def mean_maps(attn: Tensor, heads: Tensor) -> Tensor:
    """Average of the selected heads' maps: attn [B, H, N, N], heads bool [B, H] -> [B, N, N]."""
    w = heads.to(attn.dtype)
    return (attn * w[:, :, None, None]).sum(1) / w.sum(1).clamp(min=1)[:, None, None]


def waad(a_loc: Tensor, window: int) -> Tensor:
    """Windowed average attention distance: WAAD_t = sum_{s<=t} A_loc[t, s] min(t - s, W). [B, N]."""
    n = a_loc.shape[-1]
    return (a_loc.float() * _distance(n, a_loc.device).clamp(max=float(window))).sum(-1)


def fai(a_glob: Tensor, response: Tensor, min_gap: int = FAI_MIN_GAP, max_gap: int = FAI_MAX_GAP) -> Tensor:
    """Future attention influence: FAI_s = mean_{t in T(s)} A_glob[t, s], [B, N].

    T(s) = response positions t with s + min_gap <= t <= s + max_gap (and t < N). FAI is 0 where T(s)
    is empty (the last min_gap tokens of a sequence receive no future attention that counts).
    """
    n = a_glob.shape[-1]
    dist = torch.arange(n, device=a_glob.device).unsqueeze(1) - torch.arange(n, device=a_glob.device).unsqueeze(0)
    in_window = (dist >= min_gap) & (dist <= max_gap)  # [t, s]
    sel = in_window.unsqueeze(0) & response.bool().unsqueeze(-1)  # [B, t, s]
    total = (a_glob.float() * sel).sum(1)
    count = sel.sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def waad_delta(w: Tensor, valid: Tensor) -> Tensor:
    """delta_t = |WAAD_t - WAAD_{t+1}| where both t and t+1 are valid, else 0. [B, N]."""
    d = torch.zeros_like(w)
    both = valid[:, :-1].bool() & valid[:, 1:].bool()
    d[:, :-1] = torch.where(both, (w[:, :-1] - w[:, 1:]).abs(), torch.zeros_like(w[:, :-1]))
    return d


def top_fraction(score: Tensor, candidates: Tensor, frac: float) -> Tensor:
    """Per row, the floor(frac * n) candidates with the highest score (ties: earlier first). bool [B, N]."""
    out = torch.zeros_like(candidates, dtype=torch.bool)
    neg_inf = torch.tensor(float("-inf"), device=score.device)
    for i in range(score.shape[0]):
        cand = candidates[i].bool()
        k = _k(frac, int(cand.sum()))
        if k == 0:
            continue
        s = torch.where(cand, score[i].float(), neg_inf)
        # stable descending sort: negate and sort ascending so equal scores keep position order
        order = torch.argsort(-s, stable=True)
        out[i, order[:k]] = True
    return out


def dominated_anchors(anchors: Tensor, w: Tensor, delta: Tensor, response: Tensor, tau_waad: float,
                      tau_delta: float) -> tuple[Tensor, Tensor]:
    """D = anchors with WAAD_t <= tau_waad and max_{k<=3} delta_{t-k} >= tau_delta; and intro(D).

    intro(t) is the response token among t-1 .. t-3 with the highest WAAD (the WAAD peak that introduces
    the anchor; our reading, the paper gives no formula). Returns (D, intro) as bool [B, N].
    """
    b, n = w.shape
    resp = response.bool()
    neg_inf = torch.tensor(float("-inf"), device=w.device)
    max_delta = torch.full_like(w, float("-inf"))
    best_w = torch.full_like(w, float("-inf"))
    best_pos = torch.full((b, n), -1, dtype=torch.long, device=w.device)
    pos = torch.arange(n, device=w.device).expand(b, n)
    for k in range(1, INTRO_LOOKBACK + 1):
        if k >= n:
            break
        prev_ok = torch.zeros_like(resp)
        prev_ok[:, k:] = resp[:, :-k]
        prev_delta = torch.full_like(w, float("-inf"))
        prev_delta[:, k:] = delta[:, :-k]
        prev_w = torch.full_like(w, float("-inf"))
        prev_w[:, k:] = w[:, :-k]
        max_delta = torch.maximum(max_delta, torch.where(prev_ok, prev_delta, neg_inf))
        better = prev_ok & (prev_w > best_w)
        best_w = torch.where(better, prev_w, best_w)
        best_pos = torch.where(better, pos - k, best_pos)
    dom = anchors.bool() & (w <= tau_waad) & (max_delta >= tau_delta) & (best_pos >= 0)
    intro = torch.zeros_like(dom)
    rows, cols = torch.nonzero(dom, as_tuple=True)
    intro[rows, best_pos[rows, cols]] = True
    return dom, intro


def rhythm_gamma(a_loc: Tensor, a_glob: Tensor, valid: Tensor, response: Tensor, cfg: AlgorithmConfig,
                 mode: str | None = None) -> Tensor:
    """gamma [B, N] over input positions for ``mode`` ("waad" | "fai" | "rhythm"; default cfg.credit).

    waad: 1 + (amp - 1) 1[T_loc]; fai: 1 + (amp - 1) 1[T_glob]; rhythm (coupled):
    1 + (amp-1) 1[T_glob \\ D] + (1 - a)(amp-1) 1[D] + a (amp-1) 1[intro(D)], a = cfg.rhythm.coupling.
    gamma is 1 outside the response.
    """
    mode = mode or cfg.credit
    if mode not in ("waad", "fai", "rhythm"):
        raise ValueError(f"algorithm.credit: unknown mode {mode!r}; expected 'waad', 'fai' or 'rhythm'")
    bonus = cfg.rhythm.amplify - 1.0
    resp = response.bool()
    w = waad(a_loc, cfg.rhythm.window)
    gamma = torch.ones_like(w)
    if mode == "waad":
        t_loc = top_fraction(waad_delta(w, valid), resp, cfg.rhythm.top_frac)
        return gamma + bonus * t_loc
    f = fai(a_glob, resp)
    t_glob = top_fraction(f, resp, cfg.rhythm.top_frac)
    if mode == "fai":
        return gamma + bonus * t_glob
    dom, intro = dominated_anchors(t_glob, w, waad_delta(w, valid), resp, cfg.rhythm.tau_waad, cfg.rhythm.tau_delta)
    a = cfg.rhythm.coupling
    return gamma + bonus * (t_glob & ~dom) + (1 - a) * bonus * dom + a * bonus * intro


def gamma_from_attentions(attentions: list[Tensor] | tuple[Tensor, ...], attention_mask: Tensor,
                          response_pos: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """gamma [B, N] (input positions) from every layer's attention maps ([B, H, N, N] each)."""
    layers = sample_layers(len(attentions))
    attn = torch.cat([attentions[i].detach().float() for i in layers], dim=1)  # heads of all sampled layers
    valid = attention_mask.bool()
    local, glob = split_heads(head_distances(attn, valid))
    return rhythm_gamma(mean_maps(attn, local), mean_maps(attn, glob), valid, response_pos, cfg)


@torch.no_grad()
def credit_scale(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                 cfg: AlgorithmConfig, *, advantages: Tensor | None = None, chunk: int = 16) -> Tensor:
    """Per-token advantage scale gamma [B, T] (logits-aligned like ``response_mask``) for cfg.credit.

    ``model`` is any Hugging Face causal LM (attention maps need eager attention: the model is switched to
    "eager" for this forward and back afterwards). input_ids / attention_mask [B, L], right-padded;
    response_mask [B, L-1] is the trainer's loss mask. With ``cfg.rhythm.positive_only`` pass
    ``advantages`` [B, T]: gamma is then 1 wherever A < 0. cfg.credit == "none" gives all ones.
    """
    b, length = input_ids.shape
    if response_mask.shape != (b, length - 1):
        raise ValueError(f"credit_scale: response_mask has shape {tuple(response_mask.shape)}, expected "
                         f"{(b, length - 1)} (logits-aligned, one shorter than input_ids)")
    if cfg.credit == "none":
        return torch.ones(b, length - 1, device=input_ids.device)
    if cfg.rhythm.positive_only and advantages is None:
        raise ValueError("credit_scale: algorithm.rhythm.positive_only needs advantages=...; pass the [B, T] advantages")
    # response token at input position p is logits index p - 1
    response_pos = torch.zeros(b, length, dtype=torch.bool, device=input_ids.device)
    response_pos[:, 1:] = response_mask.bool()
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    switch = previous is not None and previous != "eager"
    if switch:
        model.set_attn_implementation("eager")  # type: ignore[operator]
    was_training = model.training
    model.eval()  # no attention dropout in the maps
    try:
        out = []
        for i in range(0, b, chunk):
            sl = slice(i, i + chunk)
            res = model(input_ids=input_ids[sl], attention_mask=attention_mask[sl], output_attentions=True, use_cache=False)
            if not getattr(res, "attentions", None):
                raise RuntimeError("credit_scale: the model returned no attention maps; it must be a Hugging Face "
                                   "causal LM that supports output_attentions with eager attention")
            out.append(gamma_from_attentions(res.attentions, attention_mask[sl], response_pos[sl], cfg))
    finally:
        if switch:
            model.set_attn_implementation(previous)  # type: ignore[operator]
        model.train(was_training)
    gamma = torch.cat(out)[:, 1:]
    gamma = torch.where(response_mask.bool(), gamma, torch.ones_like(gamma))
    if cfg.rhythm.positive_only and advantages is not None:
        gamma = torch.where(advantages >= 0, gamma, torch.ones_like(gamma))
    return gamma
