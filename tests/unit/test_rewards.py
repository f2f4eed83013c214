"""Rewards by name or reference (flashrl/rewards.py), the parts that run in this process: built-ins, user
functions by file, result coercion, and the errors of bad references.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_rewards_process.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flashrl.plugins import PluginError
from flashrl.rewards import RewardFailed, RewardOptions, RewardRunner, coerce_result, make_reward_fn

ROW = {"id": "r1", "prompt": "12+7=", "answer": "19", "carry": True}

USER = '''
import asyncio, os, threading, time

def score(row, response):
    got = response.strip()
    return {"reward": float(got == row["answer"]), "parsed": float(got.lstrip("-").isdigit()),
            "carry_seen": float(row["carry"])}

def plain(row, response):
    return 0.25

def where(row, response):
    return {"reward": 0.0, "pid": float(os.getpid()), "main_thread": float(threading.current_thread() is threading.main_thread())}

async def ascore(row, response):
    await asyncio.sleep(0.01)
    return {"reward": 1.0, "correct": False}

def boom(row, response):
    return {"reward": 1.0}[row["missing"]]

def garbage(row, response):
    return "high"

def nan(row, response):
    return {"reward": float("nan")}

def slow(row, response):
    time.sleep(60)
    return 1.0

def die(row, response):
    os._exit(3)

def noisy(row, response):
    print("a line on stdout must not break the worker protocol")
    return 0.5
'''


@pytest.fixture
def user(tmp_path: Path) -> str:
    (tmp_path / "user_reward.py").write_text(textwrap.dedent(USER))
    return str(tmp_path / "user_reward.py")


async def score(spec: str, response: str, **kw: object) -> object:
    r = RewardRunner(spec, **kw)  # type: ignore[arg-type]
    try:
        return await r.score(ROW, response)
    finally:
        await r.aclose()


def test_builtin_exact_and_regex() -> None:
    exact = make_reward_fn("exact", RewardOptions())
    assert exact(ROW, " 19\n")["reward"] == 1.0 and exact(ROW, "18")["reward"] == 0.0
    rx = make_reward_fn("regex", RewardOptions(answer_pattern=r"####\s*(?P<answer>-?\d+)"))
    assert rx(ROW, "12+7 is 19\n#### 19")["reward"] == 1.0
    assert rx(ROW, "#### 18 no wait #### 19")["reward"] == 1.0  # the last match counts
    assert rx(ROW, "19")["matched"] == 0.0
    ci = make_reward_fn("exact", RewardOptions(case_sensitive=False))
    assert ci({"answer": "Paris"}, "paris")["reward"] == 1.0
    with pytest.raises(PluginError, match="answer_pattern"):
        make_reward_fn("regex", RewardOptions())
    with pytest.raises(PluginError, match=r"env\.params\.answer_pattern: invalid regular expression"):
        make_reward_fn("regex", RewardOptions(answer_pattern="(unclosed"))


def test_unknown_and_bad_references(user: str) -> None:
    with pytest.raises(PluginError, match=r"env\.params\.reward: unknown reward 'exactly'; expected one of exact, regex, math"):
        make_reward_fn("exactly", RewardOptions())
    with pytest.raises(PluginError, match=r"has no attribute 'nope'"):
        make_reward_fn(f"{user}:nope", RewardOptions())
    with pytest.raises(PluginError, match=r"cannot be called as fn\(row, response\)"):
        make_reward_fn("os:getpid", RewardOptions())


def test_coerce_result() -> None:
    assert coerce_result(1, "f").reward == 1.0 and coerce_result(True, "f").reward == 1.0
    r = coerce_result({"reward": 0.5, "len": 3, "correct": True}, "f")
    assert (r.reward, r.metrics, r.correct) == (0.5, {"len": 3.0}, True)
    for bad in ("1.0", None, {"score": 1}, {"reward": "1"}, {"reward": 1, "note": "x"}, float("inf")):
        with pytest.raises(RewardFailed, match="reward_error"):
            coerce_result(bad, "f")


async def test_user_function_sync_async_and_metrics(user: str) -> None:
    r = await score(f"{user}:score", "19")
    assert (r.reward, r.metrics) == (1.0, {"parsed": 1.0, "carry_seen": 1.0})
    assert (await score(f"{user}:plain", "x")).reward == 0.25
    a = await score(f"{user}:ascore", "x")
    assert (a.reward, a.correct) == (1.0, False)
