"""Padding and alignment: which logits position predicts which response token (trainer/batch.py)."""

from __future__ import annotations

import pytest
import torch

from flashrl.trainer.batch import (
    BatchError,
    pad_batch,
    sampling_temperature,
    split_prefixes,
    to_aligned,
    token_logprobs,
)
from flashrl.wire.trajectory import Trajectory

PAD = 0


def _samples() -> list[Trajectory]:
    # A: prompt of 3, response of 4 whose third token is an environment observation (mask 0).
    a = Trajectory(prompt_ids=[11, 12, 13], response_ids=[21, 22, 23, 24], loss_mask=[1, 1, 0, 1],
                    behav_logp=[-0.1, -0.2, 0.0, -0.4], versions=[3, 3, -1, 4], reward=1.0, group=5)
    # B: prompt of 1, response of 2 (shorter: padded).
    b = Trajectory(prompt_ids=[31], response_ids=[41, 42], loss_mask=[1, 1], behav_logp=[-1.0, -2.0],
                    versions=[2, 2], reward=0.0, group=6)
    return [a, b]


def test_layout_exact() -> None:
    pb = pad_batch(_samples(), PAD)
    assert pb.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24], [31, 41, 42, PAD, PAD, PAD, PAD]]
    assert pb.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    # logits position j predicts input_ids[j + 1]
    assert pb.targets.tolist() == [[12, 13, 21, 22, 23, 24], [41, 42, PAD, PAD, PAD, PAD]]
    assert pb.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]]
    assert torch.equal(pb.behav_logp, torch.tensor([[0, 0, -0.1, -0.2, 0, -0.4], [-1.0, -2.0, 0, 0, 0, 0]]))
    assert pb.versions.tolist() == [[-1, -1, 3, 3, -1, 4], [2, 2, -1, -1, -1, -1]]
    assert pb.rewards.tolist() == [1.0, 0.0] and pb.groups.tolist() == [5, 6]
    assert pb.prompt_lens.tolist() == [3, 1]
    # every masked position's target is a response token the policy generated
    tgt = pb.targets[pb.loss_mask.bool()].tolist()
    assert tgt == [21, 22, 24, 41, 42]


def test_logprob_alignment_with_a_known_model() -> None:
    # "Model" whose logits at position j put all mass on input_ids[j] + 1: with targets = next tokens
    # the logprob is ~0 exactly where the next token is current + 1, and very negative elsewhere.
    s = Trajectory(prompt_ids=[5, 6], response_ids=[7, 9], loss_mask=[1, 1], behav_logp=[0.0, 0.0],
                    versions=[0, 0], reward=0.0, group=0)
    pb = pad_batch([s], PAD)
    logits = torch.full((1, pb.input_ids.shape[1], 16), -30.0)
    logits[0, torch.arange(pb.input_ids.shape[1]), (pb.input_ids[0] + 1) % 16] = 30.0
    logp, ent = token_logprobs(logits[:, :-1], pb.targets)
    assert logp.shape == pb.loss_mask.shape == ent.shape
    # response tokens: 7 follows 6 (predicted), 9 follows 7 (not predicted)
    resp = logp[pb.loss_mask.bool()]
    assert resp[0].item() == pytest.approx(0.0, abs=1e-6)
    assert resp[1].item() < -50


def test_logprobs_are_scored_at_the_sampling_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 16, generator=g) * 3
    targets = torch.randint(0, 16, (2, 5), generator=g)
    raw, raw_ent = token_logprobs(logits, targets)
    hot, hot_ent = token_logprobs(logits, targets, temperature=0.7)
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(hot, want, atol=1e-6)
    assert float((hot - raw).abs().max()) > 0.1  # the temperature changes what a ratio compares
    assert float(hot_ent.mean()) < float(raw_ent.mean())  # T < 1 sharpens the distribution
    # vLLM's rules: temperature 0 is greedy, scored untempered; (0, 0.01) is raised to 0.01
    assert sampling_temperature(0.0) == 1.0 and sampling_temperature(0.7) == 0.7
    assert sampling_temperature(0.001) == 0.01
    assert torch.equal(token_logprobs(logits, targets, temperature=0.0)[0], raw)


def test_select_trims_and_keeps_alignment() -> None:
    pb = pad_batch(_samples(), PAD)
    sub = pb.select([1])
    assert sub.input_ids.tolist() == [[31, 41, 42]]
    assert sub.targets.tolist() == [[41, 42]] and sub.loss_mask.tolist() == [[1, 1]]
    assert sub.advantages.shape == (1, 2)
    assert pb.select([1, 0]).input_ids.shape == (2, 7)


def test_errors_name_the_sample_and_field() -> None:
    bad = Trajectory(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1], behav_logp=[0.0, 0.0],
                      versions=[0, 0], reward=0.0, group=0, sample_id="s7")
    with pytest.raises(BatchError, match=r"sample 0 \(s7\): loss_mask has 1 entries but response_ids has 2"):
        pad_batch([bad], PAD)
    empty = Trajectory(prompt_ids=[], response_ids=[2], loss_mask=[1], behav_logp=[0.0], versions=[0],
                        reward=0.0, group=0)
    with pytest.raises(BatchError, match="prompt_ids is empty"):
        pad_batch([empty], PAD)
    with pytest.raises(BatchError, match="empty batch"):
        pad_batch([], PAD)


def _group(prompt: list[int], responses: list[list[int]], group: int) -> list[Trajectory]:
    return [Trajectory(prompt_ids=prompt, response_ids=r, loss_mask=[1] * len(r), behav_logp=[-1.0] * len(r),
                        versions=[0] * len(r), reward=0.0, group=group) for r in responses]


def test_split_prefixes_layout_exact() -> None:
    """Two groups (prompts of 2 and 1 tokens), rows interleaved: each prompt once, right-padded; each
    sample's continuation, its attention over [prompt | continuation] and its positions."""
    a = _group([11, 12], [[21, 22], [23]], group=7)
    b = _group([31], [[41, 42, 43], []], group=3)
    pb = pad_batch([a[0], b[0], a[1], b[1]], PAD)
    s = split_prefixes(pb, PAD)
    assert s is not None
    assert s.prefix_ids.tolist() == [[31, PAD], [11, 12]]  # groups in sorted order: 3, 7
    assert s.prefix_attention.tolist() == [[1, 0], [1, 1]]
    assert s.prefix_last.tolist() == [0, 1]
    assert s.row_prefix.tolist() == [1, 0, 1, 0]
    assert s.cont_ids.tolist() == [[21, 22, PAD], [41, 42, 43], [23, PAD, PAD], [PAD, PAD, PAD]]
    assert s.cont_attention.tolist() == [[1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert s.cont_positions.tolist() == [[2, 3, 4], [1, 2, 3], [2, 3, 4], [1, 2, 3]]
    # continuation token k lands where pad_batch put its target: column prompt_len - 1 + k
    vals = torch.arange(1, 13, dtype=torch.float32).reshape(4, 3)
    aligned = to_aligned(vals, s, pb.targets.shape[1])
    assert torch.equal(aligned != 0, pb.loss_mask > 0)
    assert pb.targets[aligned != 0].tolist() == [21, 22, 41, 42, 43, 23]
    assert aligned[aligned != 0].tolist() == [1, 2, 4, 5, 6, 7]


def test_split_prefixes_declines_when_it_cannot_or_need_not_share() -> None:
    one_each = _group([11, 12], [[21]], 0) + _group([13], [[22]], 1)
    assert split_prefixes(pad_batch(one_each, PAD), PAD) is None  # one sample per prompt: nothing to share
    mixed = _group([11, 12], [[21], [22]], 0) + _group([11, 13], [[23]], 0)  # one group id, two prompts
    assert split_prefixes(pad_batch(mixed, PAD), PAD) is None
    assert split_prefixes(pad_batch(_group([11, 12], [[21], [22]], 0), PAD), PAD) is not None
