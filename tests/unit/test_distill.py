"""On-policy distillation on fakes: the config's rules, the teachers' scoring and failures, the rollout's hook,
the trainer's advantages and its refusal of unscored samples, the step metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flashrl.config import Config, ConfigError, from_dict
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.ledger import teacher_stats
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.distill.client import TeacherFailed, Teachers, fill
from flashrl.distill.config import DistillConfig, TeacherConfig
from flashrl.distill.engines import check_scored
from flashrl.distill.fake import FakeTeacherEngines
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeSuite, FakeTokenizer
from flashrl.trainer.advantages import distill_advantages, distill_step
from flashrl.trainer.batch import pad_batch
from flashrl.wire.protocol import Scored
from flashrl.wire.trajectory import Trajectory

TOK = FakeTokenizer()
TEACHER = {"name": "exact", "model": "builtin:teacher"}


def cfg_with(distill: dict[str, Any], **sections: Any) -> Config:
    data = {"rollout": {"temperature": 1.0}, "distill": distill, **sections}
    return from_dict(data, "test.toml")


# --------------------------------------------------------------------------- config
def test_a_config_with_teachers_loads_and_says_which_teacher_a_task_gets() -> None:
    cfg = cfg_with({"teachers": [TEACHER, {"name": "b", "model": "/x"}], "mode": "kl"})
    dc = cfg.distill
    assert dc.on and dc.mode == "kl"
    assert dc.teacher_of({}) == "exact" and dc.teacher_of({"teacher": "b"}) == "b"
    assert not from_dict({}, "t").distill.on


@pytest.mark.parametrize("distill, extra, words", [
    ({"mode": "kl"}, {}, "distill.teachers is empty"),
    ({"teachers": [TEACHER, TEACHER]}, {}, "more than one teacher"),
    ({"teachers": [{"name": "t"}]}, {}, "distill.teachers[0].model: empty"),
    ({"teachers": [TEACHER]}, {"rollout": {"temperature": 0.7}}, "set rollout.temperature = 1.0"),
    ({"teachers": [TEACHER]}, {"rollout": {"temperature": 1.0, "top_p": 0.9}}, "rollout.top_p = 0.9"),
    ({"teachers": [TEACHER]}, {"model": {"path": "/m"}}, "speaks the built-in model's tokenizer"),
    ({"teachers": [TEACHER], "mode": "kl"}, {"algorithm": {"credit": "waad"}}, "distill.mode = \"kl\" has none"),
    ({"teachers": [TEACHER], "kl_weight": 0}, {}, "distill.kl_weight"),
    ({"teachers": [TEACHER], "mode": "kl"}, {"judge": {"model": "builtin:judge"}}, "trains on the teacher's signal alone"),
    ({"teachers": [TEACHER], "forward_kl_coef": 1.0}, {}, "has top_k = 0"),
])
def test_a_config_that_makes_no_sense_is_refused_naming_the_key(distill: dict[str, Any], extra: dict[str, Any],
                                                              words: str) -> None:
    data = {"rollout": {"temperature": 1.0}, "distill": distill}
    data.update(extra)
    with pytest.raises(ConfigError) as e:
        from_dict(data, "test.toml")
    assert words in str(e.value)


# --------------------------------------------------------------------------- scoring
def traj(prompt: list[int], response: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(group=0, prompt_ids=prompt, response_ids=response, loss_mask=mask,
                      behav_logp=[-0.5 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
                      task_id="t0")


def teachers(*pools: tuple[str, FakeTeacherEngines], retries: int = 2) -> Teachers:
    dc = DistillConfig(teachers=[TeacherConfig(name=n, model="x", retries=retries) for n, _ in pools])
    return Teachers(dc, dict(pools))


def position_scores(ids: list[int], start: int) -> list[float]:
    return [-0.01 * j for j in range(start, len(ids))]


def test_a_sample_is_scored_whole_and_observation_tokens_get_nothing() -> None:
    fake = FakeTeacherEngines(position_scores)
    t = traj([1, 2, 3], [4, 5, 6, 7, 8], [1, 1, 0, 0, 1])
    ts = teachers(("exact", fake))
    run_virtual(lambda: ts.score(t, {}))
    assert fake.requests == [([1, 2, 3, 4, 5, 6, 7, 8], 3)]  # prompt + response, scored from the response on
    assert t.teacher_logp == [-0.03, -0.04, 0.0, 0.0, -0.07]
    assert t.teacher == "exact" and t.teacher_top == []
    assert ts.counters["teacher_scored"] == 1 and ts.counters["teacher_tokens"] == 3


def test_the_prompts_teacher_scores_it() -> None:
    a, b = FakeTeacherEngines(lambda ids, s: [-1.0] * (len(ids) - s)), FakeTeacherEngines(lambda ids, s: [-2.0] * (len(ids) - s))
    ts = teachers(("a", a), ("b", b))
    t1, t2 = traj([1], [2, 3], [1, 1]), traj([1], [2, 3], [1, 1])
    run_virtual(lambda: ts.score(t1, {"teacher": "b"}))
    run_virtual(lambda: ts.score(t2, {}))
    assert (t1.teacher, t1.teacher_logp) == ("b", [-2.0, -2.0])
    assert (t2.teacher, t2.teacher_logp) == ("a", [-1.0, -1.0])
    with pytest.raises(TeacherFailed) as e:
        run_virtual(lambda: ts.score(traj([1], [2], [1]), {"teacher": "nobody"}))
    assert e.value.reason == "unknown" and ts.counters["teacher_unknown"] == 1


def test_engine_failures_are_retried_and_counted_apart_then_the_sample_fails() -> None:
    fake = FakeTeacherEngines(position_scores, fail=["engine_died", "garbage"])
    ts = teachers(("exact", fake), retries=2)
    t = traj([1, 2], [3, 4], [1, 1])
    run_virtual(lambda: ts.score(t, {}))
    assert t.teacher_logp == [-0.02, -0.03]
    c = ts.counters
    assert c["teacher_retries"] == 2 and c["teacher_engine_engine_died"] == 1 and c["teacher_garbage"] == 1
    assert c["teacher_exact_engine_died"] == 1

    fake = FakeTeacherEngines(position_scores, fail=["engine_timeout"] * 3)
    ts = teachers(("exact", fake), retries=2)
    t = traj([1, 2], [3, 4], [1, 1])
    with pytest.raises(TeacherFailed) as e:
        run_virtual(lambda: ts.score(t, {}))
    assert e.value.reason == "engine_timeout" and t.teacher_logp == []  # nothing stands in for the missing scores
    assert ts.counters["teacher_failed"] == 1 and ts.counters["teacher_retries"] == 2


def test_a_refused_sequence_is_not_retried() -> None:
    fake = FakeTeacherEngines(position_scores, fail=["refused"])
    ts = teachers(("exact", fake), retries=5)
    with pytest.raises(TeacherFailed) as e:
        run_virtual(lambda: ts.score(traj([1], [2], [1]), {}))
    assert e.value.reason == "refused" and len(fake.requests) == 1 and ts.counters["teacher_refused"] == 1


@pytest.mark.parametrize("logprobs, top, k, words", [
    ([-0.1, -0.2], [], 0, ""),
    ([-0.1], [], 0, "1 log-probabilities for 2 tokens"),
    ([-0.1, math.nan], [], 0, "nan"),
    ([-0.1, 0.5], [], 0, "0.5"),
    ([-0.1, -math.inf], [], 0, "-inf"),
    ([-0.1, -0.2], [[(1, -0.1)], [(2, -0.2), (3, -1.0)]], 2, "top-2 lists"),
])
def test_garbage_answers_are_told_apart(logprobs: list[float], top: Any, k: int, words: str) -> None:
    problem = check_scored(Scored(logprobs=logprobs, top_logprobs=top), 2, k)
    assert (problem == "") == (words == "") and words in problem


def test_fill_keeps_top_lists_on_generated_tokens_only() -> None:
    t = traj([1], [2, 3], [1, 0])
    fill(t, Scored(logprobs=[-0.1, -0.2], top_logprobs=[[(2, -0.1)], [(9, -0.3)]]), "x")
    assert t.teacher_logp == [-0.1, 0.0] and t.teacher_top == [[(2, -0.1)], []]


# --------------------------------------------------------------------------- the rollout's hook
def rollout_ctx(cfg: Config, tch: Teachers | None) -> RolloutContext:
    eng = FakeEngine("e0", lambda req, v: (TOK.encode("3"), 1.0))
    return RolloutContext(cfg=cfg, tokenizer=TOK, suite=FakeSuite(), engines=[eng], router=Router(1, 8),
                          version=lambda: 0, teachers=tch)


def one(ctx: RolloutContext, group: int) -> Trajectory:
    task = ctx.suite.train_tasks()[3]
    spec = RolloutSpec(task=task, group=group, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    return run_virtual(lambda: run_sample(ctx, spec, 0)).result


def test_training_rollouts_are_scored_evals_are_not_and_a_failed_scoring_fails_the_sample() -> None:
    cfg = msgspec.convert({"model": {"max_model_len": 64}}, Config)
    fake = FakeTeacherEngines(position_scores)
    t = one(rollout_ctx(cfg, teachers(("exact", fake))), group=0)
    assert t.status == "ok" and len(t.teacher_logp) == len(t.response_ids) > 0 and t.teacher == "exact"
    t = one(rollout_ctx(cfg, teachers(("exact", fake))), group=-1)  # an eval: the verifier measures, no teacher
    assert t.status == "ok" and t.teacher_logp == []
    ctx = rollout_ctx(cfg, teachers(("exact", FakeTeacherEngines(position_scores, fail=["engine_died"] * 2)), retries=1))
    t = one(ctx, group=0)
    assert (t.status, t.failure) == ("failed", "teacher_engine_died") and t.teacher_logp == []
    assert ctx.counters["rollout/failed_teacher_engine_died"] == 1


# --------------------------------------------------------------------------- the trainer's side
def test_advantages_add_the_reverse_kl_per_token_or_stand_alone() -> None:
    adv = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    behav = torch.tensor([[0.0, -0.5, -2.0, 0.0]])
    teach = torch.tensor([[0.0, -0.1, -0.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    both = distill_advantages(adv, behav, teach, mask, kl_weight=2.0, with_reward=True)
    alone = distill_advantages(adv, behav, teach, mask, kl_weight=2.0, with_reward=False)
    assert torch.allclose(both, torch.tensor([[0.0, 1.0 - 2 * -0.4, 1.0 - 2 * -1.5, 0.0]]))
    assert torch.allclose(alone, torch.tensor([[0.0, 0.8, 3.0, 0.0]]))


def test_the_batch_aligns_teacher_scores_with_behaviour_logprobs() -> None:
    a = traj([1, 2], [3, 4, 5], [1, 0, 1])
    a.teacher_logp = [-0.1, 0.0, -0.3]
    b = traj([1], [2], [1])
    batch = pad_batch([a, b], pad_id=0)
    assert batch.scored.tolist() == [True, False]
    # response token k sits at aligned index P - 1 + k (trainer/batch.py), like behav_logp
    assert batch.teacher_logp[0].tolist() == pytest.approx([0.0, -0.1, 0.0, -0.3])
    assert batch.behav_logp[0].tolist() == pytest.approx([0.0, -0.5, 0.0, -0.5])


def _trainer(model_path: Path, mode: str, **algorithm: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from flashrl.trainer.step import PolicyTrainer

    cfg = from_dict({"trainer": {"lr": 1e-3, "threads": 1, "warmup_steps": 0}, "algorithm": {"loss": "ppo", **algorithm},
                     "rollout": {"temperature": 1.0}, "distill": {"teachers": [TEACHER], "mode": mode}}, "t")
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return PolicyTrainer(cfg, model, torch.device("cpu"))


def test_the_trainer_refuses_a_sample_without_its_teacher_scores(model_path: Path) -> None:
    from flashrl.trainer.batch import BatchError

    trainer = _trainer(model_path, "kl")
    a, b = traj([1, 2], [3, 4], [1, 1]), traj([1, 2], [3, 4], [1, 1])
    a.teacher_logp = [-0.1, -0.2]
    batch = pad_batch([a, b], pad_id=0)
    with pytest.raises(BatchError, match="1 of 2 samples carry no teacher scores"):
        distill_step(batch, torch.zeros_like(batch.behav_logp), trainer.cfg.distill, {})
    b.teacher_logp = [-0.3, -0.4]
    extra: dict[str, float] = {}
    out = distill_step(pad_batch([a, b], pad_id=0), torch.zeros_like(batch.behav_logp), trainer.cfg.distill, extra)
    assert extra["distill/reverse_kl"] == pytest.approx(((-0.5 + 0.1) + (-0.5 + 0.2) + (-0.5 + 0.3) + (-0.5 + 0.4)) / 4)
    assert out[0, 1].item() == pytest.approx(0.4) and out[1, 2].item() == pytest.approx(0.1)


def test_pure_distillation_moves_the_student_toward_the_teacher_in_tied_groups(model_path: Path) -> None:
    """Every reward 0 (each group tied: GRPO has no signal, filter_ties would mask it all): the teacher likes GOOD's
    tokens (log-prob -0.1) and not BAD's (-8), so one step raises the student's log-probability of GOOD and lowers BAD's."""
    from flashrl.trainer.batch import token_logprobs
    from flashrl.wire.protocol import TrainBatch

    good, bad, prompt = [20, 21, 22, 2], [30, 31, 2], [1, 10, 11, 12]
    samples = []
    for g in range(2):
        for j, (resp, lp) in enumerate(((good, -0.1), (bad, -8.0), (good, -0.1), (bad, -8.0))):
            t = traj(prompt + [13 + g], resp, [1] * len(resp))
            t.behav_logp, t.teacher_logp = [-3.0] * len(resp), [lp] * len(resp)
            t.group, t.sample_id = g, f"{g}-{j}"
            samples.append(t)
    trainer = _trainer(model_path, "kl", filter_ties=True)  # DAPO's filter: on, and it must not mask the teacher's signal

    def mean_logp(resp: list[int]) -> float:
        b = pad_batch([traj(prompt + [13], resp, [1] * len(resp))], pad_id=0)
        with torch.no_grad():
            logits = trainer.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
            lp, _ = token_logprobs(logits, b.targets)
        return float((lp * b.loss_mask).sum() / b.loss_mask.sum())

    before = mean_logp(good), mean_logp(bad)
    result = trainer.train_step(TrainBatch(step=0, samples=samples))
    after = mean_logp(good), mean_logp(bad)
    assert after[0] > before[0] + 0.01 and after[1] < before[1] - 0.01, (before, after)
    assert result.metrics["distill/reverse_kl"] == pytest.approx((4 * (-3.0 + 0.1) + 3 * (-3.0 + 8.0)) / 7)  # per token


def test_step_metrics_of_the_scored_samples() -> None:
    a = traj([1], [2, 3, 4], [1, 0, 1])
    a.teacher_logp, a.teacher_s = [-0.1, 0.0, -0.3], 0.2
    b = traj([1], [2], [1])
    stats = teacher_stats([a, b])
    assert stats["teacher_scored"] == 1
    assert stats["teacher_latency_ms"] == pytest.approx(200.0)
    assert stats["teacher_reverse_kl"] == pytest.approx(((-0.5 + 0.1) + (-0.5 + 0.3)) / 2)
    assert teacher_stats([b]) == {}


# --------------------------------------------------------------------------- validate's vocabulary check
def test_a_teacher_with_another_vocabulary_is_refused_naming_both(tmp_path: Path) -> None:
    import json

    from flashrl.distill.build import TeacherModelError, teacher_folder, vocabulary_problem
    from flashrl.models.tiny import build_untrained
    from flashrl.models.tokenizer import CHARSET, build_char_tokenizer

    student, same = build_untrained(tmp_path / "student", seed=0), build_untrained(tmp_path / "same", seed=1)
    assert vocabulary_problem(student, same, "t") == ""  # other weights, the same tokenizer: fine
    other = build_untrained(tmp_path / "other", seed=1)
    build_char_tokenizer(CHARSET[::-1]).save_pretrained(str(other))  # the same characters, other ids
    problem = vocabulary_problem(student, other, "t")
    assert "distill.teachers[t]" in problem and str(other) in problem and str(student) in problem
    assert "tokens with other ids" in problem
    bigger = build_untrained(tmp_path / "bigger", seed=1)
    conf = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps(conf | {"vocab_size": conf["vocab_size"] + 8}))
    assert "vocab_size" in vocabulary_problem(student, bigger, "t")
    with pytest.raises(TeacherModelError, match="does not exist"):
        teacher_folder(from_dict({}, "t"), TeacherConfig(name="t", model=str(tmp_path / "nowhere")))
