"""Policy losses against hand-computed values and gradients (docs/algorithms.md, "Policy losses")."""

from __future__ import annotations

import math

import pytest
import torch

from flashrl.config import AlgorithmConfig, CISPOOptions, GSPOOptions
from flashrl.trainer.losses import LOSSES, aggregate, compute_policy_loss, sequence_ratio

LN = math.log


def _run(name: str, logp: list[list[float]], prox: list[list[float]], behav: list[list[float]],
         adv: list[list[float]], mask: list[list[float]] | None = None, rewards: list[float] | None = None,
         **cfg_kw: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Run one loss through compute_policy_loss; return (loss, d loss / d logp, metrics)."""
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    m = torch.ones_like(lp) if mask is None else torch.tensor(mask, dtype=torch.float64)
    r = torch.zeros(lp.shape[0], dtype=torch.float64) if rewards is None else torch.tensor(rewards, dtype=torch.float64)
    cfg = AlgorithmConfig(loss=name, **cfg_kw)  # type: ignore[arg-type]
    loss, metrics = compute_policy_loss(cfg, logp=lp, prox_logp=torch.tensor(prox, dtype=torch.float64),
                                        behav_logp=torch.tensor(behav, dtype=torch.float64),
                                        advantages=torch.tensor(adv, dtype=torch.float64), mask=m, rewards=r)
    loss.backward()
    assert lp.grad is not None
    return loss.detach(), lp.grad, metrics


H = LN(0.5)  # a convenient current logprob


def test_ppo_clip_values_and_gradients() -> None:
    # ratios 1.0, 1.5, 0.5 with A = +1: clipped to 1.2 on token 2 (no gradient), unclipped below (r A < clip A).
    prox = [[H, H - LN(1.5), H - LN(0.5)]]
    loss, grad, met = _run("ppo", [[H, H, H]], prox, prox, [[1.0, 1.0, 1.0]])
    assert loss.item() == pytest.approx((-1.0 - 1.2 - 0.5) / 3)
    assert grad.tolist()[0] == pytest.approx([-1.0 / 3, 0.0, -0.5 / 3])
    assert met["ratio/clipped_frac"] == pytest.approx(1 / 3)
    assert met["ratio/mean"] == pytest.approx(1.0)
    # A = -1: loss = max(r, clip(r)): 1, 1.5 (unclipped, grad 1.5), 0.8 (clipped from below, grad 0).
    loss, grad, met = _run("grpo", [[H, H, H]], prox, prox, [[-1.0, -1.0, -1.0]])
    assert loss.item() == pytest.approx((1.0 + 1.5 + 0.8) / 3)
    assert grad.tolist()[0] == pytest.approx([1.0 / 3, 1.5 / 3, 0.0])
    assert met["ratio/clipped_frac"] == pytest.approx(1 / 3)


def test_ppo_dual_clip_caps_negative_advantage() -> None:
    prox = [[H - LN(4.0), H - LN(4.0)]]  # ratio 4
    loss, grad, met = _run("ppo", [[H, H]], prox, prox, [[-1.0, 1.0]], dual_clip=3.0)
    # token 0: A<0, max(4, 1.2) = 4 capped at -c A = 3 (no gradient); token 1: A>0 clipped at 1.2 -> -1.2.
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0])
    assert met["ratio/clipped_frac"] == pytest.approx(1.0)
    loss_off, grad_off, _ = _run("ppo", [[H, H]], prox, prox, [[-1.0, 1.0]])
    assert loss_off.item() == pytest.approx((4.0 - 1.2) / 2)
    assert grad_off.tolist()[0] == pytest.approx([4.0 / 2, 0.0])


def test_decoupled_ppo_weights_and_caps_behaviour_ratio() -> None:
    # r = 1 on both tokens; w = prox/behav = 2 and 10 (capped at w_max = 5).
    logp = [[H, H]]
    behav = [[H - LN(2.0), H - LN(10.0)]]
    loss, grad, met = _run("decoupled_ppo", logp, logp, behav, [[1.0, 1.0]])
    assert loss.item() == pytest.approx((-2.0 - 5.0) / 2)
    assert grad.tolist()[0] == pytest.approx([-2.0 / 2, -5.0 / 2])
    assert met["iw/mean"] == pytest.approx(6.0)
    assert met["iw/max"] == pytest.approx(10.0)
    assert met["iw/clipped_frac"] == pytest.approx(0.5)


def test_tis_truncates_ratio_to_behaviour() -> None:
    logp = [[H, H]]
    behav = [[H - LN(4.0), H - LN(0.5)]]  # rb = 4 (capped at C = 2) and 0.5
    loss, grad, met = _run("tis", logp, logp, behav, [[1.0, 1.0]])
    assert loss.item() == pytest.approx((-2.0 * H - 0.5 * H) / 2)
    assert grad.tolist()[0] == pytest.approx([-2.0 / 2, -0.5 / 2])
    assert met["iw/clipped_frac"] == pytest.approx(0.5)


def test_topr_no_weight_on_positive_reward_samples() -> None:
    logp = [[H, H], [H, H]]
    behav = [[H - LN(4.0), H - LN(0.5)], [H - LN(4.0), H - LN(0.5)]]  # rb = 4, 0.5 in both samples
    adv = [[1.0, 1.0], [-1.0, -1.0]]
    loss, grad, met = _run("topr", logp, logp, behav, adv, rewards=[1.0, 0.0])
    # sample 0 (reward 1): weight 1 whatever rb; sample 1 (reward 0): weight clip(rb, 0, 1) = 1, 0.5.
    assert grad.tolist() == [pytest.approx([-0.25, -0.25]), pytest.approx([0.25, 0.125])]
    assert loss.item() == pytest.approx((-H - H + H + 0.5 * H) / 4)
    assert met["iw/mean"] == pytest.approx((1 + 1 + 1 + 0.5) / 4)


def test_cispo_clips_weight_but_keeps_every_gradient() -> None:
    logp = [[H, H, H]]
    behav = [[H - LN(4.0), H - LN(0.1), H]]  # rb = 4 -> 1.2, 0.1 -> 0.1 (no lower clip), 1
    loss, grad, met = _run("cispo", logp, logp, behav, [[1.0, 1.0, 1.0]])
    assert grad.tolist()[0] == pytest.approx([-1.2 / 3, -0.1 / 3, -1.0 / 3])
    assert loss.item() == pytest.approx(-(1.2 + 0.1 + 1.0) * H / 3)
    assert met["iw/clipped_frac"] == pytest.approx(1 / 3)
    # a lower clip when configured: eps_low_is = 0.5 -> weight >= 0.5
    _, grad2, _ = _run("cispo", logp, logp, behav, [[1.0, 1.0, 1.0]], cispo=CISPOOptions(eps_low=0.5))
    assert grad2[0, 1].item() == pytest.approx(-0.5 / 3)


def test_gspo_ratio_is_per_sequence_and_gradient_matches_sequence_objective() -> None:
    lp = torch.tensor([[H, H, H], [H, H, 0.0]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[H - LN(2.0), H, H], [H, H + LN(0.9), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    cfg = AlgorithmConfig(loss="gspo", gspo=GSPOOptions(eps_low=0.5, eps_high=0.5), loss_agg="seq-mean-token-mean")
    s = sequence_ratio(lp, prox, mask)
    assert s.tolist() == pytest.approx([2.0 ** (1 / 3), (1 / 0.9) ** 0.5])
    loss_tok, stats = LOSSES["gspo"](logp=lp, prox_logp=prox, behav_logp=prox, advantages=adv, mask=mask.bool(),
                                      rewards=torch.zeros(2), cfg=cfg)
    # every valid token carries its sequence's ratio
    assert stats["ratio"][0].tolist() == pytest.approx([s[0].item()] * 3)
    assert stats["ratio"][1, :2].tolist() == pytest.approx([s[1].item()] * 2)
    loss = aggregate(loss_tok, mask, cfg.loss_agg)
    (g_tok,) = torch.autograd.grad(loss, lp)
    # the sequence-level GSPO objective written directly
    s_direct = sequence_ratio(lp, prox, mask)
    a = adv[:, 0]
    seq_loss = torch.maximum(-s_direct * a, -s_direct.clamp(0.5, 1.5) * a).mean()
    (g_seq,) = torch.autograd.grad(seq_loss, lp)
    assert loss.item() == pytest.approx(seq_loss.item())
    assert torch.allclose(g_tok, g_seq)
    assert g_tok[1, 2].item() == 0.0
    # paper eps (3e-4/4e-4): ratio 2^(1/3) is clipped for A > 0 -> no gradient on sample 0; sample 1
    # (ratio 1.054 > 1, A < 0) stays unclipped, gradient -s A / |o| per token, seq-mean over 2 samples.
    _, grad, met = _run("gspo", lp.detach().tolist(), prox.tolist(), prox.tolist(), adv.tolist(), mask.tolist(),
                        loss_agg="seq-mean-token-mean")
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert grad[1].tolist() == pytest.approx([2.0 * s[1].item() / 2 / 2] * 2 + [0.0])
    assert met["ratio/clipped_frac"] == pytest.approx(3 / 5)


def test_equal_logprobs_make_ppo_decoupled_tis_agree() -> None:
    torch.manual_seed(0)
    logp = (torch.rand(3, 5, dtype=torch.float64) * -3).tolist()
    adv = torch.randn(3, 1, dtype=torch.float64).expand(3, 5).tolist()
    out = {n: _run(n, logp, logp, logp, adv, rewards=[0.0, -1.0, 0.0]) for n in ("ppo", "decoupled_ppo", "tis", "cispo", "topr")}
    assert out["ppo"][0].item() == pytest.approx(out["decoupled_ppo"][0].item())
    for n in ("decoupled_ppo", "tis", "cispo", "topr"):
        assert torch.allclose(out[n][1], out["ppo"][1]), n
    assert out["ppo"][1].abs().sum() > 0  # the comparison is not between zeros


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_tokens_get_zero_loss_and_zero_gradient(name: str) -> None:
    # padding holds -inf / garbage logprobs: must not leak NaN into the loss or the gradient
    lp = torch.tensor([[-0.5, -1.0, float("-inf")], [-0.2, float("-inf"), float("-inf")]], requires_grad=True)
    prox = torch.tensor([[-0.6, -0.9, 0.0], [-0.3, float("-inf"), 5.0]])
    behav = torch.tensor([[-0.7, -1.1, float("-inf")], [-0.1, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    cfg = AlgorithmConfig(loss=name, gspo=GSPOOptions(eps_low=0.5, eps_high=0.5))  # type: ignore[arg-type]
    loss_tok, _ = LOSSES[name](logp=lp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask.bool(),
                               rewards=torch.tensor([1.0, 0.0]), cfg=cfg)
    assert loss_tok[mask == 0].tolist() == [0.0, 0.0, 0.0]
    total, _ = compute_policy_loss(cfg, logp=lp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=mask,
                                   rewards=torch.tensor([1.0, 0.0]))
    total.backward()
    assert lp.grad is not None and torch.isfinite(total)
    assert lp.grad[mask == 0].tolist() == [0.0, 0.0, 0.0]
    assert bool(torch.isfinite(lp.grad).all()) and lp.grad[mask == 1].abs().sum() > 0


def test_aggregation_modes_exact() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    # empty sequence 3 is left out of the sequence mean
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10.0 / (3 * 4))
    # micro-batching: the whole batch's divisor makes the halves sum to the full-batch loss
    for mode, norm in (("token-mean", 4.0), ("seq-mean-token-mean", 2.0), ("seq-mean-token-sum-norm", 12.0)):
        halves = aggregate(loss[:1], mask[:1], mode, norm) + aggregate(loss[1:], mask[1:], mode, norm)
        assert halves.item() == pytest.approx(aggregate(loss, mask, mode).item()), mode
    assert aggregate(loss, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="loss_agg: unknown mode 'sum'"):
        aggregate(loss, mask, "sum")


def test_entropy_bonus_and_kl_metrics() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, 0.0]])
    ent = torch.tensor([[0.5, 1.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = AlgorithmConfig(loss="ppo", entropy_coef=0.1, kl_coef=0.5)
    total, met = compute_policy_loss(cfg, logp=lp, prox_logp=lp.detach(), behav_logp=lp.detach(),
                                     advantages=torch.ones(1, 3), mask=mask, rewards=torch.zeros(1),
                                     entropy=ent, ref_logp=ref)
    kl = (math.exp(1.0) - 1.0 - 1.0) / 2  # token 0: d = 0 -> 0; token 1: d = 1 -> e - 2
    assert met["kl/mean"] == pytest.approx(kl)
    assert met["entropy/mean"] == pytest.approx(0.75)
    assert total.item() == pytest.approx(-1.0 - 0.1 * 0.75 + 0.5 * kl, rel=1e-6)
    assert not any(k.startswith("staleness/") for k in met)  # the controller's (core/staleness.py)
    total.backward()
    assert ent.grad is not None and ent.grad.tolist()[0] == pytest.approx([-0.05, -0.05, 0.0])
    # AsyPPO's I^H removes token 1 from the bonus but keeps it in the normaliser (1/|o|)
    ent.grad = None
    total, met = compute_policy_loss(cfg, logp=lp, prox_logp=lp.detach(), behav_logp=lp.detach(),
                                     advantages=torch.ones(1, 3), mask=mask, rewards=torch.zeros(1), entropy=ent,
                                     entropy_mask=torch.tensor([[1.0, 0.0, 1.0]]))
    assert met["loss/entropy"] == pytest.approx(0.25)
    total.backward()
    assert ent.grad.tolist()[0] == pytest.approx([-0.05, 0.0, 0.0])


def test_shape_errors_name_the_tensor() -> None:
    cfg = AlgorithmConfig()
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages has shape \\(2,\\), expected \\(2, 3\\)"):
        compute_policy_loss(cfg, logp=x, prox_logp=x, behav_logp=x, advantages=torch.zeros(2), mask=x, rewards=torch.zeros(2))
    with pytest.raises(ValueError, match="rewards has shape"):
        compute_policy_loss(cfg, logp=x, prox_logp=x, behav_logp=x, advantages=x, mask=x, rewards=torch.zeros(3))
