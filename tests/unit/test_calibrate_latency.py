"""Calibration reads a tool env's latency: envs/tools.py's [latency] (median/p99, tool calls only), also
inside ``remote``, as the simulated env's delay; and the simulated env skips the delay on the answer."""

from __future__ import annotations

import math

import pytest

from flashrl.bench.calibrate import inner_env, sim_delay
from flashrl.config import Config, from_dict
from flashrl.sim.clock import run_virtual
from flashrl.sim.envs import DelayModel, SimEnvParams, SimSuite

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def _tools_cfg(latency: dict, faults: dict | None = None, remote: bool = True) -> Config:
    inner = {"min_operand": 10, "max_operand": 99, "max_turns": 3, "latency": latency, "faults": faults or {}}
    env = {"name": "remote", "params": {"inner": "tools", "workers": 2, "params": inner}} if remote else {"name": "tools", "params": inner}
    return from_dict({"model": {"path": "builtin:tiny"}, "env": env})


@pytest.mark.parametrize("remote", [True, False])
def test_tools_latency_becomes_the_simulated_delay_on_tool_calls_only(remote: bool) -> None:
    cfg = _tools_cfg({"median_s": 0.05, "p99_s": 0.5, "max_s": 4.0}, remote=remote)
    assert inner_env(cfg)[0] == "tools"
    d = sim_delay(cfg)
    assert d["delay"]["median_s"] == pytest.approx(0.05)
    assert d["delay"]["sigma"] == pytest.approx(math.log(10) / Z99, rel=1e-6)
    assert d["delay"]["max_s"] == 4.0
    assert d["reset_delay"] is False and d["answer_delay"] is False  # reset and the answer wait nothing
    # the fitted lognormal's 99th percentile is the configured p99
    m = DelayModel(**d["delay"])
    assert m.draw(0.99) == pytest.approx(0.5, rel=1e-6) and m.draw(0.5) == pytest.approx(0.05)


def test_no_latency_no_delay_and_faults_delay_every_call() -> None:
    assert sim_delay(_tools_cfg({"median_s": 0.0, "p99_s": 0.0})) == {}
    cfg = _tools_cfg({"median_s": 0.0, "p99_s": 0.0}, {"delay": {"kind": "lognormal", "mean_s": 0.2, "sigma": 1.0, "max_s": 3.0}})
    d = sim_delay(cfg)
    assert d["delay"] == {"median_s": pytest.approx(0.2 * math.exp(-0.5)), "sigma": 1.0, "max_s": 3.0}
    assert d["reset_delay"] is True and d["answer_delay"] is True


def test_both_latency_and_faults_delay_is_refused_by_name() -> None:
    cfg = _tools_cfg({"median_s": 0.2, "p99_s": 2.0}, {"delay": {"kind": "constant", "seconds": 0.1}})
    with pytest.raises(ValueError, match="both a \\[faults\\] delay and a tool \\[latency\\]"):
        sim_delay(cfg)


@pytest.mark.parametrize("answer_delay", [True, False])
def test_sim_env_answer_delay(answer_delay: bool) -> None:
    """Two turns of constant 1 s delay: 2 s with the answer delayed, 1 s (the tool call only) without."""
    suite = SimSuite(SimEnvParams(turns_min=2, turns_max=2, delay=DelayModel(median_s=1.0), answer_delay=answer_delay))

    async def episode() -> bool:
        env = suite.make_env()
        await env.reset(suite.train_tasks()[0])
        first = await env.step("calc")
        last = await env.step("answer")
        return not first.done and last.done

    run = run_virtual(episode)
    assert run.result
    assert run.virtual_s == pytest.approx(2.0 if answer_delay else 1.0)


def test_sim_env_turns_mean_gives_that_mean() -> None:
    """turns_mean 1.66: episodes of 1 or 2 turns, 66% of them 2 (what calibration takes from a measured run)."""
    suite = SimSuite(SimEnvParams(turns_mean=1.66, train_size=4000))
    turns = [t.meta["turns"] for t in suite.train_tasks()]
    assert set(turns) == {1, 2}
    assert sum(turns) / len(turns) == pytest.approx(1.66, abs=0.02)
    assert {t.meta["turns"] for t in SimSuite(SimEnvParams(turns_mean=3.0)).train_tasks()} == {3}
