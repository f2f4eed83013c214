"""AsyPPO mini-critics: GAE, the data split, the sigma masks and the critic regression."""

from __future__ import annotations

import pytest
import torch

from flashrl.config import AlgorithmConfig, AsyPPOOptions
from flashrl.trainer.critics import MiniCritics, critic_loss, gae, split_by_group, uncertainty_masks, whiten
from flashrl.trainer.losses import compute_policy_loss


def test_gae_hand_computed() -> None:
    v = torch.tensor([[9.0, 0.5, 0.2, 0.1, 7.0]], dtype=torch.float64)
    m = torch.tensor([[0, 1, 1, 1, 0]])
    adv, ret = gae(v, torch.tensor([1.0], dtype=torch.float64), m, gamma=1.0, lam=0.5)
    # deltas: 1 - 0.1 = 0.9; 0.1 - 0.2 = -0.1; 0.2 - 0.5 = -0.3; A_t = delta_t + 0.5 A_{t+1}
    assert adv.tolist()[0] == pytest.approx([0.0, -0.125, 0.35, 0.9, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.0, 0.375, 0.55, 1.0, 0.0])
    # lambda = 1, gamma = 1: Monte Carlo, A_t = R - V_t
    adv1, _ = gae(v, torch.tensor([1.0], dtype=torch.float64), m, gamma=1.0, lam=1.0)
    assert adv1.tolist()[0] == pytest.approx([0.0, 0.5, 0.8, 0.9, 0.0])


def test_gae_skips_observation_tokens_in_multi_turn() -> None:
    # tokens 1 and 3 are policy tokens, token 2 an environment observation (mask 0, value ignored)
    v = torch.tensor([[0.0, 0.5, 99.0, 0.1]], dtype=torch.float64)
    m = torch.tensor([[0, 1, 0, 1]])
    adv, _ = gae(v, torch.tensor([1.0], dtype=torch.float64), m, gamma=0.9, lam=0.5)
    a3 = 1.0 - 0.1
    a1 = (0.9 * 0.1 - 0.5) + 0.9 * 0.5 * a3
    assert adv.tolist()[0] == pytest.approx([0.0, a1, 0.0, a3])


def test_split_is_disjoint_covering_and_balanced() -> None:
    # interleaved groups of sizes 8, 3 and 1
    groups = torch.tensor([5, 5, 7, 5, 5, 9, 7, 5, 5, 5, 7, 5])
    for num in (2, 3):
        a = split_by_group(groups, num)
        assert a.shape == groups.shape and bool(((a >= 0) & (a < num)).all())  # exactly one critic each
        for g in (5, 7, 9):
            counts = torch.bincount(a[groups == g], minlength=num)
            assert int(counts.sum()) == int((groups == g).sum())
            assert int(counts.max() - counts.min()) <= 1, (num, g, counts)
    a2 = split_by_group(groups, 2)
    assert torch.bincount(a2[groups == 5]).tolist() == [4, 4]
    # the odd-sized group 7 starts on the other critic, so the batch as a whole stays balanced
    assert torch.bincount(a2).tolist() == [6, 6]


def test_critic_loss_trains_each_critic_on_its_share_only() -> None:
    values = torch.zeros(2, 4, 3, requires_grad=True)
    returns = torch.ones(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assignment = torch.tensor([0, 1, 0, 1])
    loss = critic_loss(values, returns, mask, assignment)
    # each critic: mean squared error 1 over its valid tokens -> 1 + 1
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    g = values.grad
    assert g is not None
    assert g[0, 1].abs().sum() == 0 and g[0, 3].abs().sum() == 0  # critic 0 never sees samples 1, 3
    assert g[1, 0].abs().sum() == 0 and g[1, 2].abs().sum() == 0
    assert g[0, 0].tolist() == pytest.approx([-2 / 3, -2 / 3, 0.0])  # d/dV (V-1)^2 / 3 valid tokens


def test_uncertainty_masks_select_exact_quantiles() -> None:
    torch.manual_seed(0)
    mask = torch.zeros(3, 6)
    mask[0, 1:5] = 1
    mask[1, :6] = 1
    mask[2, 2:4] = 1  # 12 valid tokens
    sigma = torch.full((3, 6), -100.0)  # masked tokens carry extreme sigma: they must not be ranked
    ranks = torch.randperm(12).float()
    sigma[mask.bool()] = ranks
    adv_mask, ent_mask = uncertainty_masks(sigma, mask, k_adv=0.25, k_ent=0.25)
    assert sorted(sigma[(adv_mask == 0) & mask.bool()].tolist()) == [0.0, 1.0, 2.0]
    assert sorted(sigma[(ent_mask == 0) & mask.bool()].tolist()) == [9.0, 10.0, 11.0]
    assert adv_mask[mask == 0].abs().sum() == 0 and ent_mask[mask == 0].abs().sum() == 0
    # k = 0.2 of 10 valid tokens is exactly 2 (floating point must not round it down to 1)
    m10 = torch.ones(1, 10)
    a, h = uncertainty_masks(torch.arange(10.0).unsqueeze(0), m10, 0.2, 0.2)
    assert a.tolist()[0] == [0, 0] + [1] * 8
    assert h.tolist()[0] == [1] * 8 + [0, 0]
    a0, h0 = uncertainty_masks(torch.arange(10.0).unsqueeze(0), m10, 0.0, 0.0)
    assert a0.sum() == 10 and h0.sum() == 10


def test_whiten_over_valid_tokens() -> None:
    x = torch.tensor([[1.0, 3.0, 50.0]])
    w = whiten(x, torch.tensor([[1, 1, 0]]))
    assert w.tolist()[0] == pytest.approx([-(2**-0.5), 2**-0.5, 0.0], rel=1e-6)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    b, length = 8, 16
    ids = torch.randint(4, 40, (b, length), generator=g)
    attn = torch.ones(b, length, dtype=torch.long)
    attn[0, 12:] = 0
    mask = torch.zeros(b, length - 1)
    mask[:, 5:] = 1
    mask[0, 11:] = 0
    return {"input_ids": ids, "attention_mask": attn, "mask": mask,
            "rewards": torch.tensor([1.0, 0, 1, 0, 1, 1, 0, 0]), "groups": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])}


def test_minicritics_step_masks_advantages_and_critic_loss_falls(batch: dict[str, torch.Tensor]) -> None:
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    cfg = AlgorithmConfig(loss="asyppo", asyppo=AsyPPOOptions(lr=3e-3, hidden=32))
    critics = MiniCritics(40, cfg, seed=0)
    assert torch.rand(3).tolist() == before.tolist()  # building the critics leaves the global RNG alone
    m = batch["mask"].bool()
    n = int(m.sum())
    out = critics.advantages_and_masks(batch["input_ids"], batch["attention_mask"], batch["mask"], batch["rewards"])
    assert out.advantages.shape == batch["mask"].shape
    assert bool((out.sigma[m] > 0).all())  # differently seeded critics disagree from the start
    # exactly floor(0.2 n) valid tokens lose their advantage, and they are the lowest-sigma ones
    zeroed = m & (out.advantages == 0)
    assert int(zeroed.sum()) == int(0.2 * n + 1e-9)
    assert out.sigma[zeroed].max() <= out.sigma[m & ~zeroed].min()
    assert out.advantages[~m].abs().sum() == 0
    assert out.metrics["critic/ent_masked_frac"] == pytest.approx(int(0.2 * n + 1e-9) / n)
    # reward sits at the last valid token: returns there equal the reward (gamma = 1)
    assert out.returns[0, 10].item() == pytest.approx(1.0) and out.returns[1, 14].item() == pytest.approx(0.0)

    first = critics.update(batch["input_ids"], batch["attention_mask"], batch["mask"], out.returns, batch["groups"])
    for _ in range(25):
        last = critics.update(batch["input_ids"], batch["attention_mask"], batch["mask"], out.returns, batch["groups"])
    assert last["critic/loss"] < 0.2 * first["critic/loss"], (first, last)

    # the targets plug straight into the policy loss
    logp = torch.full(batch["mask"].shape, -1.0, requires_grad=True)
    ent = torch.ones(batch["mask"].shape)
    loss, metrics = compute_policy_loss(AlgorithmConfig(loss="asyppo", entropy_coef=0.1), logp=logp,
                                        prox_logp=logp.detach(), behav_logp=logp.detach(),
                                        advantages=out.advantages, mask=batch["mask"], rewards=batch["rewards"],
                                        entropy=ent, entropy_mask=out.entropy_mask)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[zeroed].abs().sum() == 0  # I^A = 0: no policy gradient on agreed tokens
    assert metrics["loss/entropy"] == pytest.approx(1.0 - int(0.2 * n + 1e-9) / n, rel=1e-5)


def test_critic_hidden_must_fit_heads() -> None:
    with pytest.raises(ValueError, match="asyppo.hidden=30 must be a multiple of 4"):
        MiniCritics(10, AlgorithmConfig(asyppo=AsyPPOOptions(hidden=30)))
