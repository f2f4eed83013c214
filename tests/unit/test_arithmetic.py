"""The arithmetic environment: verifier, splits, episode protocol, params validation."""

from __future__ import annotations

import pytest

from envs import make_suite
from envs.arithmetic import ArithmeticSuite, verify
from flashrl.env import Env
from flashrl.models.tiny import carry_slip_answer


@pytest.mark.parametrize(
    ("action", "answer", "ok"),
    [
        ("46", "46", True),
        ("  46 \n", "46", True),  # whitespace around the answer is ignored
        ("46<eos>", "46", True),  # text up to EOS
        ("46<eos>junk", "46", True),
        ("-44", "-44", True),
        ("+46", "46", True),
        ("047", "47", True),  # exact integer match, not string match
        ("45", "46", False),
        ("4 6", "46", False),
        ("46 47", "46", False),
        ("", "46", False),
        ("abc", "46", False),
        ("46.0", "46", False),
        ("=46", "46", False),
        ("<eos>46", "46", False),  # nothing before EOS
        ("9" * 500, "46", False),  # garbage longer than any answer is rejected, not parsed
    ],
)
def test_verify(action: str, answer: str, ok: bool) -> None:
    assert verify(action, answer) is ok


def _suite(seed: int = 0, eval_size: int = 50, **params) -> ArithmeticSuite:
    return make_suite("arithmetic", params, seed=seed, eval_size=eval_size)


def test_splits_disjoint_and_correct() -> None:
    s = _suite(digits=2, ops=["+", "-", "*"], train_size=3000)
    train, held = s.train_tasks(), s.eval_tasks()
    assert len(held) == 50 and len(train) == 3000
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert len({t.prompt for t in train}) == 3000  # no duplicates inside a split either
    assert len({t.id for t in train} | {t.id for t in held}) == 3050
    for t in list(train[:200]) + list(held):
        expr = t.prompt.removesuffix("=")
        assert str(eval(expr)) == t.answer  # prompts are plain Python arithmetic
        a, b = (int(x) for x in expr.replace("*", "+").replace("-", "+").split("+"))
        assert 0 <= a < 100 and 0 <= b < 100
    assert {t.prompt[len(t.prompt.rstrip("=0123456789")) - 1] for t in train} >= {"+", "-", "*"}


def test_splits_deterministic_per_seed() -> None:
    a, b, c = _suite(seed=1), _suite(seed=1), _suite(seed=2)
    assert [t.prompt for t in a.eval_tasks()] == [t.prompt for t in b.eval_tasks()]
    assert [t.prompt for t in a.train_tasks()[:100]] == [t.prompt for t in b.train_tasks()[:100]]
    assert [t.prompt for t in a.eval_tasks()] != [t.prompt for t in c.eval_tasks()]


def test_small_space_caps_train_and_rejects_too_big_eval() -> None:
    s = _suite(digits=1, eval_size=30, train_size=1000)  # 100 problems in all
    assert len(s.train_tasks()) == 70
    with pytest.raises(ValueError, match="env.eval_size"):
        _suite(digits=1, eval_size=100)


def test_params_rejected_with_key() -> None:
    with pytest.raises(ValueError, match="digitz"):
        _suite(digitz=2)
    with pytest.raises(ValueError, match="ops"):
        _suite(ops=["^"])
    with pytest.raises(ValueError, match="duplicate"):
        _suite(ops=["+", "+"])


async def test_episode() -> None:
    s = _suite()
    env = s.make_env()
    assert isinstance(env, Env)
    task = s.eval_tasks()[0]
    assert await env.reset(task) == task.prompt
    res = await env.step(f" {task.answer}")
    assert (res.reward, res.done, res.info["correct"]) == (1.0, True, True)
    await env.reset(task)
    res = await env.step(str(int(task.answer) + 1))
    assert (res.reward, res.done, res.info["correct"]) == (0.0, True, False)
    await env.close()
    await env.close()  # safe twice
    with pytest.raises(RuntimeError, match="reset"):
        await env.step("1")


@pytest.mark.parametrize(
    ("prompt", "slipped"),
    [
        ("17+25=", "32"),  # 7+5 carries: the slip forgets it (42 -> 32)
        ("57+68=", "115"),  # 125 -> 115: only the units carry is forgotten, the tens still carry
        ("5+5=", "0"),  # 1-digit: 10 -> 0
        ("99+1=", "90"),
        ("19+10=", None),  # 9+0 does not carry
        ("14+25=", None),
        ("0+0=", None),
        ("17-25=", None),  # only addition
        ("17*25=", None),
        ("garbage", None),
    ],
)
def test_carry_slip_answer(prompt: str, slipped: str | None) -> None:
    assert carry_slip_answer(prompt) == slipped


def test_carry_slip_counts_on_2_digit_addition() -> None:
    s = _suite(digits=2, ops=["+"], eval_size=1, train_size=9999)
    tasks = list(s.train_tasks()) + list(s.eval_tasks())
    slips = [carry_slip_answer(t.prompt) for t in tasks]
    assert sum(x is not None for x in slips) == 4500  # 45 of the 100 units pairs carry
    assert all(int(t.answer) - int(x) == 10 for t, x in zip(tasks, slips) if x is not None)
