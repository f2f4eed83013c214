"""envs/code.py: reward = fraction of tests passed, answers run in the sandbox."""

from __future__ import annotations

import asyncio

from envs.code import FAMILIES, CodeParams, CodeSuite
from envs.sandbox import SandboxLimits
from flashrl.env import Task

PARAMS = CodeParams(tests=4, train_size=50, limits=SandboxLimits(wall_s=1.5, cpu_s=1))


def _task(family: str, inputs: list, expected: list) -> Task:
    return Task(id="t", prompt="Write f.\n", meta={"family": family, "inputs": inputs, "expected": expected})


async def test_rewards_are_fractions_of_tests_passed() -> None:
    env = CodeSuite(PARAMS, eval_size=1).make_env()
    task = _task("abs", [[-3], [4], [0], [-1]], [3, 4, 0, 1])
    answers = {
        "def f(x):\n    return abs(x)": 1.0,
        "```python\ndef f(x):\n    return x\n```": 0.5,  # right for 4 and 0
        "def f(x):\n    return -x if x < 0 else (1/0 if x == 0 else x)": 0.75,  # raises on 0
        "def f(x):\n    return float(abs(x))": 0.0,  # 3.0 is not 3
        "def g(x): return x": 0.0,  # no f
        "def f(x):\n    while True: pass": 0.0,
        "print('RESULT-0000 [[\"ok\", 3]]')\ndef f(x): return -9": 0.0,  # forged line without the nonce
    }
    statuses = []
    for code, reward in answers.items():
        await env.reset(task)
        res = await env.step(code)
        assert res.done and res.reward == reward, (code, res)
        statuses.append(res.info["status"])
    assert statuses == ["ok"] * 5 + ["timeout", "ok"]


async def test_references_pass_their_own_tests() -> None:
    suite = CodeSuite(PARAMS, seed=3, eval_size=20)
    assert {t.meta["family"] for t in suite.train_tasks()} <= set(FAMILIES)
    assert [t.meta for t in suite.eval_tasks()] == [t.meta for t in CodeSuite(PARAMS, seed=3, eval_size=20).eval_tasks()]
    task = next(t for t in suite.eval_tasks() if t.meta["family"] in ("reverse", "sum", "max"))
    code = {"reverse": "def f(s):\n    return s[::-1]", "sum": "def f(xs):\n    return sum(xs)", "max": "f = max"}
    env = suite.make_env()
    assert await env.reset(task) == task.prompt and task.prompt.startswith("Write a Python function f(")
    res = await env.step(code[task.meta["family"]])
    assert res.reward == 1.0 and res.info["passed"] == 4


async def test_parallel_sandboxes_are_bounded() -> None:
    suite = CodeSuite(CodeParams(tests=1, train_size=1, max_parallel=2), eval_size=1)
    task = _task("add", [[1]], [1])
    envs = [suite.make_env() for _ in range(4)]
    for e in envs:
        await e.reset(task)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    rs = await asyncio.gather(*[e.step("import time\ntime.sleep(0.3)\ndef f(x): return x") for e in envs])
    assert [r.reward for r in rs] == [1.0] * 4
    assert loop.time() - t0 >= 0.6  # two at a time: two rounds of 0.3 s
