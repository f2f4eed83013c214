"""envs/countdown.py: the safe verifier (including hostile input), rewards and seeded splits."""

from __future__ import annotations

from fractions import Fraction

import pytest

from envs.countdown import MAX_EXPR_CHARS, CountdownParams, CountdownSuite, score, verify


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("3*5+7", 22),
        ("(7-3)*5", 20),
        ("5/3*7", Fraction(35, 3)),
        ("5/3", Fraction(5, 3)),
        ("3+5 = 8", 8),  # text after '=' ignored
        (" 7 \nsecond line", 7),
        ("3*5+7<eos>", 22),
    ],
)
def test_valid_expressions(expr: str, value: Fraction | int) -> None:
    v = verify(expr, [3, 5, 7])
    assert v.valid and v.value == value


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("__import__('os').system('touch /tmp/pwned')", "Call is not allowed"),
        ("(3).__class__", "Attribute is not allowed"),
        ("7**999999999", "BinOp is not allowed"),  # Pow: never computed
        ("3 ** 5", "BinOp is not allowed"),
        ("7/(5-5)", "number 5 not given"),  # 5 only once
        ("7/(3-3)", "number 3 not given"),
        ("3*3", "number 3 not given"),
        ("3+4", "number 4 not given"),
        ("-3+7", "UnaryOp is not allowed"),
        ("True+3", "Constant is not allowed"),
        ("3.0+7", "Constant is not allowed"),
        ("'3'+'7'", "Constant is not allowed"),
        ("lambda: 3", "Lambda is not allowed"),
        ("[3, 5]", "List is not allowed"),
        ("3 if 5 else 7", "IfExp is not allowed"),
        ("3 // 5", "BinOp is not allowed"),
        ("3 % 5", "BinOp is not allowed"),
        ("3 +", "not an expression"),
        ("", "empty"),
        ("(" * 100 + "3" + ")" * 100, "longer than"),
        ("1" * 5000, "longer than"),
    ],
)
def test_hostile_or_invalid_expressions_are_rejected(expr: str, reason: str) -> None:
    v = verify(expr, [3, 5, 7])
    assert not v.valid and v.value is None
    assert reason in v.reason


def test_division_by_zero_is_invalid_not_an_exception() -> None:
    v = verify("7/(5-5)", [7, 5, 5])
    assert not v.valid and v.reason == "division by zero"


def test_arithmetic_is_exact() -> None:
    assert verify("7/2*2", [7, 2, 2]).value == 7
    assert verify("1/3*3", [1, 3, 3]).value == 1  # 0.333...*3 in floats is not 1 for every input


def test_deep_nesting_within_the_cap_is_fine() -> None:
    expr = "(" * 30 + "3" + ")" * 30
    assert len(expr) <= MAX_EXPR_CHARS and verify(expr, [3]).value == 3


def test_score_rewards() -> None:
    assert score("3*5+7", [3, 5, 7], 22, 0.1)[0] == 1.0
    assert score("3+5+7", [3, 5, 7], 22, 0.1)[0] == 0.1  # well-formed, wrong value: format reward
    assert score("3+5+7", [3, 5, 7], 22, 0.0)[0] == 0.0
    assert score("import os", [3, 5, 7], 22, 0.1)[0] == 0.0


async def test_env_episode_and_suite_tasks_are_solvable_and_deterministic() -> None:
    p = CountdownParams(count=3, max_number=10, max_target=100, train_size=300)
    a, b = CountdownSuite(p, seed=4, eval_size=50), CountdownSuite(p, seed=4, eval_size=50)
    assert a.train_tasks() == b.train_tasks() and a.eval_tasks() == b.eval_tasks()
    assert a.eval_tasks() != CountdownSuite(p, seed=5, eval_size=50).eval_tasks()
    for t in list(a.train_tasks()) + list(a.eval_tasks()):
        nums, target = t.meta["numbers"], int(t.answer)
        assert len(nums) == 3 and all(1 <= n <= 10 for n in nums) and 1 <= target <= 100
        assert verify(t.meta["solution"], nums).value == target  # every task has a solution
        assert t.prompt == f"Make {target} from {' '.join(map(str, nums))}:\n" and len(t.prompt) < 32
    env = a.make_env()
    t = a.eval_tasks()[0]
    assert await env.reset(t) == t.prompt
    res = await env.step(t.meta["solution"])
    assert res.done and res.reward == 1.0 and res.info == {"valid": True, "correct": True}
    res = await env.step("__import__('os')")
    assert res.reward == 0.0 and res.info["valid"] is False and "Call" in res.info["reason"]
