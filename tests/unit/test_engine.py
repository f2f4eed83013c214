"""The engine process, the parts that need no process: options, the spec it reads, load accounting.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_engine_process.py."""

from __future__ import annotations

import os

import pytest

from flashrl.engine.client import (
    engine_env,
    engine_extra_env,
)
from flashrl.engine.load import LoadMeter
from flashrl.engine.server import EngineSpec
from flashrl.wire.spec import SPEC_ENV, read_spec


def test_engine_env_carries_the_spec() -> None:
    """The EngineSpec travels as JSON in FLASHRL_SPEC (flashrl/wire/spec.py) and decodes back equal."""
    opts = EngineSpec(address="tcp://127.0.0.1:5", model="/m", name="e3", kv_cache_gib=0.25, threads=2, seed=9)
    env = engine_extra_env(opts)
    assert read_spec(EngineSpec, env) == opts and SPEC_ENV not in env  # read once, then gone


def test_engine_env_sizes_threads_and_unpins() -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "4"
    try:
        env = engine_env(EngineSpec(address="tcp://127.0.0.1:5", model="/m", threads=3), {"EXTRA": "1"})
    finally:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["EXTRA"] == "1"


def test_load_meter_busy_fraction_and_rates() -> None:
    m = LoadMeter(now=0.0)
    m.request_started(1.0)
    m.request_started(2.0)
    m.request_finished(3.0)
    m.request_finished(4.0)  # busy 1..4
    m.tokens(30)
    rep = m.report(10.0, "e", 2)
    assert rep.busy_fraction == pytest.approx(0.3) and rep.tokens_per_s == pytest.approx(3.0)
    assert (rep.running, rep.waiting, rep.generated_tokens, rep.version) == (0, 0, 30, 2)
    m.request_started(12.0)  # still running at the next report: counted up to it, then carried on
    m.scheduler(running=1, waiting=0, kv_usage=0.5)
    rep = m.report(20.0, "e", 2)
    assert rep.busy_fraction == pytest.approx(0.8) and rep.tokens_per_s == 0.0 and rep.running == 1
    m.request_finished(25.0)
    assert m.report(30.0, "e", 2).busy_fraction == pytest.approx(0.5)
