"""Every policy loss, AsyPPO mini-critics and attention-rhythm credit through the real trainer.

In-process tests run the real ``Trainer`` (FSDP2 on a world-1 gloo group in this process) on the
built-in tiny model. The slow test starts real rank processes (2 ranks against 1) with critics and
credit on, to check the round-robin credit forward and the critic replicas agree with one rank.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from flashrl.config import AlgorithmConfig
from flashrl.launch.processes import spawn_local_trainer
from flashrl.trainer.advantages import grpo_advantages, token_advantages
from flashrl.trainer.batch import pad_batch
from flashrl.trainer.critics import MiniCritics
from flashrl.trainer.rhythm import credit_scale
from flashrl.trainer.worker import Trainer
from flashrl.wire.protocol import TrainBatch
from flashrl.wire.trajectory import Trajectory
from tests.helpers import full_weights, trainer_config

LOSSES = typing.get_args(typing.get_args(typing.get_type_hints(AlgorithmConfig, include_extras=True)["loss"])[0])
CPU = torch.device("cpu")


def _batch(step: int = 0, groups: int = 4, extra: bool = False) -> TrainBatch:
    """``groups`` groups of 2: a 20-token response (reward 1) and a 15-token one (reward 0), so that
    40% of each response is a whole number of tokens (8 and 6). ``extra``: one more lone sample."""
    gen = torch.Generator().manual_seed(7)
    samples = []
    for g in range(groups + int(extra)):
        prompt = [1] + torch.randint(3, 90, (4 + g % 3,), generator=gen).tolist()
        for j, n in enumerate((20, 15) if g < groups else (10,)):
            resp = torch.randint(3, 90, (n,), generator=gen).tolist()
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * n,
                                       behav_logp=[-4.0] * n, versions=[step] * n, reward=1.0 - j,
                                       group=g, sample_id=f"{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_a_step(world1, model_path: Path, tmp_path: Path, loss: str) -> None:
    t = Trainer(trainer_config(tmp_path, {"loss": loss}), str(model_path), CPU)
    before = full_weights(t)
    m = t.train_step(_batch()).metrics  # type: ignore[union-attr]
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    assert m["loss/policy"] != 0.0 and m["grad_norm"] > 0
    assert _changed(before, full_weights(t)) > 1e-5
    assert m["tokens"] == 4 * 35 and t.version == 1
    assert ("critic/loss" in m) == (loss == "asyppo")
    assert "credit/amplified_frac" not in m  # credit = none: no amplification at all


# ---------------------------------------------------------------------- AsyPPO
def test_asyppo_uses_the_critics_advantages_and_masks(world1, model_path: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, {"loss": "asyppo"})
    t = Trainer(cfg, str(model_path), CPU)
    tb = _batch()
    # an independent replica (same seed as run.seed) on the same padded batch
    full = pad_batch(tb.samples, t.pad_id)
    replica = MiniCritics(int(t.model.config.vocab_size), cfg.algorithm, seed=cfg.run.seed)
    want = replica.advantages_and_masks(full.input_ids, full.attention_mask, full.loss_mask, full.rewards)
    m = t.train_step(tb).metrics  # type: ignore[union-attr]
    n = 4 * 35
    assert m["critic/adv_masked_frac"] == pytest.approx(int(0.2 * n) / n)  # 28 of 140 tokens
    assert m["critic/ent_masked_frac"] == pytest.approx(int(0.2 * n) / n)
    assert m["critic/sigma_mean"] > 0 and m["critic/loss"] > 0
    zeroed = (full.loss_mask > 0) & (want.advantages == 0)
    assert int(zeroed.sum()) == int(0.2 * n)
    # one mini-batch: ratio == 1, so the PPO token loss is exactly -A: the loss saw the critic advantages
    assert m["ratio/mean"] == 1.0
    assert m["loss/policy"] == pytest.approx(-float(want.advantages.sum()) / n, abs=1e-6)
    assert m["advantage/mean"] == pytest.approx(float(want.advantages.sum()) / n, abs=1e-6)


def test_asyppo_masks_reach_the_loss(world1, model_path: Path, tmp_path: Path) -> None:
    """I^A = 0 and I^H = 0 on every token: no policy gradient and no entropy bonus, weights unchanged."""
    alg = {"loss": "asyppo", "asyppo": {"k_adv": 1.0, "k_ent": 1.0}, "entropy_coef": 0.05}
    t = Trainer(trainer_config(tmp_path, alg), str(model_path), CPU)
    before = full_weights(t)
    m = t.train_step(_batch()).metrics  # type: ignore[union-attr]
    assert m["critic/adv_masked_frac"] == 1.0 and m["critic/ent_masked_frac"] == 1.0
    assert m["loss/policy"] == 0.0 and m["loss/entropy"] == 0.0 and m["entropy/mean"] > 1.0
    assert m["grad_norm"] == 0.0 and _changed(before, full_weights(t)) == 0.0
    # the same with the entropy bonus kept: the bonus is there and moves the weights
    t2 = Trainer(trainer_config(tmp_path, alg | {"asyppo": {"k_adv": 1.0, "k_ent": 0.0}}), str(model_path), CPU)
    m2 = t2.train_step(_batch()).metrics  # type: ignore[union-attr]
    assert m2["loss/entropy"] == pytest.approx(m2["entropy/mean"], rel=1e-5)
    assert _changed(before, full_weights(t2)) > 1e-5


def test_asyppo_critic_loss_falls_and_critics_survive_a_checkpoint(world1, model_path: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, {"loss": "asyppo", "asyppo": {"lr": 3e-3, "updates": 4}})
    t = Trainer(cfg, str(model_path), CPU)
    losses = [t.train_step(_batch(s)).metrics["critic/loss"] for s in range(4)]  # type: ignore[union-attr]
    assert losses[-1] < 0.5 * losses[0], losses
    assert t.critics is not None
    t.save_checkpoint(str(tmp_path / "ckpt"))
    fresh = Trainer(cfg, str(model_path), CPU)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.critics is not None
    ids = pad_batch(_batch().samples, t.pad_id)
    with torch.no_grad():
        v1 = t.critics.values(ids.input_ids, ids.attention_mask)
        v2 = fresh.critics.values(ids.input_ids, ids.attention_mask)
    assert torch.equal(v1, v2)
    # critic optimizer state came back too: the next step is the same step
    a, b = t.train_step(_batch(4)).metrics, fresh.train_step(_batch(4)).metrics  # type: ignore[union-attr]
    assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-6)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)


# ---------------------------------------------------------------------- attention-rhythm credit
def _plain_model(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)


@pytest.mark.parametrize("credit", ["waad", "fai", "rhythm"])
def test_credit_amplifies_40_percent_and_reaches_the_loss(world1, model_path: Path, tmp_path: Path,
                                                          credit: str) -> None:
    # micro_batch 3: the credit forward runs in chunks of 3 (3 + 3 + 2 samples)
    cfg = trainer_config(tmp_path, {"credit": credit}, micro_batch=3)
    t = Trainer(cfg, str(model_path), CPU)
    tb = _batch()
    before = full_weights(t)
    m = t.train_step(tb).metrics  # type: ignore[union-attr]
    n = 4 * 35
    if credit == "rhythm":
        # T_glob (40%) keeps a bonus; with coupling a = 0.5 part of a dominated anchor's bonus moves to
        # its introducing token, which may sit outside T_glob
        assert 0.4 <= m["credit/amplified_frac"] <= 0.6
    else:
        assert m["credit/amplified_frac"] == pytest.approx(0.4)  # 8 of 20 and 6 of 15 per sample
        assert m["credit/gamma_mean"] == pytest.approx(1 + 0.5 * 0.4)
    # the same gamma from plain transformers (sdpa model, no FSDP, whole batch at once) scales the
    # advantages the loss saw: ratio == 1, so loss/policy = -mean(gamma * A)
    full = pad_batch(tb.samples, t.pad_id)
    adv = token_advantages(grpo_advantages(full.rewards, full.groups), full.loss_mask)
    gamma = credit_scale(_plain_model(model_path), full.input_ids, full.attention_mask, full.loss_mask,
                         cfg.algorithm)
    assert float(((gamma > 1) & (full.loss_mask > 0)).sum()) / n == pytest.approx(m["credit/amplified_frac"])
    assert m["loss/policy"] == pytest.approx(-float((gamma * adv).sum()) / n, abs=1e-6)
    assert abs(float((gamma * adv).sum()) - float(adv.sum())) > 1e-3  # credit changed the loss
    assert _changed(before, full_weights(t)) > 1e-5
    # the policy is back on its own attention implementation after the eager forward
    assert t.model.config._attn_implementation == "sdpa"


def test_credit_positive_only_leaves_negative_advantages_alone(world1, model_path: Path, tmp_path: Path) -> None:
    t = Trainer(trainer_config(tmp_path, {"credit": "waad", "rhythm": {"positive_only": True}}), str(model_path), CPU)
    m = t.train_step(_batch()).metrics  # type: ignore[union-attr]
    # the 20-token responses have A > 0, the 15-token ones A < 0: only 8 of every 35 tokens
    assert m["credit/amplified_frac"] == pytest.approx(8 / 35)


def test_asyppo_with_credit_scales_the_critic_advantages(world1, model_path: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, {"loss": "asyppo", "credit": "fai"})
    t = Trainer(cfg, str(model_path), CPU)
    tb = _batch()
    full = pad_batch(tb.samples, t.pad_id)
    replica = MiniCritics(int(t.model.config.vocab_size), cfg.algorithm, seed=cfg.run.seed)
    want = replica.advantages_and_masks(full.input_ids, full.attention_mask, full.loss_mask, full.rewards)
    gamma = credit_scale(_plain_model(model_path), full.input_ids, full.attention_mask, full.loss_mask,
                         cfg.algorithm)
    m = t.train_step(tb).metrics  # type: ignore[union-attr]
    n = 4 * 35
    assert m["credit/amplified_frac"] == pytest.approx(0.4) and "critic/loss" in m
    assert m["loss/policy"] == pytest.approx(-float((gamma * want.advantages).sum()) / n, abs=1e-6)


# ---------------------------------------------------------------------- real rank processes
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_two_ranks_with_critics_and_credit_match_one_rank(model_path: Path, tmp_path: Path) -> None:
    results = {}
    for ranks in (2, 1):
        # 9 samples, micro_batch 2: rank 0 forwards 5 rows in 3 chunks, rank 1 4 rows + 1 discarded chunk
        cfg = trainer_config(tmp_path, {"loss": "asyppo", "credit": "rhythm"}, ranks=ranks, micro_batch=2)
        run_dir = tmp_path / f"r{ranks}"
        run_dir.mkdir()
        g = await spawn_local_trainer(cfg, model_path, run_dir)
        try:
            await g.wait_ready(120)
            metrics = [(await g.train_step(_batch(s, extra=True))).metrics for s in range(2)]
            lp = await g.compute_logprobs([1, 5, 6], list(range(10, 30)))
            results[ranks] = (metrics, lp)
            await g.close()
            assert [p.returncode for p in g.procs] == [0] * ranks
        finally:
            await g.close()
    (m2, lp2), (m1, lp1) = results[2], results[1]
    for x, y in zip(m2, m1):
        for k in ("credit/amplified_frac", "credit/gamma_mean", "critic/adv_masked_frac", "tokens"):
            assert x[k] == y[k], k
        for k in ("loss", "critic/loss", "critic/sigma_mean", "advantage/mean"):
            assert x[k] == pytest.approx(y[k], abs=1e-5), k
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
        assert 0.4 <= x["credit/amplified_frac"] <= 0.6
    assert lp2 == pytest.approx(lp1, abs=1e-5)
