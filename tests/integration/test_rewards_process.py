"""Rewards by name or reference (flashrl/rewards.py): built-ins, user functions (sync, async, by file or
module), where they run (loop, threads, worker processes), and failures that are never a 0."""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest

from flashrl.rewards import RewardFailed, RewardRunner
from tests.unit import test_rewards
from tests.unit.test_rewards import ROW, score

user = test_rewards.user  # the unit module's fixture, shared


async def test_sync_reward_runs_off_the_event_loop(user: str) -> None:
    t = await score(f"{user}:where", "x")  # default: a thread of this process
    assert t.metrics == {"pid": float(os.getpid()), "main_thread": 0.0}
    p = await score(f"{user}:where", "x", executor="process")  # a worker process's main thread
    assert p.metrics["pid"] != float(os.getpid()) and p.metrics["main_thread"] == 1.0
    # a slow reward does not stall the loop: a ticker keeps ticking while 2 run in threads
    r = RewardRunner(f"{user}:slow", timeout_s=0.5, workers=2)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick = asyncio.create_task(ticker())
    results = await asyncio.gather(r.score(ROW, "a"), r.score(ROW, "b"), return_exceptions=True)
    tick.cancel()
    await r.aclose()
    assert all(isinstance(e, RewardFailed) and e.reason == "reward_timeout" for e in results)
    assert ticks >= 20


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_raising_reward_is_a_failure_with_its_traceback(user: str, executor: str) -> None:
    with pytest.raises(RewardFailed) as e:
        await score(f"{user}:boom", "19", executor=executor)
    assert e.value.reason == "reward_error"
    assert re.search(r'Traceback .*user_reward\.py", line \d+, in boom', e.value.detail, re.S)
    assert "KeyError: 'missing'" in e.value.detail
    for bad in ("garbage", "nan"):
        with pytest.raises(RewardFailed, match="reward_error"):
            await score(f"{user}:{bad}", "19", executor=executor)


async def test_process_worker_past_its_deadline_is_killed_and_replaced(user: str) -> None:
    r = RewardRunner(f"{user}:slow", executor="process", workers=1, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardFailed, match="reward_timeout"):
            await r.score(ROW, "x")
        assert time.monotonic() - t0 < 5
        assert r.counters["workers_killed"] == 1
        with pytest.raises(RewardFailed, match="reward_timeout"):  # a new worker took the call
            await r.score(ROW, "x")
        assert r.counters["workers_started"] == 2
    finally:
        await r.aclose()
    assert r.pids() == []


async def test_worker_that_dies_is_a_crash_then_replaced(user: str) -> None:
    r = RewardRunner(f"{user}:die", executor="process", workers=1)
    try:
        for _ in range(2):
            with pytest.raises(RewardFailed, match="reward_crash"):
                await r.score(ROW, "x")
        assert r.counters["workers_started"] == 2
    finally:
        await r.aclose()


async def test_prints_in_a_worker_do_not_break_it(user: str) -> None:
    r = RewardRunner(f"{user}:noisy", executor="process", workers=1)
    try:
        assert [(await r.score(ROW, "x")).reward for _ in range(3)] == [0.5] * 3
        assert r.counters["workers_started"] == 1
    finally:
        await r.aclose()


async def test_math_verify_in_worker_processes_with_a_timeout() -> None:
    r = RewardRunner("math", timeout_s=3.0, workers=1)
    assert r.executor == "process"
    try:
        half = {"answer": "\\frac{1}{2}"}
        assert (await r.score(half, "The answer is $\\boxed{0.5}$")).reward == 1.0
        assert (await r.score(half, "so $x = 1/3$")).reward == 0.0
        t0 = time.monotonic()
        slow = await r.score({"answer": "1"}, "$9^{9^{9^{9}}}$")  # sympy would compute for hours
        assert slow.reward == 0.0 and time.monotonic() - t0 < 3.0  # math-verify's own timeout: a wrong answer
        assert (await r.score({"answer": "2"}, "$\\boxed{2}$")).reward == 1.0  # the worker still serves
        assert r.counters["workers_killed"] == 0
    finally:
        await r.aclose()
