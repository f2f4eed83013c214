"""envs/remote.py: envs in worker processes; dead and hung workers are replaced; no pickle."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from envs import make_suite
from envs.remote import RemoteSuite
from flashrl.env import EnvFailure, Task

TASK = Task(id="g", prompt="Guess 0-9:\n", answer="6")


def _suite(**kw) -> RemoteSuite:
    params = {"inner": "guess", "workers": 2, "call_timeout_s": 5.0, "startup_timeout_s": 30.0} | kw
    return make_suite("remote", params, 0, 4)


async def _wait_for(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.05)


async def test_episode_crash_replacement_timeout_and_forwarded_failures() -> None:
    suite = _suite(params={"faults": {"delay": {"kind": "constant", "seconds": 0.3}}}, call_timeout_s=2.0)
    try:
        assert [t.answer for t in suite.eval_tasks()] == [t.answer for t in make_suite("guess", {}, 0, 4).eval_tasks()]
        # A whole episode over the wire (the faults sub-table acts inside the workers).
        env = suite.make_env()
        assert await env.reset(TASK) == TASK.prompt
        r = await env.step("3")
        assert (r.observation, r.done) == (" higher\n", False)
        r = await env.step("6")
        assert r.done and r.reward == pytest.approx(0.9) and r.info["found"] is True
        assert len(suite.pool.pids) == 2

        # The worker dies mid-call: EnvFailure("crash"), the slot gets a new process, the next call works.
        await env.reset(TASK)
        victim = env.worker.proc.pid
        step = asyncio.create_task(env.step("1"))
        await asyncio.sleep(0.1)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(EnvFailure) as e:
            await step
        assert e.value.reason == "crash"
        await _wait_for(lambda: len(suite.pool.pids) == 2 and victim not in suite.pool.pids)
        assert suite.counters["restarts"] == 1
        assert await env.reset(TASK) == TASK.prompt
        assert (await env.step("6")).reward == 1.0  # found on the first guess

        # The caller's own deadline (asyncio.wait_for) still works through the wire.
        await env.reset(TASK)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(env.step("2"), 0.05)
    finally:
        await suite.aclose()
    assert suite.pool.pids == []


async def test_call_past_its_timeout_kills_and_replaces_the_worker() -> None:
    suite = _suite(workers=1, call_timeout_s=0.5, params={"faults": {"hang": 1.0}})
    try:
        env = suite.make_env()
        loop = asyncio.get_running_loop()
        await suite.pool.start()
        await _wait_for(lambda: len(suite.pool.pids) == 1)
        first = suite.pool.pids[0]
        t0 = loop.time()
        with pytest.raises(EnvFailure) as e:
            await env.reset(TASK)
        assert e.value.reason == "timeout" and loop.time() - t0 < 5.0
        await _wait_for(lambda: suite.pool.pids not in ([], [first]))
        assert suite.counters["killed:timeout"] == 1
    finally:
        await suite.aclose()


async def test_inner_failures_and_garbage_are_forwarded_with_their_reason() -> None:
    suite = _suite(workers=1, params={"faults": {"crash": 1.0}})
    try:
        with pytest.raises(EnvFailure) as e:
            await suite.make_env().reset(TASK)
        assert e.value.reason == "crash"
        assert len(suite.pool.pids) == 1 and suite.counters["exits"] == 0  # the worker itself is fine
    finally:
        await suite.aclose()
    suite = _suite(workers=1, params={"faults": {"garbage": 1.0}})
    try:
        with pytest.raises(EnvFailure) as e:
            await suite.make_env().reset(TASK)
        assert e.value.reason == "garbage" and "observation rejected" in str(e.value)
    finally:
        await suite.aclose()


async def test_exit_fault_ends_only_the_worker() -> None:
    suite = _suite(workers=1, params={"faults": {"exit": 1.0}})
    try:
        await suite.pool.start()
        await _wait_for(lambda: len(suite.pool.pids) == 1)
        first = suite.pool.pids[0]
        with pytest.raises(EnvFailure) as e:
            await suite.make_env().reset(TASK)
        assert e.value.reason == "crash"
        await _wait_for(lambda: suite.pool.pids not in ([], [first]))
    finally:
        await suite.aclose()
