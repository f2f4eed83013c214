"""envs/tools.py: the calculator tool-use task: calls, answers, malformed text, splits, latency, teacher."""

from __future__ import annotations

import math
import random
import statistics
import tomllib
from pathlib import Path

import msgspec
import pytest

from envs import make_suite
from envs.tools import MALFORMED_OBS, ToolLatency, ToolsEnv, ToolsParams, ToolsSuite, parse_call, parse_prompt
from flashrl import config
from flashrl.env import Demonstrating, Task
from flashrl.models.tokenizer import CHARSET
from flashrl.sim.clock import run_virtual

ROOT = Path(__file__).resolve().parents[2]
NO_DELAY = ToolLatency(median_s=0.0, p99_s=0.0)
TASK = Task(id="x", prompt="37*48=", answer="1776")


def env(**kw) -> ToolsEnv:
    return ToolsSuite(ToolsParams(latency=NO_DELAY, **kw), eval_size=10).make_env()  # type: ignore[return-value]


async def play(e: ToolsEnv, actions: list[str], task: Task = TASK) -> list:
    assert await e.reset(task) == task.prompt
    out = []
    for a in actions:
        r = await e.step(a)
        out.append(r)
        if r.done:
            break
    return out


def test_parse_call() -> None:
    assert parse_call("calc(37*48)") == (True, 1776)
    assert parse_call(" calc( 37 * 48 )<eos>") == (True, 1776)
    assert parse_call("calc(5+7)") == (True, 12) and parse_call("calc(5-7)") == (True, -2)
    for bad in ["calc(3748)", "calc(37*48", "calc 37*48", "calc(a*b)", "calc(1234567*2)", "calc(2**3)", "calc()", "calc"]:
        assert parse_call(bad) == (True, None), bad
    for answer in ["1776", "", "  ", "hello", "c", "x calc(1*2)", "\x00"]:
        assert parse_call(answer) == (False, None), answer
    assert parse_prompt("37*48=") == (37, 48)
    with pytest.raises(ValueError, match="a\\*b="):
        parse_prompt("37+48=")


async def test_call_then_answer_is_rewarded() -> None:
    e = env()
    r1, r2 = await play(e, ["calc(37*48)", "1776<eos>"])
    assert (r1.observation, r1.done, r1.reward) == ("=1776\n", False, 0.0)
    assert r2.done and r2.reward == 1.0 and r2.info["correct"] is True
    assert r2.info["metrics"] == {"called": 1.0, "direct": 0.0, "direct_correct": 0.0, "malformed": 0.0,
                                  "copied": 1.0, "tool_calls": 1.0}
    assert e.transcript == "37*48=calc(37*48)=1776\n1776<eos>"
    assert all(c in CHARSET for c in e.transcript.replace("<eos>", ""))
    with pytest.raises(RuntimeError, match="reset"):
        await e.step("1")


async def test_wrong_answers_and_direct_answers() -> None:
    (r,) = await play(env(), ["1775"])
    assert r.done and r.reward == 0.0 and r.info["metrics"]["direct"] == 1.0
    (r,) = await play(env(), ["1776"])  # right without the tool: rewarded (and counted as direct)
    assert r.reward == 1.0 and r.info["metrics"]["direct_correct"] == 1.0
    r1, r2 = await play(env(), ["calc(37*49)", "1813"])  # wrong operand: a right product of the wrong call
    assert r1.observation == "=1813\n" and r2.reward == 0.0 and r2.info["metrics"]["copied"] == 1.0
    _, r2 = await play(env(), ["calc(37*48)", "1766"])  # copied wrong
    assert r2.reward == 0.0 and r2.info["metrics"]["copied"] == 0.0
    for junk in ["", "   ", "1776 1776", "the answer is 1776", "\n\n"]:
        (r,) = await play(env(), [junk])
        assert r.done and r.reward == 0.0, junk


async def test_malformed_calls_get_a_useful_observation_and_use_a_turn() -> None:
    e = env(max_turns=3)
    r1, r2, r3 = await play(e, ["calc(3748)", "calc(37*48)", "1776"])
    assert (r1.observation, r1.done, r1.reward) == (MALFORMED_OBS, False, 0.0)
    assert r2.observation == "=1776\n" and r3.reward == 1.0 and r3.info["metrics"]["malformed"] == 1.0
    assert e.counters["malformed_calls"] == 1 and e.counters["tool_calls"] == 1
    # calls until the turns run out: done, reward 0, never an exception
    res = await play(env(max_turns=3), ["calc(1*1)", "calc(x)", "calc(2*2)", "4"])
    assert len(res) == 3 and res[-1].done and res[-1].reward == 0.0 and res[-1].info["correct"] is False


def test_splits_share_no_prompt_and_no_product() -> None:
    for seed in (0, 1, 2):
        s = ToolsSuite(ToolsParams(), seed=seed, eval_size=200)
        train, held = s.train_tasks(), s.eval_tasks()
        assert len(held) == 200 and len(train) == 5000
        assert not {t.prompt for t in train} & {t.prompt for t in held}
        assert not {t.answer for t in train} & {t.answer for t in held}
        assert len({t.prompt for t in train}) == len(train)
        for t in list(train[:50]) + list(held[:50]):
            a, b = parse_prompt(t.prompt)
            assert 10 <= a <= 99 and 10 <= b <= 99 and int(t.answer) == a * b
        again = ToolsSuite(ToolsParams(), seed=seed, eval_size=200)
        assert again.eval_tasks() == held and again.train_tasks() == train
    assert ToolsSuite(ToolsParams(), seed=1).eval_tasks() != ToolsSuite(ToolsParams(), seed=0).eval_tasks()
    with pytest.raises(ValueError, match="eval_size"):
        ToolsSuite(ToolsParams(min_operand=1, max_operand=3), eval_size=9)
    with pytest.raises(msgspec.ValidationError, match="min_operand"):
        msgspec.convert({"min_operand": 50, "max_operand": 20}, ToolsParams)


def test_latency_is_lognormal_with_the_configured_median_and_p99() -> None:
    lat = ToolLatency(median_s=0.2, p99_s=2.0, max_s=1000.0)
    assert lat.sigma == pytest.approx(math.log(10) / 2.3263478740408408)
    rng = random.Random(0)
    draws = sorted(lat.draw(rng) for _ in range(100_000))
    assert statistics.median(draws) == pytest.approx(0.2, rel=0.03)
    assert draws[98_999] == pytest.approx(2.0, rel=0.08)
    assert draws[98_999] / statistics.median(draws) >= 9.0  # heavy-tailed: p99 ~10x the median
    capped = ToolLatency(median_s=0.2, p99_s=2.0, max_s=0.5)
    assert max(capped.draw(rng) for _ in range(10_000)) == 0.5
    assert NO_DELAY.draw(rng) == 0.0 and ToolLatency(median_s=0.3, p99_s=0.3).draw(rng) == pytest.approx(0.3)
    with pytest.raises(msgspec.ValidationError, match="p99_s"):
        msgspec.convert({"median_s": 1.0, "p99_s": 0.5}, ToolLatency)


def test_each_tool_call_waits_its_latency_on_the_virtual_clock() -> None:
    suite = ToolsSuite(ToolsParams(latency=ToolLatency(median_s=0.5, p99_s=5.0)), eval_size=10)

    async def main() -> tuple[float, float]:
        import anyio

        e = suite.make_env()
        await e.reset(TASK)
        t0 = anyio.current_time()
        await e.step("calc(37*48)")
        t_call = anyio.current_time() - t0
        await e.step("1776")  # the answer costs nothing
        return t_call, anyio.current_time() - t0 - t_call

    t_call, t_answer = run_virtual(main).result
    assert t_call > 0 and t_call == pytest.approx(suite.counters["tool_latency_s"]) and t_answer == 0.0


@pytest.mark.parametrize("direct,malformed,operand,copy", [(0.5, 0.1, 0.1, 0.15), (0.0, 0.0, 0.0, 0.0), (1.0, 0, 0, 0)])
async def test_teacher_demonstrations_replay_exactly_in_the_env(direct, malformed, operand, copy) -> None:
    p = ToolsParams(latency=NO_DELAY, teacher_direct=direct, teacher_malformed=malformed,
                    teacher_operand_slip=operand, teacher_copy_slip=copy)
    suite = ToolsSuite(p, eval_size=10)
    assert isinstance(suite, Demonstrating)
    rng = random.Random(0)
    n, direct_n, wins = 600, 0, 0
    for task in suite.train_tasks()[:n]:
        demo = suite.demonstration(task, rng)
        results = await play(suite.make_env(), [a for a, _ in demo.turns], task)  # type: ignore[arg-type]
        assert [o for _, o in demo.turns] == [r.observation for r in results]
        assert results[-1].done and len(results) == len(demo.turns) <= p.max_turns
        direct_n += results[-1].info["metrics"]["direct"]
        wins += results[-1].reward
    assert direct_n / n == pytest.approx(direct, abs=0.06)
    # the teacher's direct answers are right; its calls slip as configured
    assert wins / n == pytest.approx(direct + (1 - direct) * (1 - operand) * (1 - copy), abs=0.06)


def test_tools_config_loads_and_runs_in_the_remote_pool() -> None:
    cfg = config.load(ROOT / "configs" / "tools.toml")
    assert cfg.env.name == "remote" and cfg.env.params["inner"] == "tools"
    assert cfg.rollout.env_async and cfg.rollout.eval_temperature == 1.0
    inner = cfg.env.params["params"]
    lat = msgspec.convert(inner["latency"], ToolLatency)
    assert lat.p99_s >= 10 * lat.median_s and lat.max_s < cfg.rollout.turn_timeout_s
    assert "faults" in inner  # the injectable faults act inside the workers
    suite = make_suite("tools", {k: v for k, v in inner.items()}, cfg.run.seed, cfg.env.eval_size)
    assert len(suite.eval_tasks()) == cfg.env.eval_size
    again = config.from_dict(tomllib.loads(config.to_toml(cfg)))
    assert again.env.params == cfg.env.params
