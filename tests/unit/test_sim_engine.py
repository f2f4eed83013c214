"""SimEngine, SimTrainer and the sim environments against hand-computed virtual times."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from flashrl.env import EnvFailure
from flashrl.sim.clock import run_virtual
from flashrl.sim.engine import LatencyModel, LengthModel, SimEngine, steps_within, uniform
from flashrl.sim.envs import DelayModel, SimEnvParams, SimSuite, SimTokenizer
from flashrl.sim.trainer import SimTrainer, TrainerModel
from flashrl.wire.protocol import Generate, TrainBatch, WeightManifest
from flashrl.wire.trajectory import Trajectory

LAT = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.001, prefill_per_token_s=0.0001, max_num_seqs=2, weight_load_s=0.5)


def const(n: int) -> LengthModel:
    return LengthModel(dist="constant", median=n)


def req(i: int, prompt: int = 10, max_tokens: int = 1000) -> Generate:
    return Generate(request_id=f"r{i}", prompt_ids=[5] * prompt, max_tokens=max_tokens)


def test_one_request_takes_prefill_plus_its_decode_steps() -> None:
    async def main() -> tuple[float, list[int], str]:
        eng = SimEngine("e0", LAT, const(100))
        out = await eng.generate(req(0, prompt=10))
        return asyncio.get_running_loop().time(), out.token_ids, out.finish_reason

    t, ids, reason = run_virtual(main).result
    assert t == pytest.approx(10 * 0.0001 + 100 * (0.01 + 0.001))
    assert len(ids) == 100 and ids[-1] == 2 and reason == "stop"


def test_max_tokens_cuts_with_length() -> None:
    async def main() -> tuple[int, str]:
        out = await SimEngine("e0", LAT, const(100)).generate(req(0, max_tokens=40))
        return len(out.token_ids), out.finish_reason

    assert run_virtual(main).result == (40, "length")


def test_batch_capacity_queues_the_third_request() -> None:
    # max_num_seqs=2: r0 and r1 decode together (step 0.012 s), r2 waits for a free slot.
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        eng = SimEngine("e0", LAT, const(50))
        done: list[tuple[str, float]] = []

        async def one(i: int) -> None:
            out = await eng.generate(req(i, prompt=0))
            done.append((out.request_id, loop.time()))

        await asyncio.gather(*(one(i) for i in range(3)))
        return done

    done = run_virtual(main).result
    t_pair = 50 * 0.012
    assert [r for r, _ in done] == ["r0", "r1", "r2"]
    assert done[0][1] == pytest.approx(t_pair) and done[1][1] == pytest.approx(t_pair)
    assert done[2][1] == pytest.approx(t_pair + 50 * 0.011)


def test_a_late_arrival_joins_at_the_next_step_boundary() -> None:
    # r0 alone: steps of 0.011 s. r1 arrives at 0.0305 s, mid step 3; it joins at 0.033 s.
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        eng = SimEngine("e0", LAT, const(10))
        t0 = asyncio.ensure_future(eng.generate(req(0, prompt=0)))
        await asyncio.sleep(0.0305)
        out1 = await eng.generate(req(1, prompt=0))
        t1 = loop.time()
        await t0
        assert len(out1.token_ids) == 10
        return t1, eng.busy_s

    t1, busy = run_virtual(main).result
    # 3 solo steps (0.033), then 7 steps of 2 (r0 finishes at 0.033 + 7 * 0.012), then r1 alone 3 steps
    assert t1 == pytest.approx(0.033 + 7 * 0.012 + 3 * 0.011)
    assert busy == pytest.approx(t1)


def test_attention_cost_grows_with_context() -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.0, decode_per_kv_token_s=1e-5, prefill_per_token_s=0.0)

    async def main() -> float:
        await SimEngine("e0", lat, const(200)).generate(req(0, prompt=100))
        return asyncio.get_running_loop().time()

    t = run_virtual(main).result
    assert t == pytest.approx(sum(0.01 + 1e-5 * (100 + j) for j in range(200)))


def test_steps_within_inverts_the_step_time_sum() -> None:
    for prefill, a, c in [(0.0, 0.01, 0.0), (0.3, 0.012, 1e-4), (0.0, 0.001, 2e-3)]:
        for k in (1, 7, 100):
            for j in range(k + 1):
                t = prefill + j * a + c * j * (j - 1) / 2
                assert steps_within(prefill, a, c, t + 1e-12, k) == j
                if j > 0:
                    assert steps_within(prefill, a, c, t - 1e-9, k) == j - 1


def test_weight_update_pauses_and_versions_tokens() -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0, weight_load_s=0.5)

    async def main() -> tuple[list[int], float, float]:
        eng = SimEngine("e0", lat, const(100))
        gen = asyncio.ensure_future(eng.generate(req(0, prompt=0)))
        await asyncio.sleep(0.305)  # mid step 31
        upd = await eng.update_weights(WeightManifest(version=1))
        out = await gen
        return out.versions, upd.seconds, asyncio.get_running_loop().time()

    versions, seconds, t = run_virtual(main).result
    assert versions == [0] * 31 + [1] * 69  # the step in progress finished on the old weights
    assert seconds == pytest.approx(0.005 + 0.5)
    assert t == pytest.approx(1.0 + 0.5)


def test_abort_returns_the_tokens_so_far() -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0)

    async def main() -> tuple[int, str, int]:
        eng = SimEngine("e0", lat, const(100))
        gen = asyncio.ensure_future(eng.generate(req(0, prompt=0)))
        await asyncio.sleep(0.2)
        await eng.abort(["r0"])
        out = await gen
        return len(out.token_ids), out.finish_reason, eng.inflight

    n, reason, inflight = run_virtual(main).result
    assert reason == "abort" and inflight == 0
    assert n in (20, 21)  # at the boundary of step 20: the step may be counted either side


def test_cancelled_generate_frees_its_slot() -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0, max_num_seqs=1)

    async def main() -> float:
        eng = SimEngine("e0", lat, const(100))
        first = asyncio.ensure_future(eng.generate(req(0, prompt=0)))
        await asyncio.sleep(0.1)
        first.cancel()
        await eng.generate(req(1, prompt=0))
        return asyncio.get_running_loop().time()

    t = run_virtual(main).result
    assert t == pytest.approx(0.1 + 1.0)


def test_lengths_are_a_function_of_the_request_and_long_tailed() -> None:
    lengths = LengthModel(dist="lognormal", median=500, sigma=1.0)

    async def main() -> list[int]:
        a = SimEngine("a", LatencyModel(max_num_seqs=4096), lengths, seed=3)
        b = SimEngine("b", LatencyModel(max_num_seqs=4096), lengths, seed=3)
        outs_a = await asyncio.gather(*(a.generate(req(i, max_tokens=1 << 20)) for i in range(1024)))
        outs_b = await asyncio.gather(*(b.generate(req(i, max_tokens=1 << 20)) for i in reversed(range(1024))))
        la = [len(o.token_ids) for o in outs_a]
        lb = [len(o.token_ids) for o in reversed(outs_b)]
        assert la == lb  # routing or order does not change a sample
        return la

    la = run_virtual(main).result
    med = statistics.median(la)
    assert 430 < med < 570
    assert max(la) > 20 * med  # the long tail the H100 latency profile describes


def test_kv_capacity_holds_requests_back() -> None:
    lat = LatencyModel(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0, kv_tokens=150)

    async def main() -> float:
        eng = SimEngine("e0", lat, const(100))
        await asyncio.gather(eng.generate(req(0, prompt=0)), eng.generate(req(1, prompt=0)))
        return asyncio.get_running_loop().time()

    assert run_virtual(main).result == pytest.approx(2.0)  # 100 + 100 tokens do not fit in 150: serial
    with pytest.raises(ValueError, match="raise latency.kv_tokens"):
        run_virtual(lambda: SimEngine("e0", lat, const(200)).generate(req(0, prompt=0)))


def test_trainer_time_and_staleness() -> None:
    model = TrainerModel(step_fixed_s=1.0, per_token_s=0.01, gpus=2, prepare_weights_s=0.25, send_weights_s=0.5)

    async def main() -> tuple[float, int, float]:
        tr = SimTrainer(model)
        s = Trajectory(prompt_ids=[1] * 10, response_ids=[1] * 90, loss_mask=[1] * 90, behav_logp=[0.0] * 90, versions=[0] * 90, reward=1.0, group=0)
        await tr.train_step(TrainBatch(step=0, samples=[s, s]))
        t_train = asyncio.get_running_loop().time()
        await tr.prepare_weights(1)
        await tr.send_weights(1)
        s2 = Trajectory(prompt_ids=[], response_ids=[1] * 4, loss_mask=[1, 1, 0, 1], behav_logp=[0.0] * 4, versions=[0, 1, -1, 1], reward=0.0, group=1)
        res = await tr.train_step(TrainBatch(step=1, samples=[s2]))
        return t_train, tr.history[1].staleness_max, res.metrics["staleness/mean"]

    run = run_virtual(main)
    t_train, smax, smean = run.result
    virtual = run.virtual_s
    assert t_train == pytest.approx(1.0 + 0.01 * 200 / 2)
    assert smax == 1 and smean == pytest.approx(1 / 3)
    assert virtual == pytest.approx(t_train + 0.75 + 1.0 + 0.01 * 4 / 2)


def test_env_delays_failures_and_turns_are_deterministic() -> None:
    params = SimEnvParams(
        train_size=64, turns_min=2, turns_max=2, delay=DelayModel(median_s=1.0, sigma=0.0),
        fail_stop_rate=0.3, fail_slow_rate=0.3, slow_factor=5.0,
    )

    def episode_trace() -> list[tuple[str, float]]:
        async def main() -> list[tuple[str, float]]:
            loop = asyncio.get_running_loop()
            suite = SimSuite(params, seed=1)
            out = []
            for task in suite.train_tasks()[:32]:
                env = suite.make_env()
                await env.reset(task)
                t0 = loop.time()
                try:
                    while not (await env.step("abc")).done:
                        pass
                    out.append(("ok", loop.time() - t0))
                except EnvFailure as e:
                    out.append((e.reason, loop.time() - t0))
            return out

        return run_virtual(main).result

    a = episode_trace()
    assert a == episode_trace()
    kinds = {k for k, _ in a}
    assert kinds == {"ok", "crash"}
    # every step takes 1 s or 5 s (slow): an ok episode of 2 turns takes 2, 6 or 10 s
    assert {d for k, d in a if k == "ok"} <= {2.0, 6.0, 10.0}
    assert len({d for k, d in a if k == "ok"}) >= 2


def test_env_failure_rate_matches() -> None:
    suite = SimSuite(SimEnvParams(fail_stop_rate=0.2), seed=0)
    hits = sum(uniform(suite.seed, f"t{i}|1|x|0".encode(), b"stop") < 0.2 for i in range(5000))
    assert 900 < hits < 1100


def test_tokenizer_round_trip() -> None:
    tok = SimTokenizer()
    text = "t12: qqq obs ."
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([2]) == ""  # EOS prints nothing
