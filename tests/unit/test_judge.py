"""flashrl/judge: the verdict parser, the client's retries and unparsable handling, on FakeJudgeEngines (the
engine processes are tests/integration/test_judge_process.py's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from envs.arithmetic import ArithmeticSuite
from flashrl.config import ConfigError, JudgeConfig, RewardModelConfig, advice, from_dict
from flashrl.env import EnvFailure
from flashrl.judge.client import JudgeClient, parse_score, parse_verdict
from flashrl.judge.fake import FakeJudgeEngines
from flashrl.models.tokenizer import build_char_tokenizer
from flashrl.rewardmodel.suite import RewardModelSuite

TOK = build_char_tokenizer()


def _says(*verdicts: str):  # type: ignore[no-untyped-def]
    """A judge that answers with ``verdicts`` in turn (the last one from then on)."""
    left = list(verdicts)

    def fn(ids: list[int]) -> list[int]:
        v = left.pop(0) if len(left) > 1 else left[0]
        return TOK.encode(v, add_special_tokens=False) + [TOK.eos_token_id]

    return fn


def test_parse_verdict() -> None:
    jc = JudgeConfig(model="x")
    p, f = re.compile(jc.pass_pattern), re.compile(jc.fail_pattern)
    assert parse_verdict("P", p, f) == 1.0 and parse_verdict(" pass", p, f) == 1.0
    assert parse_verdict("F", p, f) == 0.0 and parse_verdict("no", p, f) == 0.0
    assert parse_verdict("", p, f) is None and parse_verdict("maybe", p, f) is None


def test_parse_score() -> None:
    jc = JudgeConfig(model="x", verdict="score")
    d = re.compile(jc.score_pattern)
    assert parse_score("46 47 7", d, 0, 10) == 0.7 and parse_score("8.5", d, 0, 10) == 0.85
    assert parse_score("0", d, 0, 10) == 0.0 and parse_score("10 ", d, 0, 10) == 1.0
    assert parse_score("3", d, 1, 5) == 0.5  # mapped from [score_min, score_max]
    assert parse_score("11", d, 0, 10) is None and parse_score("-1", d, 0, 10) is None  # out of range: garbage
    assert parse_score("", d, 0, 10) is None and parse_score("7 of ten", d, 0, 10) is None  # no number at the end
    rating = re.compile(r"Rating: (\d+)")
    assert parse_score("Rating: 2/10, then Rating: 7/10", rating, 0, 10) == 0.7  # the last match counts
    assert parse_score("Rating: 70", rating, 0, 10) is None


async def test_score_verdicts_are_rewards_in_0_1_and_garbage_is_unparsable() -> None:
    fake = FakeJudgeEngines(_says("Score: 8", "Score: 12", "Score: 3"))
    jc = JudgeConfig(model="x", verdict="score", score_pattern=r"Score: (\d+)", score_min=0, score_max=10,
                     cache_size=0)
    c = JudgeClient(jc, fake, TOK)
    assert await c.score(("1+2=", "3")) == 0.8
    assert await c.score(("1+2=", "4")) == 0.3  # 12 is out of range: unparsable, asked again (sampled)
    assert [t for _, t in fake.requests] == [0.0, 0.0, 1.0]
    assert c.counters["judge_unparsable"] == 1 and c.counters["judge_parse_retries"] == 1
    assert c.counters["judge_verdicts"] == 2 and c.counters["judge_pass"] == 1  # 0.8 is a pass, 0.3 is not
    inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
    suite = RewardModelSuite(inner, JudgeClient(jc, FakeJudgeEngines(_says("Score: 6")), TOK), RewardModelConfig(),
                             kind="judge")
    task = inner.train_tasks()[0]
    env = suite.make_env()
    await env.reset(task)
    res = await env.step(task.answer)  # right: the verifier's 1 against the judge's 0.6
    assert res.reward == 0.6 and res.info["correct"] is True
    assert abs(res.info["metrics"]["judge_gap"] - (0.6 - 1.0)) < 1e-9 and res.info["metrics"]["judge_agree"] == 1.0


async def test_verdicts_fill_the_template_and_parse() -> None:
    fake = FakeJudgeEngines(_says("P", "F"))
    c = JudgeClient(JudgeConfig(model="x", template="Q{prompt}A{response}?"), fake, TOK)
    assert await c.score(("1+2=", "3<eos>")) == 1.0
    assert await c.score(("1+2=", "4")) == 0.0
    assert TOK.decode(fake.requests[0][0]) == "Q1+2=A3?"  # the eos mark cut, as the verifier reads it
    assert c.counters["judge_verdicts"] == 2 and c.counters["judge_pass"] == 1


async def test_unparsable_verdicts_retry_then_take_the_default() -> None:
    fake = FakeJudgeEngines(_says("?", "?", "P"))
    c = JudgeClient(JudgeConfig(model="x", parse_retries=2), fake, TOK)
    assert await c.score(("1+2=", "3")) == 1.0
    assert [t for _, t in fake.requests] == [0.0, 1.0, 1.0]  # asked again, sampled
    assert c.counters["judge_unparsable"] == 2 and c.counters["judge_parse_retries"] == 2
    fake = FakeJudgeEngines(_says("?"))
    c = JudgeClient(JudgeConfig(model="x", on_unparsable="default", unparsable_reward=0.5), fake, TOK)
    assert await c.score(("1+2=", "3")) == 0.5
    assert len(fake.requests) == 1 and c.counters["judge_defaulted"] == 1


async def test_engine_failures_are_retried_and_counted_apart_never_a_verdict() -> None:
    fake = FakeJudgeEngines(_says("P"), fail=["engine_died", "engine_timeout"])
    c = JudgeClient(JudgeConfig(model="x", retries=2), fake, TOK)
    assert await c.score(("1+2=", "3")) == 1.0
    assert (c.counters["judge_engine_died"], c.counters["judge_engine_timeout"], c.counters["judge_retries"]) == (1, 1, 2)
    inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
    fake = FakeJudgeEngines(_says("P"), fail=["engine_died"] * 3)
    suite = RewardModelSuite(inner, JudgeClient(JudgeConfig(model="x", retries=2), fake, TOK), RewardModelConfig(), kind="judge")
    env = suite.make_env()
    await env.reset(inner.train_tasks()[0])
    with pytest.raises(EnvFailure) as e:
        await env.step("12")
    assert e.value.reason == "judge_engine_died"
    await suite.aclose()
    assert fake.closed


async def test_the_judge_trains_the_verifier_stays_truth() -> None:
    inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
    suite = RewardModelSuite(inner, JudgeClient(JudgeConfig(model="x"), FakeJudgeEngines(_says("P")), TOK),
                             RewardModelConfig(), kind="judge")
    task = inner.train_tasks()[0]
    env = suite.make_env()
    await env.reset(task)
    res = await env.step(str(int(task.answer) + 1))
    assert res.reward == 1.0 and res.info["correct"] is False  # a lenient judge: the gap shows it
    assert res.info["metrics"]["judge_gap"] == 1.0 and res.info["metrics"]["judge_agree"] == 0.0


@pytest.mark.parametrize("score_evals", [True, False])
async def test_held_out_episodes_are_judged_only_when_score_evals(score_evals: bool) -> None:
    """reward.score_evals = false: a held-out episode gets the verifier's reward alone and no judge request
    (training episodes are judged either way)."""
    inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
    fake = FakeJudgeEngines(_says("P"))
    suite = RewardModelSuite(inner, JudgeClient(JudgeConfig(model="x"), fake, TOK),
                             RewardModelConfig(score_evals=score_evals), kind="judge")
    held_out = inner.eval_tasks()[0]
    env = suite.make_eval_env()  # a held-out episode, as the controller makes it for an eval's rollout
    await env.reset(held_out)
    res = await env.step(str(int(held_out.answer) + 1))  # wrong: the lenient judge would pass it
    assert len(fake.requests) == (1 if score_evals else 0)
    assert res.reward == (1.0 if score_evals else 0.0) and res.info["correct"] is False
    assert ("judge_gap" in res.info.get("metrics", {})) is score_evals
    env = suite.make_env()
    await env.reset(inner.train_tasks()[0])
    await env.step("12")
    assert len(fake.requests) == (2 if score_evals else 1)  # training episodes: judged either way


def test_judge_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="judge.template"):
        from_dict({"judge": {"model": "builtin:judge", "template": "{prompt}{answer}"}})
    with pytest.raises(ConfigError, match="judge.pass_pattern: invalid regular expression"):
        from_dict({"judge": {"model": "builtin:judge", "pass_pattern": "("}})
    with pytest.raises(ConfigError, match="both reward.model and judge.model"):
        from_dict({"judge": {"model": "builtin:judge"}, "reward": {"model": "builtin:rm"}})
    with pytest.raises(ConfigError, match="judge: options of a judge, but judge.model is empty"):
        from_dict({"judge": {"engines": 2}})
    with pytest.raises(ConfigError, match='judge.score_max: set, but judge.verdict = "pass_fail"'):
        from_dict({"judge": {"model": "builtin:judge", "score_max": 5}})
    with pytest.raises(ConfigError, match='judge.fail_pattern: set, but judge.verdict = "score"'):
        from_dict({"judge": {"model": "builtin:judge", "verdict": "score", "fail_pattern": "no"}})
    with pytest.raises(ConfigError, match="judge.score_min = 5.0 must be below judge.score_max = 5.0"):
        from_dict({"judge": {"model": "builtin:judge", "verdict": "score", "score_min": 5, "score_max": 5}})
    with pytest.raises(ConfigError, match="judge.score_pattern: .* has no group"):
        from_dict({"judge": {"model": "builtin:judge", "verdict": "score", "score_pattern": r"\d+"}})
    with pytest.raises(ConfigError, match="judge.score_pattern: invalid regular expression"):
        from_dict({"judge": {"model": "builtin:judge", "verdict": "score", "score_pattern": "(\\d"}})
    cfg = from_dict({"judge": {"model": "builtin:judge", "verdict": "score"}})  # valid, but a pass would be 0.1
    assert any("a pass is worth 0.1, not 1" in n for n in advice(cfg))
    assert not advice(from_dict({"judge": {"model": "builtin:judge", "verdict": "score", "score_max": 1}}))


def test_builtin_judge_targets_solve_copy_then_rule() -> None:
    """builtin:judge learns to write its own sum, the answer it judges, then the verifier's verdict, which the
    default patterns parse: the copy puts each digit of the answer a fixed distance from the digit it must equal."""
    import random

    from flashrl.judge.build import judge_tasks

    suite = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=20)
    rows = list(suite.eval_tasks())
    tasks = judge_tasks(rows, 40, "{prompt}{response}?", suite, random.Random(0))
    jc = JudgeConfig()
    verdicts = set()
    for t in tasks:
        row = next(r for r in rows if t.prompt.startswith(r.prompt))
        judged = t.prompt[len(row.prompt):-1]
        verdict = "1" if judged == row.answer else "0"
        assert t.answer == f"{row.answer} {judged} {verdict}"
        want = 1.0 if verdict == "1" else 0.0
        assert parse_verdict(t.answer, re.compile(jc.pass_pattern), re.compile(jc.fail_pattern)) == want
        verdicts.add(verdict)
    assert verdicts == {"0", "1"}


def test_judge_engines_get_gpus_after_the_trainer_ranks_and_the_engines() -> None:
    from flashrl.config import load
    from flashrl.launch.processes import judge_gpus

    cfg = load(Path(__file__).resolve().parents[2] / "configs" / "judge.toml",
               ["trainer.ranks=2", "engine.count=1", "judge.engines=2"])
    assert judge_gpus(cfg, ["4", "5", "6", "7", "8"]) == ["7", "8"]  # ranks on 4, 5; the engine on 6
    assert judge_gpus(cfg, ["0", "1", "2", "3"]) == [None, None]  # too few: unpinned, they share


async def test_a_greedy_judge_answers_the_same_text_once() -> None:
    """judge.cache_size: a text already judged, or being judged, gets that verdict without another request;
    a sampled judge (temperature > 0), a verdict that needed a parse retry, and cache_size = 0 ask every time."""
    import asyncio

    fake = FakeJudgeEngines(_says("P", "F"))
    c = JudgeClient(JudgeConfig(model="x"), fake, TOK)
    got = await asyncio.gather(*(c.score(("1+2=", "3")) for _ in range(3)))  # concurrent: one request
    assert got == [1.0, 1.0, 1.0] and len(fake.requests) == 1
    assert await c.score(("1+2=", "3<eos>")) == 1.0 and len(fake.requests) == 1  # the same judge text
    assert await c.score(("1+2=", "4")) == 0.0 and len(fake.requests) == 2
    assert await c.score(("1+2=", "4")) == 0.0 and len(fake.requests) == 2
    assert c.counters["judge_cached"] == 4 and c.counters["judge_verdicts"] == 2
    for jc in (JudgeConfig(model="x", temperature=0.7), JudgeConfig(model="x", cache_size=0)):
        fake = FakeJudgeEngines(_says("P"))
        c = JudgeClient(jc, fake, TOK)
        for _ in range(2):
            assert await c.score(("1+2=", "3")) == 1.0
        assert len(fake.requests) == 2 and c.counters["judge_cached"] == 0
    fake = FakeJudgeEngines(_says("?", "P"))  # parsed on the retry, sampled: not kept
    c = JudgeClient(JudgeConfig(model="x"), fake, TOK)
    assert await c.score(("1+2=", "3")) == 1.0 and await c.score(("1+2=", "3")) == 1.0
    assert [t for _, t in fake.requests] == [0.0, 1.0, 0.0]


async def test_a_shared_verdict_survives_its_first_asker_and_a_failed_one_is_not_kept() -> None:
    """The episode that asked first may be cancelled (a redundant env, a deadline): the others still get the
    verdict. A request that failed past its retries fails every episode that waited on it (infrastructure),
    and the next episode asks again."""
    import asyncio

    gate = asyncio.Event()

    class Slow(FakeJudgeEngines):
        async def generate(self, prompt_ids, **kw):  # type: ignore[no-untyped-def]
            await gate.wait()
            return await super().generate(prompt_ids, **kw)

    fake = Slow(_says("P"))
    c = JudgeClient(JudgeConfig(model="x"), fake, TOK)
    first = asyncio.ensure_future(c.score(("1+2=", "3")))
    second = asyncio.ensure_future(c.score(("1+2=", "3")))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert await second == 1.0 and first.cancelled() and len(fake.requests) == 1
    from flashrl.rewards import RewardFailed

    fake = FakeJudgeEngines(_says("P"), fail=["engine_died"] * 2)
    c = JudgeClient(JudgeConfig(model="x", retries=1), fake, TOK)
    both = await asyncio.gather(*(c.score(("1+2=", "3")) for _ in range(2)), return_exceptions=True)
    assert all(isinstance(e, RewardFailed) for e in both) and len(fake.requests) == 2  # one ask, one retry
    assert await c.score(("1+2=", "3")) == 1.0 and len(fake.requests) == 3
