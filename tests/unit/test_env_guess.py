"""envs/guess.py: transcripts of the multi-turn game, splits, and configs/agentic.toml."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from envs import make_suite
from envs.guess import GuessEnv, GuessParams, GuessSuite, feedback
from flashrl import config
from flashrl.env import Demo, Demonstrating, Task
from flashrl.models.tokenizer import CHARSET

ROOT = Path(__file__).resolve().parents[2]


async def play(env: GuessEnv, task, actions: list[str]):
    obs = await env.reset(task)
    results = []
    for a in actions:
        res = await env.step(a)
        results.append(res)
        if res.done:
            break
    return obs, results


async def test_binary_search_transcript() -> None:
    suite = GuessSuite(GuessParams(max_number=9, max_turns=4, discount=0.5))
    task = Task(id="x", prompt=suite.prompt(), answer="7")
    env = suite.make_env()
    obs, res = await play(env, task, ["4", "6\n", "8", "7"])
    assert obs == "Guess 0-9:\n"
    assert [r.observation for r in res] == [" higher\n", " higher\n", " lower\n", ""]
    assert [r.done for r in res] == [False, False, False, True]
    assert res[-1].reward == 0.5**3 and res[-1].info["found"] is True
    assert res[-1].info["correct"] is True  # a find on any turn is correct (reward < 1 after turn 1)
    assert env.transcript == "Guess 0-9:\n4 higher\n6\n higher\n8 lower\n7"
    assert set(env.transcript) <= set(CHARSET)


async def test_out_of_turns_invalid_and_lenient_parsing() -> None:
    suite = GuessSuite(GuessParams(max_number=9, max_turns=3))
    task = Task(id="x", prompt=suite.prompt(), answer="2")
    env = suite.make_env()
    await env.reset(task)
    r1 = await env.step("abc")  # no digits: invalid, a turn is used
    r2 = await env.step("12")  # out of range: invalid
    r3 = await env.step("5 higher")  # the first digits count: 5, still wrong, last turn
    assert [r1.observation, r2.observation] == [" invalid\n", " invalid\n"]
    assert r3.done and r3.reward == 0.0 and r3.info == {"turns": 3, "guess": 5, "found": False, "correct": False}
    with pytest.raises(RuntimeError, match="reset"):
        await env.step("2")
    await env.reset(task)  # a new episode on the same env
    assert (await env.step(" 2<eos>")).reward == 1.0


def test_splits_are_deterministic_and_seeded() -> None:
    a = GuessSuite(GuessParams(), seed=1, eval_size=50)
    b = GuessSuite(GuessParams(), seed=1, eval_size=50)
    c = GuessSuite(GuessParams(), seed=2, eval_size=50)
    assert [t.answer for t in a.train_tasks()[:100]] == [t.answer for t in b.train_tasks()[:100]]
    assert [t.answer for t in a.eval_tasks()] != [t.answer for t in c.eval_tasks()]
    assert [t.answer for t in a.eval_tasks()] != [t.answer for t in a.train_tasks()[:50]]
    assert len(a.eval_tasks()) == 50 and len(a.train_tasks()) == 10000
    assert {t.answer for t in a.train_tasks()} == {str(i) for i in range(10)}
    assert len({t.id for t in a.train_tasks()}) == 10000


def test_worst_case_transcript_fits_the_tiny_model() -> None:
    # max_number 15, 5 turns: prompt + 4 wrong two-digit guesses with feedback + the last guess.
    p = GuessParams(max_number=15, max_turns=5)
    text = GuessSuite(p, eval_size=1).prompt() + "10 higher\n" * 4 + "15"
    assert len(text) < 64


def test_agentic_config_loads_and_builds_its_suite() -> None:
    cfg = config.load(ROOT / "configs" / "agentic.toml")
    assert cfg.env.name == "guess" and cfg.rollout.max_turns >= 4
    assert cfg.rollout.env_async is True and cfg.rollout.redundancy > 0
    assert cfg.model.path == "builtin:tiny" and cfg.engine.count == 2 and cfg.trainer.ranks == 1
    assert cfg.rollout.turn_timeout_s < cfg.rollout.trajectory_timeout_s
    suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
    assert suite.params.delay is not None  # the delay is on, to stand in for slow environments
    assert len(suite.eval_tasks()) == cfg.env.eval_size
    # the round trip through the resolved-config writer keeps the nested delay table
    again = config.from_dict(__import__("tomllib").loads(config.to_toml(cfg)))
    assert again.env.params == cfg.env.params


async def _replay(suite: GuessSuite, task: Task, demo: Demo) -> list:
    env = suite.make_env()
    assert await env.reset(task) == demo.prompt
    return [await env.step(action) for action, _ in demo.turns]


@pytest.mark.parametrize("ignore", [0.0, 0.5, 1.0])
async def test_teacher_demonstrations_replay_exactly_in_the_env(ignore: float) -> None:
    suite = GuessSuite(GuessParams(max_number=9, max_turns=4, teacher_ignore=ignore), eval_size=1)
    assert isinstance(suite, Demonstrating)
    rng = random.Random(0)
    found = 0
    for task in suite.train_tasks()[:300]:
        demo = suite.demonstration(task, rng)
        results = await _replay(suite, task, demo)
        # the teacher's observations are the env's, turn by turn, and the episode ends where the env ends it
        assert [obs for _, obs in demo.turns] == [r.observation for r in results]
        assert [r.done for r in results] == [False] * (len(results) - 1) + [True]
        assert 1 <= len(demo.turns) <= 4 and demo.turns[-1][1] == ""
        found += results[-1].info["found"]
        if ignore == 0.0:  # every guess is one the feedback so far allows
            lo, hi = 0, 9
            for action, obs in demo.turns:
                g = int(action)
                assert lo <= g <= hi
                lo, hi = (g + 1, hi) if obs == " higher\n" else (lo, g - 1) if obs == " lower\n" else (lo, hi)
    # success of the teacher (simulated exactly: 0.76 consistent, 0.55 at 0.5, 0.35 ignoring everything)
    expected = {0.0: 0.764, 0.5: 0.547, 1.0: 0.344}[ignore]
    assert abs(found / 300 - expected) < 0.09


def test_teacher_is_deterministic_for_its_rng_and_feedback_is_the_envs() -> None:
    suite = GuessSuite(GuessParams(), eval_size=1)
    tasks = suite.train_tasks()[:50]
    a = [suite.demonstration(t, random.Random(3)) for t in tasks]
    b = [suite.demonstration(t, random.Random(3)) for t in tasks]
    assert a == b
    assert [feedback(5, g, 9) for g in (2, 8, 10, -1)] == [" higher\n", " lower\n", " invalid\n", " invalid\n"]
