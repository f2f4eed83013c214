"""GRPO advantages: exact numbers on hand-computed groups (docs/algorithms.md, "Advantages")."""

from __future__ import annotations

import pytest
import torch

from flashrl.trainer.advantages import (
    count_groups,
    group_stats,
    grpo_advantages,
    tied_groups,
    token_advantages,
)

# Groups interleaved and non-contiguous on purpose: 7 -> [0, 2, 4], 3 -> [5, 5], 9 -> [1], 4 -> [1, 0, 0, 1]
REWARDS = torch.tensor([0.0, 5.0, 2.0, 1.0, 5.0, 0.0, 4.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([7, 3, 7, 4, 3, 4, 7, 4, 4, 9])


def test_group_stats_mean_and_sample_std() -> None:
    mean, std, size = group_stats(REWARDS, GROUPS)
    assert mean.tolist() == [2.0, 5.0, 2.0, 0.5, 5.0, 0.5, 2.0, 0.5, 0.5, 1.0]
    # group 7: deviations -2, 0, 2 -> sum of squares 8 / (3 - 1) = 4 -> std 2 (Bessel, as TRL / veRL)
    assert std[0].item() == 2.0
    # group 4: four deviations of 0.5 -> 1.0 / 3
    assert std[3].item() == pytest.approx((1.0 / 3.0) ** 0.5, abs=1e-15)
    assert std[1].item() == 0.0 and std[9].item() == 0.0  # a tie and a group of one
    assert size.tolist() == [3, 2, 3, 4, 2, 4, 3, 4, 4, 1]


def test_grpo_scaled_values() -> None:
    adv = grpo_advantages(REWARDS.double(), GROUPS)
    # group 7: (r - 2) / (2 + 1e-6)
    assert adv[[0, 2, 6]].tolist() == pytest.approx([-2 / 2.000001, 0.0, 2 / 2.000001], abs=1e-15)
    s = (1.0 / 3.0) ** 0.5
    assert adv[[3, 5, 7, 8]].tolist() == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6),
                                                        -0.5 / (s + 1e-6), 0.5 / (s + 1e-6)], abs=1e-12)
    assert adv[[1, 4, 9]].tolist() == [0.0, 0.0, 0.0]  # no signal in a tie or a lone sample


def test_dr_grpo_no_std_division() -> None:
    adv = grpo_advantages(REWARDS, GROUPS, scale_std=False)
    assert adv.tolist() == [-2.0, 0.0, 0.0, 0.5, 0.0, -0.5, 2.0, -0.5, 0.5, 0.0]
    assert adv.dtype == torch.float32


def test_advantages_sum_to_zero_per_group() -> None:
    g = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(1))
    r = torch.rand(64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    adv = grpo_advantages(r, g)
    for k in g.unique():
        assert adv[g == k].sum().item() == pytest.approx(0.0, abs=1e-9)


def test_tied_groups_and_counts() -> None:
    tied = tied_groups(REWARDS, GROUPS)
    assert tied.tolist() == [False, True, False, False, True, False, False, False, False, True]
    assert count_groups(GROUPS) == 4
    assert count_groups(GROUPS, tied) == 2  # group 3 (5, 5) and group 9 (one sample)


def test_token_broadcast_respects_mask() -> None:
    adv = torch.tensor([1.5, -2.0])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    assert token_advantages(adv, mask).tolist() == [[0.0, 1.5, 1.5, 0.0], [-2.0, 0.0, -2.0, -2.0]]


def test_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="must be the same 1-D shape"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
