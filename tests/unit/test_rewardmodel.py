"""flashrl/rewardmodel: the batching client, the combiner and the suite wrapper, on the in-process FakeScorer
(the worker processes are tests/integration/test_rewardmodel_process.py's)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from envs.arithmetic import ArithmeticSuite
from flashrl.config import ConfigError, RewardModelConfig, from_dict
from flashrl.env import EnvFailure
from flashrl.rewardmodel.build import RewardModelError, check_folder, perturbations
from flashrl.rewardmodel.client import RewardModelClient
from flashrl.rewardmodel.fake import FakeScorer
from flashrl.rewardmodel.suite import Combiner, RewardModelSuite, RunningStats
from flashrl.rewards import RewardFailed


def _right(text: str) -> float:
    """A perfect reward model of "a+b=c": +4 when c is the sum, -4 otherwise."""
    q, _, a = text.partition("=")
    x, _, y = q.partition("+")
    try:
        return 4.0 if int(a) == int(x) + int(y) else -4.0
    except ValueError:
        return -4.0


async def test_concurrent_scores_go_in_batches() -> None:
    fake = FakeScorer(_right)
    client = RewardModelClient(fake, max_batch=4, batch_wait_s=0.01)
    got = await asyncio.gather(*(client.score(f"1+{i}={1 + i}") for i in range(10)))
    assert got == [4.0] * 10
    assert [len(b) for b in fake.batches] == [4, 4, 2]
    assert client.counters["rm_batches"] == 3 and client.counters["rm_scored"] == 10
    await client.aclose()
    assert fake.closed


async def test_failed_batches_are_retried_and_counted_apart() -> None:
    fake = FakeScorer(_right, fail=["crash", "garbage", "timeout"])
    client = RewardModelClient(fake, max_batch=8, batch_wait_s=0.0, retries=3)
    assert await asyncio.gather(client.score("2+2=4"), client.score("2+2=5")) == [4.0, -4.0]
    c = client.counters
    assert (c["rm_crash"], c["rm_garbage"], c["rm_timeout"], c["rm_retries"]) == (1, 1, 1, 3)
    assert c.get("rm_failed", 0) == 0
    await client.aclose()


async def test_past_its_retries_a_batch_fails_loudly_never_with_a_score() -> None:
    fake = FakeScorer(_right, fail=["crash"] * 3)
    client = RewardModelClient(fake, max_batch=8, batch_wait_s=0.0, retries=2)
    with pytest.raises(RewardFailed) as e:
        await client.score("2+2=4")
    assert e.value.reason == "rm_crash"
    assert client.counters["rm_failed"] == 1 and client.counters["rm_retries"] == 2
    await client.aclose()


def test_combiner_sum_gate_and_normalization() -> None:
    s = Combiner(RewardModelConfig(model="x", model_weight=2.0, verifier_weight=0.5, transform="raw"))
    assert s.combine(s.model_reward(1.5, True), 1.0) == 3.5
    g = Combiner(RewardModelConfig(model="x", combine="gate", gate_reward=-1.0))
    assert g.combine(0.7, 1.0) == 0.7 and g.combine(0.7, 0.0) == -1.0
    assert Combiner(RewardModelConfig(model="x")).model_reward(0.0, True) == 0.5  # sigmoid
    n = Combiner(RewardModelConfig(model="x", transform="raw", normalize=True))
    for x in (1.0, 3.0):
        n.model_reward(x, True)
    assert n.model_reward(5.0, False) == pytest.approx((5.0 - 2.0) / 1.0)  # held-out: scored, not counted
    assert n.stats.n == 2
    rs = RunningStats()
    for x in (1.0, 2.0, 4.0):
        rs.add(x)
    assert rs.std == pytest.approx(math.sqrt(14 / 9))


async def test_suite_trains_on_the_model_and_keeps_the_verifier_as_truth() -> None:
    inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
    fake = FakeScorer(lambda text: 3.0)  # a reward model that likes everything: the gap must show it
    suite = RewardModelSuite(inner, RewardModelClient(fake, batch_wait_s=0.0), RewardModelConfig(model="x"))
    task = inner.train_tasks()[0]
    env = suite.make_env()
    prompt = await env.reset(task)
    res = await env.step("0<eos>" if task.answer != "0" else "1<eos>")
    assert fake.batches == [[prompt + ("0" if task.answer != "0" else "1")]]  # the eos mark cut, like the verifier
    assert res.reward == pytest.approx(1 / (1 + math.exp(-3.0)))
    assert res.info["correct"] is False  # the verifier's, not the reward model's
    m = res.info["metrics"]
    assert m["verifier"] == 0.0 and m["rm_agree"] == 0.0 and m["rm_gap"] == pytest.approx(res.reward)
    await suite.aclose()
    assert fake.closed


async def test_a_reward_model_outage_is_an_infrastructure_failure() -> None:
    inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
    fake = FakeScorer(_right, fail=["crash"] * 5)
    suite = RewardModelSuite(inner, RewardModelClient(fake, batch_wait_s=0.0, retries=1), RewardModelConfig(model="x"))
    env = suite.make_env()
    await env.reset(inner.train_tasks()[0])
    with pytest.raises(EnvFailure) as e:
        await env.step("12")
    assert e.value.reason == "rm_crash"  # the rollout is retried and counted as rollout/retry_env_rm_crash
    await suite.aclose()


def test_perturbations_hold_the_forgotten_carry() -> None:
    import random

    cands = perturbations("42", "17+25=", random.Random(0))
    assert "32" in cands and "43" in cands and "41" in cands


def test_the_answer_lm_term_scores_the_answer_characters_only(tmp_path) -> None:
    """builtin:rm's next-token term (what made the reward model read the units digit: bench/results/rm):
    the cross-entropy of the correct answer's characters only, through the tied embeddings, and its
    gradient reaches the body."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flashrl.rewardmodel.build import RmSpec, _answer_lm_loss, build_untrained_rm, encode_batch

    build_untrained_rm(tmp_path, RmSpec(layers=1, hidden=32, heads=2, intermediate=64), seed=0)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32)
    batch = [("12+34=", "46", "47"), ("5+5=", "10", "11")]
    inp, mask = encode_batch(tok, [p + a for p, a, _ in batch])
    hidden = model(input_ids=inp, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    loss = _answer_lm_loss(model, tok, hidden, inp, mask, batch)
    logits = hidden @ model.get_input_embeddings().weight.T
    want = []
    for i, (p, a, _) in enumerate(batch):
        start, n = len(tok.encode(p, add_special_tokens=False)), len(tok.encode(a, add_special_tokens=False))
        for j in range(start, start + n):  # each answer character, predicted from the position before it
            want.append(F.cross_entropy(logits[i, j - 1][None], inp[i, j][None]))
    assert len(want) == 4 and float(loss) == pytest.approx(float(torch.stack(want).mean()), rel=1e-5)
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None
    assert float(model.get_input_embeddings().weight.grad.abs().sum()) > 0


def test_check_folder_names_what_is_wrong(tmp_path) -> None:
    with pytest.raises(RewardModelError, match="does not exist"):
        check_folder(tmp_path / "nope")
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(RewardModelError, match="LlamaForCausalLM, not a sequence-classification model"):
        check_folder(tmp_path / "lm")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    with pytest.raises(RewardModelError, match="has 2 labels"):
        check_folder(tmp_path / "two")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                             "num_labels": 1}))
    assert check_folder(tmp_path / "ok") == tmp_path / "ok"


def test_reward_options_without_a_model_are_refused() -> None:
    with pytest.raises(ConfigError, match="reward: options of a reward model, but reward.model is empty"):
        from_dict({"reward": {"normalize": True}})


def test_the_gap_to_the_verifier_is_on_the_dashboard() -> None:
    import io

    from rich.console import Console

    from flashrl.dashboard import format_plain, render
    from flashrl.metrics import Snapshot

    s = Snapshot(step=3, total_steps=10, gap_history=[(1, 0.25), (2, 0.1), (3, -0.05)])
    assert "model-gap -0.05" in format_plain(s)
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(render(s))
    assert "model-verifier" in console.export_text()
    assert "model-gap" not in format_plain(Snapshot())


def test_validate_names_a_missing_or_incompatible_reward_model_or_judge_folder(tmp_path) -> None:
    from pathlib import Path

    from typer.testing import CliRunner

    from flashrl.cli import app

    root = Path(__file__).resolve().parents[2]
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    cls = tmp_path / "cls"
    cls.mkdir()
    (cls / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "LABEL_0"}}))
    cases = [
        ("rm.toml", f"reward.model={str(tmp_path / 'nope')!r}", "does not exist"),
        ("rm.toml", f"reward.model={str(lm)!r}", "is a LlamaForCausalLM, not a sequence-classification model"),
        ("judge.toml", f"judge.model={str(tmp_path / 'nope')!r}", "does not exist"),
        ("judge.toml", f"judge.model={str(cls)!r}", "a judge writes its verdict, so it must be a causal LM"),
    ]
    for config, override, message in cases:
        r = CliRunner().invoke(app, ["validate", str(root / "configs" / config), "--set", override.replace("'", '"')])
        assert r.exit_code == 2 and message in r.output, (override, r.output)
    r = CliRunner().invoke(app, ["validate", str(root / "configs" / "rm.toml"), "--set", f'reward.model="{cls}"'])
    assert r.exit_code == 0, r.output


class _ScoringSuite:
    """A suite with a judge's counters (flashrl.env.Counting), set by the test."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}


def _ledger(suite: object):
    from collections import Counter

    from flashrl.controller.ledger import Ledger

    return Ledger(from_dict({}), suite, None, Counter(), None)  # type: ignore[arg-type]


def test_scoring_latency_per_step_and_the_curves_across_a_resume() -> None:
    """The dashboard's scoring latency is the mean over the episodes scored since the step before (the judge's
    counter is a mean since its process started); the gap and latency curves survive a resume, and a
    resumed run's mean latency is its own, not the checkpoint's added to it."""
    import msgspec

    from flashrl.checkpoint import ControllerState

    suite = _ScoringSuite()
    led = _ledger(suite)
    assert led._step_latency_ms() is None  # nothing scores in this run
    suite.counters = {"judge_verdicts": 10, "judge_latency_ms": 100.0}
    assert led._step_latency_ms() == pytest.approx(100.0)
    suite.counters = {"judge_verdicts": 20, "judge_latency_ms": 150.0}  # the next 10 took 200 ms each
    assert led._step_latency_ms() == pytest.approx(200.0)
    assert led._step_latency_ms() is None  # none scored since

    state = ControllerState(step=2, version=2, elapsed_s=1.0, gap_history=[(1, 0.3), (2, 0.4)],
                            latency_history=[(1, 100.0), (2, 200.0)],
                            env_counters={"env/judge_verdicts": 20, "env/judge_latency_ms": 150.0, "env/judge_inflight": 3})
    back = msgspec.json.decode(msgspec.json.encode(state), type=ControllerState)
    old = msgspec.json.decode(msgspec.json.encode(state).replace(b'"gap_history"', b'"x"')
                              .replace(b'"latency_history"', b'"y"'), type=ControllerState)
    assert old.gap_history == [] and old.latency_history == []  # a checkpoint from before: empty curves
    resumed = _ledger(_ScoringSuite())
    resumed.restore(back)
    assert resumed.gap_history == [(1, 0.3), (2, 0.4)] and resumed.latency_history == [(1, 100.0), (2, 200.0)]
    resumed.suite.counters = {"judge_verdicts": 5, "judge_latency_ms": 40.0, "judge_inflight": 1}
    env = resumed.env_counters()
    assert env["env/judge_verdicts"] == 25  # counts continue
    assert env["env/judge_latency_ms"] == 40.0 and env["env/judge_inflight"] == 1  # means and gauges are now's


def test_the_scoring_latency_is_on_the_dashboard() -> None:
    import io

    from rich.console import Console

    from flashrl.dashboard import format_plain, render
    from flashrl.metrics import Snapshot

    s = Snapshot(step=2, total_steps=10, latency_history=[(1, 120.0), (2, 240.0)])
    assert "score 240ms" in format_plain(s)
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(render(s))
    assert "score ms" in console.export_text()
    assert "score" not in format_plain(Snapshot())


def test_worker_runner_auto_falls_back_to_torch_with_the_reason_and_vllm_alone_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from flashrl.rewardmodel import worker

    def no_vllm(model: str, device: str, kv: float, seed: int = 0) -> worker.Score:
        raise ValueError("Model architectures ['FooForSequenceClassification'] are not supported for now\nmore")

    monkeypatch.setattr(worker, "vllm_scorer", no_vllm)
    monkeypatch.setattr(worker, "torch_scorer", lambda model, threads, device: lambda texts: [1.0] * len(texts))
    ns = argparse.Namespace(model="m", threads=1, device="cpu", kv_cache_gib=0.25, runner="auto")
    score, runner, note = worker.load(ns)
    assert runner == "torch" and score(["a", "b"]) == [1.0, 1.0]
    assert note == ("vLLM's pooling runner cannot serve it here (ValueError: Model architectures "
                    "['FooForSequenceClassification'] are not supported for now)")
    with pytest.raises(ValueError, match="not supported"):
        worker.load(argparse.Namespace(**{**vars(ns), "runner": "vllm"}))
    assert worker.load(argparse.Namespace(**{**vars(ns), "runner": "torch"}))[1:] == ("torch", "")
    monkeypatch.setattr(worker, "vllm_scorer", lambda model, device, kv, seed=0: lambda texts: [2.0] * len(texts))
    assert worker.load(ns)[1:] == ("vllm", "")


async def test_the_same_text_is_scored_once() -> None:
    """reward.cache_size: a text scored before, or in the batch being scored, gets that score without another
    forward; a failed batch keeps nothing (the next episode's text is scored again); cache_size = 0 scores all."""
    fake = FakeScorer(_right)
    client = RewardModelClient(fake, max_batch=8, batch_wait_s=0.01, cache_size=100)
    texts = [f"12+34={a}" for a in (46, 46, 47, 46)]
    got = await asyncio.gather(*(client.score(t) for t in texts))
    assert got == [4.0, 4.0, -4.0, 4.0] and sorted(fake.batches[0]) == ["12+34=46", "12+34=47"]
    assert await client.score("12+34=47") == -4.0 and len(fake.batches) == 1
    assert client.counters["rm_cached"] == 3 and client.counters["rm_scored"] == 2
    await client.aclose()
    fake = FakeScorer(_right, fail=["crash"])
    client = RewardModelClient(fake, max_batch=8, batch_wait_s=0.0, retries=0, cache_size=100)
    with pytest.raises(RewardFailed):
        await client.score("12+34=46")
    assert await client.score("12+34=46") == 4.0 and len(fake.batches) == 2
    await client.aclose()
    fake = FakeScorer(_right)
    client = RewardModelClient(fake, max_batch=8, batch_wait_s=0.0)  # cache_size 0 (the client's default)
    for _ in range(2):
        await client.score("12+34=46")
    assert len(fake.batches) == 2 and client.counters["rm_cached"] == 0
    await client.aclose()
