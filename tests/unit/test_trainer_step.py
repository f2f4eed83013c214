"""The training step over a plain module, in this process, with no torch.distributed at all.

``PolicyTrainer`` is the algorithm without the process shell (worker.py's ``Trainer`` adds FSDP,
collectives, checkpoints and the weight sync). These tests never call init_process_group.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from flashrl.config import Config, from_dict
from flashrl.trainer.batch import pad_batch, token_logprobs
from flashrl.trainer.step import PolicyTrainer
from flashrl.wire.protocol import TrainBatch
from flashrl.wire.trajectory import Trajectory

PROMPT = [1, 10, 11, 12]
GOOD = [20, 21, 22, 2]  # reward 1
BAD = [30, 31, 2]  # reward 0


def _cfg(**trainer: object) -> Config:
    return from_dict({
        "trainer": {"lr": 1e-3, "threads": 1, "warmup_steps": 0, **trainer},
        "algorithm": {"loss": "ppo"},
        "rollout": {"temperature": 0.7},
    })


def _model(path: Path) -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    m.train(False)
    return m


def _batch(step: int) -> TrainBatch:
    """3 groups of 4: two GOOD (reward 1), two BAD (reward 0) each, different prompts."""
    samples = []
    for g in range(3):
        prompt = PROMPT + [13 + g] * g
        for j, resp in enumerate((GOOD, BAD, GOOD, BAD)):
            n = len(resp)
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * n,
                                       behav_logp=[-3.0] * n, versions=[step] * n,
                                       reward=1.0 if resp is GOOD else 0.0, group=g, sample_id=f"{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


def test_plain_step_learns_without_a_process_group(model_path: Path) -> None:
    torch.manual_seed(0)
    t = PolicyTrainer(_cfg(), _model(model_path), torch.device("cpu"))
    good0, bad0 = sum(t.compute_logprobs(PROMPT, GOOD)), sum(t.compute_logprobs(PROMPT, BAD))
    losses = []
    for s in range(4):
        r = t.train_step(_batch(s))
        assert r is not None
        losses.append(r.metrics["loss/policy"])
    assert not dist.is_initialized()  # the step never needed one
    assert t.version == 4
    # GRPO advantages +1 / -1: the GOOD answer gains probability, the BAD one loses it
    assert sum(t.compute_logprobs(PROMPT, GOOD)) > good0 + 0.5
    assert sum(t.compute_logprobs(PROMPT, BAD)) < bad0 - 0.5
    m = r.metrics
    assert m["samples"] == 12 and m["tokens"] == 3 * (4 + 3 + 4 + 3)
    # every phase was timed, and the phases account for (almost) the whole step
    phases = {k: v for k, v in m.items() if k.startswith("time/trainer/")}
    assert {"time/trainer/batch_s", "time/trainer/forward_s", "time/trainer/backward_s",
            "time/trainer/optimizer_s", "time/trainer/metrics_s", "time/trainer/proximal_s"} <= set(phases)
    assert 0.5 * m["step_time_s"] <= sum(phases.values()) <= m["step_time_s"]


def test_gradient_matches_a_hand_computed_policy_gradient(model_path: Path) -> None:
    """One mini-batch, on-policy (ratio 1, no clipping): the PPO gradient is -sum_t A_t grad log pi(t) / N.

    Recomputed here from scratch with plain transformers + log_softmax on a copy of the same model and
    compared with what the step hands the optimizer (grad_clip 0: measured, not clipped)."""
    cfg = _cfg(grad_clip=0.0)
    t = PolicyTrainer(cfg, _model(model_path), torch.device("cpu"))
    ref = _model(model_path)
    seen: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in t.model.named_parameters()}

    def capture(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen[names[id(p)]] = p.grad.detach().clone()

    t.optimizer.register_step_pre_hook(capture)
    tb = _batch(0)
    r = t.train_step(tb)
    assert r is not None

    # the reference: GRPO advantages by hand (each group's rewards 1, 0, 1, 0: mean 0.5, sample std
    # sqrt(1/3) -> A = +-sqrt(3)/2), token-mean over the batch
    b = pad_batch(tb.samples, t.pad_id)
    a = 3 ** 0.5 / 2
    adv = torch.tensor([a if s.reward else -a for s in tb.samples]).unsqueeze(-1) * b.loss_mask
    out = ref(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
    logp, _ = token_logprobs(out.logits[:, :-1], b.targets, temperature=0.7)
    n = b.loss_mask.sum()
    (-(adv * logp * b.loss_mask).sum() / n).backward()  # the gradient of -sum A r / N at r = 1
    assert r.metrics["loss/policy"] == pytest.approx(float(-adv.sum() / n), abs=1e-6)  # the value: -sum A / N
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(seen) == set(grads)
    for n, g in grads.items():
        # float32 sums of the same terms in another order (the CPU's kernels decide: AVX2 and AVX-512 differ)
        # move an element by ~1e-6 of its tensor's largest one (seen: 1.1e-6 on an embedding gradient whose
        # largest element is 0.68); a wrong formula moves it by the order of the gradient itself
        torch.testing.assert_close(seen[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=n)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert r.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)


def test_first_mini_batch_needs_no_proximal_forward(model_path: Path) -> None:
    """Two mini-batches: one no-grad forward (mini-batch 2's proximal logprobs) besides the two training
    forwards; mini-batch 1 is on the step's starting weights, so its ratios are exactly 1."""
    t = PolicyTrainer(_cfg(mini_batches=2, share_prefix=False), _model(model_path), torch.device("cpu"))
    calls: list[bool] = []
    t.model.register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    r = t.train_step(_batch(0))
    assert r is not None
    assert calls == [False, True, True]  # proximal(mini 2), train(mini 1), train(mini 2)
    calls.clear()
    t.cfg.trainer.share_prefix = True  # each forward: the distinct prompts, then the continuations
    t.train_step(_batch(1))
    assert calls == [False, False, True, True, True, True]
    assert r.metrics["optimizer_steps"] == 2
    assert r.metrics["ratio/mean"] != 1.0  # mini-batch 2 moved away from its proximal policy


def test_shared_prefix_forward_matches_the_padded_forward(model_path: Path) -> None:
    """trainer.share_prefix: each distinct prompt forwarded once, the continuations against its keys and
    values. Same logprobs, entropies and gradients as forwarding every padded sequence whole, on a batch
    with prompts of different lengths, shuffled rows, an empty response and a masked observation token."""
    import random

    rng = random.Random(0)
    samples = []
    for g in range(5):
        prompt = [1] + [rng.randrange(3, 40) for _ in range(rng.randrange(2, 9))]
        for j in range(6):
            resp = [rng.randrange(3, 40) for _ in range(rng.randrange(0 if (g, j) == (2, 3) else 1, 7))]
            mask = [0 if (g, j, k) == (1, 2, 1) else 1 for k in range(len(resp))]  # an observation token
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                                       behav_logp=[-1.0] * len(resp), versions=[0] * len(resp), reward=0.0,
                                       group=g))
    rng.shuffle(samples)
    t = PolicyTrainer(_cfg(), _model(model_path), torch.device("cpu"))
    b = pad_batch(samples, t.pad_id)
    out = {}
    for share in (False, True):
        t.cfg.trainer.share_prefix = share
        t.model.zero_grad()
        logp, entropy = t.forward_logprobs(t.model, b)
        (logp * b.loss_mask * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        out[share] = (logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in t.model.named_parameters()})
    m = b.loss_mask > 0
    torch.testing.assert_close(out[True][0][m], out[False][0][m], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[True][1][m], out[False][1][m], rtol=1e-5, atol=1e-4)
    col = torch.arange(b.targets.shape[1])[None, :]
    response = (col >= b.prompt_lens[:, None] - 1) & (col < b.attention_mask.sum(-1)[:, None] - 1)
    assert torch.all(out[True][0][~response] == 0)  # nothing on prompt or padding positions
    obs = response & ~m  # the observation token: scored as in the padded forward (the loss masks it)
    torch.testing.assert_close(out[True][0][obs], out[False][0][obs], rtol=1e-5, atol=1e-4)
    for n, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][n], g, rtol=1e-3, atol=1e-5, msg=n)


def _tied_batch(step: int) -> TrainBatch:
    """4 groups of 4 over different prompts: groups 0 and 2 all GOOD (reward 1: tied), group 3 all BAD (tied),
    group 1 mixed (GOOD, BAD, GOOD, BAD): only group 1's samples have non-zero advantages."""
    samples = []
    for g, resps in enumerate([(GOOD,) * 4, (GOOD, BAD, GOOD, BAD), (GOOD,) * 4, (BAD,) * 4]):
        prompt = PROMPT + [13 + g] * g
        for j, resp in enumerate(resps):
            n = len(resp)
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * n,
                                       behav_logp=[-3.0] * n, versions=[step] * n,
                                       reward=1.0 if resp is GOOD else 0.0, group=g, sample_id=f"{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


@pytest.mark.parametrize("loss", ["decoupled_ppo", "cispo"])
def test_samples_with_zero_advantage_are_left_out_with_the_same_update(model_path: Path, loss: str) -> None:
    """trainer.skip_inert: a tied group's samples (every advantage 0) add exactly nothing to the loss or the
    gradient, so the step leaves them out of its forwards and backwards (the mini-batch divisors still count
    their tokens): the same gradient at every optimizer step of two steps of 2 mini-batches as training on every
    sample, from a quarter of the rows (the parameters then differ by Adam's amplified rounding only). With an entropy bonus they are not inert, and every sample is forwarded."""
    def run(skip: bool, entropy_coef: float = 0.0):
        # grad_clip 0: clipping would rescale both runs' gradients to the same norm and hide a wrong divisor
        cfg = _cfg(mini_batches=2, skip_inert=skip, grad_clip=0.0)
        cfg.algorithm.loss = loss
        cfg.algorithm.entropy_coef = entropy_coef
        t = PolicyTrainer(cfg, _model(model_path), torch.device("cpu"))
        rows: list[int] = []
        t.model.register_forward_pre_hook(lambda mod, args, kwargs: rows.append(int(kwargs["input_ids"].shape[0])),
                                          with_kwargs=True)
        grads: list[list[torch.Tensor]] = []  # what each optimizer step got
        t.optimizer.register_step_pre_hook(
            lambda opt, a, k: grads.append([p.grad.detach().clone() for g in opt.param_groups for p in g["params"]]))
        metrics = []
        for s in range(2):
            r = t.train_step(_tied_batch(s))
            assert r is not None
            metrics.append(r.metrics)
        return t, rows, metrics, grads

    full, rows_full, m_full, g_full = run(False)
    skip, rows_skip, m_skip, g_skip = run(True)
    assert len(g_full) == len(g_skip) == 4  # 2 steps x 2 mini-batches
    for a, b in zip(g_full, g_skip):
        # The same sums over fewer rows: float rounding only, whose size follows the gradient's scale (the
        # largest element of the step), not each tensor's own (an AVX2 CPU's blocking left 2.4e-8 in a tensor
        # whose largest element is below 1e-3). A wrong divisor scales whole gradients: far outside rtol.
        scale = max(max(float(ga.abs().max()) for ga in a), 1e-3)
        for ga, gb in zip(a, b):
            torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-5 * scale)
    for a, b in zip(m_full, m_skip):
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], abs=1e-6)
        assert b["samples"] == a["samples"] == 16 and b["groups/tied"] == a["groups/tied"] == 3
    # 16 samples, 4 of them with a gradient: group 1 sits in mini-batch 1, so mini-batch 2 (groups 2, 3: all
    # inert) forwards one masked row to keep the step's shape
    assert sum(rows_skip) < sum(rows_full) / 2, (rows_skip, rows_full)
    _, rows_ent, _, _ = run(True, entropy_coef=0.01)
    assert sum(rows_ent) == sum(rows_full)


def test_each_sample_reports_its_mean_behaviour_weight(model_path: Path) -> None:
    """TrainResult.sample_iw: per sample, mean over its generated tokens of pi_prox / pi_behav, with the
    engine's logprobs exactly the model's (1.0) or each token's 0.5 lower (e^0.5), in batch order, also
    across mini-batches (the proximal pass) and whatever filter_ties masks."""
    torch.manual_seed(0)
    t = PolicyTrainer(_cfg(mini_batches=2), _model(model_path), torch.device("cpu"))
    base = _batch(0)
    samples = []
    for k, s in enumerate(base.samples):
        own = t.compute_logprobs(s.prompt_ids, s.response_ids)  # the trainer's own (temperature 0.7) logprobs
        shift = 0.5 if k % 3 == 0 else 0.0
        samples.append(msgspec.structs.replace(s, behav_logp=[x - shift for x in own]))
    r = t.train_step(TrainBatch(step=0, samples=samples))
    assert r is not None and len(r.sample_iw) == len(samples)
    for k, w in enumerate(r.sample_iw):
        assert w == pytest.approx(math.exp(0.5) if k % 3 == 0 else 1.0, rel=1e-3), k
