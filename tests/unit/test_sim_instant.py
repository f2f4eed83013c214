"""The instant parts (flashrl/sim/instant.py) and the overhead bench built on them."""

from __future__ import annotations

import asyncio
import gc

import pytest

from flashrl.bench.overhead import (
    GC_TUNED_THRESHOLDS,
    controller_rate,
    gc_settings,
    overhead_config,
)
from flashrl.sim.engine import EOS_ID
from flashrl.sim.envs import SimTokenizer
from flashrl.sim.instant import (
    InstantEngine,
    InstantSuite,
    InstantSuiteParams,
    InstantTrainer,
)
from flashrl.wire.protocol import Generate, WeightManifest


def test_engine_answers_with_fixed_tokens_and_loaded_version() -> None:
    async def main() -> None:
        e = InstantEngine("i0", tokens=5)
        a = await e.generate(Generate(request_id="a", prompt_ids=[7, 7], max_tokens=16))
        assert a.token_ids[-1] == EOS_ID and len(a.token_ids) == 5 and a.finish_reason == "stop"
        assert a.versions == [0] * 5 and a.logprobs == [-1.0] * 5 and a.request_id == "a"
        r = await e.update_weights(WeightManifest(version=3))
        assert r.ok and r.version == 3 and e.updates == [3]
        b = await e.generate(Generate(request_id="b", max_tokens=2))
        assert b.versions == [3, 3] and b.finish_reason == "length" and EOS_ID not in b.token_ids
        assert a.token_ids is not b.token_ids  # fresh lists per reply, as a decoded reply
        assert (e.requests, e.generated_tokens) == (2, 7)

    asyncio.run(main())


def test_engine_yields_once_and_counts_cancels() -> None:
    async def main() -> None:
        e = InstantEngine("i0", tokens=3)
        t = asyncio.get_running_loop().create_task(e.generate(Generate(request_id="x")))
        await asyncio.sleep(0)  # the request is now inside its one loop turn
        assert e.inflight == 1
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert (e.inflight, e.cancelled, e.requests) == (0, 1, 0)
        await e.abort(["x", "y"])
        assert e.aborted == 2
        await e.close()
        with pytest.raises(RuntimeError, match="closed"):
            await e.generate(Generate(request_id="z"))

    asyncio.run(main())


def test_suite_rewards_alternate_and_turns_end_the_episode() -> None:
    async def main() -> None:
        suite = InstantSuite(InstantSuiteParams(train_size=4, prompt_chars=8, obs_chars=3, turns=2))
        assert [t.id for t in suite.train_tasks()] == ["t0", "t1", "t2", "t3"] and suite.eval_tasks() == []
        rewards = []
        for task in suite.train_tasks():
            env = suite.make_env()
            assert await env.reset(task) == task.prompt and len(task.prompt) == 8
            first = await env.step("a")
            assert not first.done and first.observation == "ooo"
            last = await env.step("b")
            assert last.done
            rewards.append(last.reward)
        assert rewards == [1.0, 0.0, 1.0, 0.0] and suite.episodes == 4

    asyncio.run(main())


def test_tokenizer_cache_hands_out_fresh_lists() -> None:
    tok = SimTokenizer(cache=True)
    a = tok.encode("abc")
    a.append(99)
    assert tok.encode("abc") == [4, 5, 6]
    assert tok.decode(tok.encode("ab c")) == "ab c"


def test_real_controller_on_instant_parts_trains_every_step() -> None:
    from flashrl.controller.controller import Controller

    cfg = overhead_config(batch_prompts=4, group_size=3, engines=2, steps=3)
    suite = InstantSuite()
    engines = [InstantEngine(f"i{k}") for k in range(2)]
    trainer = InstantTrainer()

    async def main() -> None:
        summary = await Controller(cfg, SimTokenizer(cache=True), suite, engines, trainer).run()
        assert summary.steps == 3 and summary.samples_trained == 36

    asyncio.run(main())
    assert trainer.batch_sizes == [12, 12, 12]
    assert all(e.updates == [1, 2, 3] for e in engines)
    assert min(e.requests for e in engines) > 0  # replication spreads samples over both engines
    # async ratio 2: up to 2 batches more than trained were generated (never trained at the end)
    assert 36 <= suite.episodes <= 36 + 2 * 12


def test_controller_rate_counts_generated_and_trained() -> None:
    r = controller_rate(8, 4, 2, 4, turns=2)
    assert r["trained"] == 8 * 4 * 4
    assert r["trained"] <= r["generated"] <= r["trained"] + 2 * 32
    assert r["requests"] >= 2 * r["generated"]  # 2 turns per finished sample (+ unfinished ones at shutdown)
    assert r["generated_per_cpu_s"] == pytest.approx(r["generated"] / r["cpu_s"])
    assert 0 < r["fixture_us_per_sample"] < r["cpu_us_per_generated"]
    assert r["controller_us_per_generated"] == pytest.approx(r["cpu_us_per_generated"] - r["fixture_us_per_sample"])


def test_gc_settings_restore_the_interpreter() -> None:
    before = gc.get_threshold()
    with gc_settings("tuned"):
        assert gc.get_threshold() == GC_TUNED_THRESHOLDS
        gc.freeze()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_profile_names_the_controller_hot_spots() -> None:
    import os

    from flashrl.bench.overhead import profile_controller

    text = profile_controller(8, 4, 2, 2, top=5)
    assert text.startswith("controller run 8x4, 2 engines, 2 steps:")
    assert "flashrl/controller/rollout.py" in text and "own time per file" in text
    assert os.getcwd() + "/" not in text  # repository-relative paths
