"""envs/tools.py in the remote worker pool (envs/remote.py): tool calls with their latency over the wire,
and a worker that exits mid-call (the injectable "exit" fault) replaced while the episode fails "crash"."""

from __future__ import annotations

import asyncio
import time

import pytest

from envs import make_suite
from envs.remote import RemoteSuite
from flashrl.env import EnvFailure, Task

TASK = Task(id="x", prompt="37*48=", answer="1776")


def _suite(**inner) -> RemoteSuite:
    params = {"inner": "tools", "workers": 2, "call_timeout_s": 10.0, "startup_timeout_s": 60.0,
              "params": {"latency": {"median_s": 0.2, "p99_s": 2.0, "max_s": 3.0}} | inner}
    return make_suite("remote", params, 0, 10)


async def test_tool_episodes_in_worker_processes() -> None:
    suite = _suite()
    try:
        local = make_suite("tools", {}, 0, 10)
        assert suite.eval_tasks() == local.eval_tasks()
        env = suite.make_env()
        assert await env.reset(TASK) == TASK.prompt
        t0 = time.monotonic()
        r = await env.step("calc(37*48)")
        assert (r.observation, r.done) == ("=1776\n", False)
        assert 0.0 < time.monotonic() - t0 < 3.5  # the drawn latency, capped at max_s, plus the wire
        r = await env.step("1776")
        assert r.done and r.reward == 1.0 and r.info["metrics"]["called"] == 1.0
        # many episodes at once: the latencies overlap (the workers serve sessions concurrently)
        envs = [suite.make_env() for _ in range(16)]

        async def episode(e):
            await e.reset(TASK)
            await e.step("calc(37*48)")
            return (await e.step("1776")).reward

        t0 = time.monotonic()
        assert await asyncio.gather(*(episode(e) for e in envs)) == [1.0] * 16
        assert time.monotonic() - t0 < 8.0  # not 16 calls back to back (median 0.2 s, some capped at 3 s)
    finally:
        await suite.aclose()


async def test_a_worker_exit_fails_the_call_and_is_replaced() -> None:
    suite = _suite(latency={"median_s": 0.0, "p99_s": 0.0}, faults={"exit": 1.0})
    try:
        env = suite.make_env()
        with pytest.raises(EnvFailure) as e:
            await env.reset(TASK)  # the fault fires on the first call: the worker process exits
        assert e.value.reason == "crash"
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while suite.counters["restarts"] < 1:
            assert loop.time() < end, "the pool did not replace the exited worker"
            await asyncio.sleep(0.05)
    finally:
        await suite.aclose()
