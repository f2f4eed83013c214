"""envs/faults.py: delays, hangs caught by the caller's deadline, crashes, garbage rejected and counted."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from envs import make_suite
from envs.faults import (
    ConstantDelay,
    FaultParams,
    FaultyEnv,
    FaultySuite,
    LognormalDelay,
    UniformDelay,
    draw_delay,
    validate_observation,
)
from flashrl.env import EnvFailure, StepResult, Task


class _Echo:
    """A tiny inner env: the observation is whatever the action says (to feed the validator)."""

    async def reset(self, task: Task) -> str:
        return task.prompt

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=action, done=False)

    async def close(self) -> None:
        pass


TASK = Task(id="t", prompt="hello\n")


def test_validate_observation_reasons() -> None:
    assert validate_observation("ok text\n\twith tab", 100) is None
    assert validate_observation("x" * 101, 100) == "too_long"
    assert validate_observation("bell\x07", 100) == "non_printable"
    assert validate_observation("nul\x00", 100) == "non_printable"
    assert validate_observation("\ud800", 100) == "non_printable"  # lone surrogate
    assert validate_observation(b"bytes", 100) == "not_text"


def test_delay_distributions_are_seeded_and_have_the_asked_mean() -> None:
    d = LognormalDelay(mean_s=0.5, sigma=1.0)
    a = [draw_delay(d, random.Random(3)) for _ in range(3)]
    assert a == [draw_delay(d, random.Random(3)) for _ in range(3)]
    rng = random.Random(0)
    xs = [draw_delay(d, rng) for _ in range(20000)]
    assert abs(sum(xs) / len(xs) - 0.5) < 0.03
    assert max(xs) > 4 * 0.5  # heavy tail
    assert draw_delay(ConstantDelay(seconds=0.25), rng) == 0.25
    ys = [draw_delay(UniformDelay(low_s=1.0, high_s=2.0, max_s=1.5), rng) for _ in range(1000)]
    assert min(ys) >= 1.0 and max(ys) == 1.5  # capped by max_s
    assert draw_delay(None, rng) == 0.0


async def test_hanging_env_hits_the_callers_deadline() -> None:
    env = FaultyEnv(_Echo(), FaultParams(hang=1.0), random.Random(0))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(env.reset(TASK), 0.01)
    assert loop.time() - t0 < 0.5
    assert env.counters["hang"] == 1


async def test_crash_raises_env_failure() -> None:
    env = FaultyEnv(_Echo(), FaultParams(crash=1.0), random.Random(0))
    with pytest.raises(EnvFailure) as e:
        await env.step("x")
    assert e.value.reason == "crash"


async def test_exit_fault_refuses_to_end_the_controller() -> None:
    env = FaultyEnv(_Echo(), FaultParams(exit=1.0), random.Random(0))
    with pytest.raises(EnvFailure, match="outside a remote worker"):
        await env.step("x")


async def test_garbage_is_rejected_and_counted_by_reason() -> None:
    counters: Counter[str] = Counter()
    env = FaultyEnv(_Echo(), FaultParams(garbage=1.0, max_obs_chars=64), random.Random(1), counters)
    reasons = []
    for _ in range(20):
        with pytest.raises(EnvFailure) as e:
            await env.step("fine")
        assert e.value.reason == "garbage"
        reasons.append(e.value.detail.split(": ")[-1])
    assert set(reasons) == {"non_printable", "too_long"}
    assert counters["garbage"] == 20
    assert counters["rejected:non_printable"] + counters["rejected:too_long"] == 20
    assert counters["rejected:non_printable"] == reasons.count("non_printable")
    # Garbage from the inner env itself (nothing injected) is rejected the same way.
    clean = FaultyEnv(_Echo(), FaultParams(max_obs_chars=64), random.Random(1), counters)
    with pytest.raises(EnvFailure, match="non_printable"):
        await clean.step("esc \x1b[2J")
    assert (await clean.step("fine")).observation == "fine"


async def test_fault_rates_are_respected() -> None:
    env = FaultyEnv(_Echo(), FaultParams(crash=0.2, garbage=0.1), random.Random(7))
    outcome: Counter[str] = Counter()
    for _ in range(2000):
        try:
            await env.step("a")
            outcome["ok"] += 1
        except EnvFailure as e:
            outcome[e.reason] += 1
    assert 340 < outcome["crash"] < 460 and 150 < outcome["garbage"] < 250
    assert env.counters["calls"] == 2000


async def test_delay_is_applied_per_call() -> None:
    env = FaultyEnv(_Echo(), FaultParams(delay=ConstantDelay(seconds=0.05)), random.Random(0))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await env.reset(TASK)
    await env.step("a")
    assert 0.1 <= loop.time() - t0 < 0.5
    assert env.counters["delay_s"] == pytest.approx(0.1)


def test_faults_subtable_wraps_any_env_and_errors_name_the_key() -> None:
    suite = make_suite("guess", {"max_number": 5, "faults": {"delay": {"kind": "uniform", "low_s": 0, "high_s": 0.1}, "crash": 0.5}}, 0, 4)
    assert isinstance(suite, FaultySuite)
    assert suite.params.crash == 0.5 and isinstance(suite.params.delay, UniformDelay)
    assert [t.answer for t in suite.eval_tasks()] == [t.answer for t in make_suite("guess", {"max_number": 5}, 0, 4).eval_tasks()]
    with pytest.raises(ValueError, match=r"env.params.faults.*hang"):
        make_suite("guess", {"faults": {"hang": 2.0}}, 0, 4)
    with pytest.raises(ValueError, match=r"env.params.faults.*kind"):
        make_suite("guess", {"faults": {"delay": {"kind": "pareto"}}}, 0, 4)
    with pytest.raises(ValueError, match="exceeds 1"):
        make_suite("guess", {"faults": {"hang": 0.6, "crash": 0.6}}, 0, 4)
    with pytest.raises(ValueError, match=r"env.params.faults.*unknown field `hnag`"):
        make_suite("guess", {"faults": {"hnag": 0.1}}, 0, 4)
