"""Rollout coroutines on fakes, on a virtual clock (flashrl.sim.clock.run_virtual): times are exact."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import anyio
import msgspec
import pytest

from flashrl.config import Config
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.group import run_group
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.controller.types import Trajectory
from flashrl.core.staleness import Staleness
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeSuite, FakeTokenizer
from flashrl.wire.protocol import Generate, TrainBatch

TOK = FakeTokenizer()


def config(**sections: Any) -> Config:
    return msgspec.convert(sections, Config)


def make_ctx(cfg: Config, engines: list[FakeEngine], suite: FakeSuite) -> RolloutContext:
    return RolloutContext(
        cfg=cfg,
        tokenizer=TOK,
        suite=suite,
        engines=engines,
        router=Router(len(engines), cfg.engine.max_num_seqs),
        version=lambda: 0,
    )


def by_index(durations: list[float], token: str = "7") -> Any:
    """Script: sample index k (request id "<uid>-<k>.<attempt>.<turn>") takes durations[k] seconds."""

    def script(req: Generate, version: int) -> tuple[list[int], float]:
        k = int(req.request_id.split(".")[0].split("-")[-1])
        return [ord(token)], durations[k]

    return script


async def group(ctx: RolloutContext, need: int, extra: int = 0, uid: int = 0) -> tuple[bool, list[Trajectory]]:
    out: list[Trajectory] = []
    task = ctx.suite.train_tasks()[uid]
    ok = await run_group(ctx, task=task, group=uid, need=need, first_index=0, extra=extra, temperature=1.0, on_sample=out.append)
    return ok, out


def test_multi_turn_concatenates_token_ids_with_masks() -> None:
    def script(req: Generate, version: int) -> tuple[list[int], float]:
        turn = int(req.request_id.split(".")[-1])
        return (TOK.encode("3") if turn == 2 else TOK.encode(f"a{turn}")), 1.0

    cfg = config(rollout={"max_turns": 4, "max_new_tokens": 4}, model={"max_model_len": 64})
    eng = FakeEngine("e0", script)
    suite = FakeSuite(turns=3)
    ctx = make_ctx(cfg, [eng], suite)
    task = suite.train_tasks()[3]  # prompt "t3?", answer "3"
    spec = RolloutSpec(task=task, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    t = run_virtual(lambda: run_sample(ctx, spec, 0)).result
    g0, o1, g1, o2, g2 = TOK.encode("a0"), TOK.encode(" obs1 "), TOK.encode("a1"), TOK.encode(" obs2 "), TOK.encode("3")
    assert t.status == "ok" and t.turns == 3 and t.finish_reason == "stop"
    assert t.prompt_ids == TOK.encode("t3?")
    assert t.response_ids == g0 + o1 + g1 + o2 + g2
    assert t.loss_mask == [1] * 2 + [0] * len(o1) + [1] * 2 + [0] * len(o2) + [1]
    assert all(lp == 0.0 for lp, m in zip(t.behav_logp, t.loss_mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(t.behav_logp, t.loss_mask) if m)
    assert [v for v, m in zip(t.versions, t.loss_mask) if not m] == [-1] * (len(o1) + len(o2))
    # token in, token out: turn 2's prompt is exactly the previous ids, never re-tokenized text
    assert eng.requests[1].prompt_ids == t.prompt_ids + g0 + o1
    assert eng.requests[2].prompt_ids == t.prompt_ids + g0 + o1 + g1 + o2
    assert len({r.seed for r in eng.requests}) == 3  # one seed per turn
    assert t.reward == 1.0 and t.correct
    assert t.gen_s == 3.0 and suite.closed == suite.opened == 1
    (s,) = msgspec.msgpack.decode(msgspec.msgpack.encode(TrainBatch(step=0, samples=[t])), type=TrainBatch).samples
    assert s == t  # the record itself reaches the trainer
    assert (s.response_ids, s.loss_mask, s.versions, s.group, s.sample_id) == (t.response_ids, t.loss_mask, t.versions, 0, "0-0")


def test_turn_and_length_limits() -> None:
    cfg = config(rollout={"max_turns": 2, "max_new_tokens": 8}, model={"max_model_len": 64})
    eng = FakeEngine("e0", lambda req, v: ([ord("x")] * 3, 1.0))
    ctx = make_ctx(cfg, [eng], FakeSuite(turns=5))
    ok, out = run_virtual(lambda: group(ctx, 1)).result
    assert ok and out[0].finish_reason == "max_turns" and out[0].turns == 2
    assert out[0].loss_mask[-3:] == [1, 1, 1]  # no observation after the last turn

    cfg = config(rollout={"max_turns": 50, "max_new_tokens": 8}, model={"max_model_len": 20})
    eng = FakeEngine("e0", lambda req, v: ([ord("x")] * req.max_tokens, 1.0))
    ctx = make_ctx(cfg, [eng], FakeSuite(turns=50))
    ok, out = run_virtual(lambda: group(ctx, 1)).result
    t = out[0]
    assert ok and t.finish_reason == "max_model_len"
    assert len(t.prompt_ids) + len(t.response_ids) == 20
    assert all(len(r.prompt_ids) + r.max_tokens <= 20 for r in eng.requests)


def test_redundancy_keeps_first_finishers_and_aborts_the_rest() -> None:
    cfg = config(scheduler={"replication": True})
    engines = [FakeEngine("e0", by_index([4, 1, 3, 2])), FakeEngine("e1", by_index([4, 1, 3, 2]))]
    suite = FakeSuite()
    ctx = make_ctx(cfg, engines, suite)

    async def main() -> tuple[bool, list[Trajectory], float]:
        ok, out = await group(ctx, need=2, extra=2)
        return ok, out, anyio.current_time()

    ok, out, t = run_virtual(main).result
    assert ok and [x.index for x in out] == [1, 3]  # finish order
    assert t == 2.0  # did not wait for the slow ones
    aborted = sorted(engines[0].aborted + engines[1].aborted)
    assert aborted == ["0-0.0.0", "0-2.0.0"]
    assert ctx.counters["rollout/aborted_redundant"] == 2
    assert ctx.router.inflight == [0, 0] and [e.inflight for e in engines] == [0, 0]
    assert ctx.live == {} and suite.closed == suite.opened == 4


@pytest.mark.parametrize("replication,expected", [(True, [4, 4, 4, 4]), (False, [8, 8, 0, 0])])
def test_replication_spreads_requests(replication: bool, expected: list[int]) -> None:
    cfg = config(scheduler={"replication": replication})
    engines = [FakeEngine(f"e{i}") for i in range(4)]
    ctx = make_ctx(cfg, engines, FakeSuite())

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(group, ctx, 8, 0, 0)
            tg.start_soon(group, ctx, 8, 0, 1)

    run_virtual(main)
    assert [len(e.requests) for e in engines] == expected
    if not replication:
        assert {r.request_id.split("-")[0] for r in engines[0].requests} == {"0"}


def test_env_failure_is_retried_and_counted() -> None:
    cfg = config(rollout={"max_retries": 2})
    suite = FakeSuite(fail=lambda task, call: "crash" if call == 0 else None)
    ctx = make_ctx(cfg, [FakeEngine("e0"), FakeEngine("e1")], suite)
    ok, out = run_virtual(lambda: group(ctx, need=3)).result
    assert ok and len(out) == 3
    # the three samples share one task: only the first env.step of that task fails
    assert ctx.counters["rollout/retry_env_crash"] == 1
    assert sorted(t.attempts for t in out) == [1, 1, 2]
    assert suite.closed == suite.opened == 4


def test_retries_exhausted_make_the_group_unfillable() -> None:
    cfg = config(rollout={"max_retries": 1})
    suite = FakeSuite(fail=lambda task, call: "garbage")
    eng = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))
    ctx = make_ctx(cfg, [eng], suite)
    ok, out = run_virtual(lambda: group(ctx, need=2)).result
    assert not ok and out == []
    assert ctx.counters["rollout/retry_env_garbage"] == 2  # each sample retried once
    assert 1 <= ctx.counters["rollout/failed_env_garbage"] <= 2  # the group gives up at the first hopeless one
    assert len(eng.requests) == 4 and ctx.router.inflight == [0]
    assert suite.closed == suite.opened == 4


def test_env_deadline_is_an_infrastructure_failure() -> None:
    cfg = config(rollout={"turn_timeout_s": 1.5, "max_retries": 1})
    suite = FakeSuite(hang=lambda task, call: call == 0)
    ctx = make_ctx(cfg, [FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))], suite)

    async def main() -> tuple[bool, list[Trajectory], float]:
        ok, out = await group(ctx, need=1)
        return ok, out, anyio.current_time()

    ok, out, t = run_virtual(main).result
    assert ok and out[0].attempts == 2
    assert ctx.counters["rollout/retry_env_timeout"] == 1
    assert t == 1.0 + 1.5 + 1.0  # generate, hung step cut at the deadline, second attempt's generate


def test_trajectory_deadline_fails_without_retry_and_aborts_the_request() -> None:
    cfg = config(rollout={"trajectory_timeout_s": 5.0, "max_retries": 3})
    eng = FakeEngine("e0", lambda r, v: ([ord("1")], 100.0))
    ctx = make_ctx(cfg, [eng], FakeSuite())
    ok, out = run_virtual(lambda: group(ctx, need=1)).result
    assert not ok
    assert ctx.counters["rollout/failed_trajectory_timeout"] == 1
    assert len(eng.requests) == 1 and eng.aborted == ["0-0.0.0"] and eng.inflight == 0


def test_dead_engine_rollouts_move_to_another_engine() -> None:
    cfg = config(rollout={"max_retries": 1})
    dead = FakeEngine("e0", lambda r, v: ([ord("1")], 10.0), die_at=2.0)  # dies mid-request
    alive = FakeEngine("e1", lambda r, v: ([ord("1")], 10.0))
    ctx = make_ctx(cfg, [dead, alive], FakeSuite())

    async def main() -> tuple[bool, list[Trajectory], float]:
        ok, out = await group(ctx, need=4)
        return ok, out, anyio.current_time()

    ok, out, t = run_virtual(main).result
    assert ok and len(out) == 4
    assert {x.engine for x in out} == {"e1"}
    assert ctx.counters["engine/deaths"] == 1 and ctx.counters["engine/retried_requests"] == 2
    assert ctx.router.alive == [False, True] and ctx.router.inflight == [0, 0]
    assert t == 12.0  # two moved at t=2 and restarted there


def test_env_async_frees_the_engine_slot_during_env_steps() -> None:
    def elapsed(env_async: bool) -> float:
        cfg = config(rollout={"env_async": env_async}, engine={"max_num_seqs": 1})
        ctx = make_ctx(cfg, [FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))], FakeSuite(step_s=1.0))

        async def main() -> float:
            await group(ctx, need=2)
            return anyio.current_time()

        return run_virtual(main).result

    # one slot, two rollouts of generate 1 s + env step 1 s
    assert elapsed(True) == 3.0  # B generates while A's env steps
    assert elapsed(False) == 4.0  # A holds the slot through its env step


def test_env_bug_is_not_swallowed() -> None:
    ctx = make_ctx(config(), [FakeEngine("e0")], FakeSuite(crash=lambda t, c: True))
    with pytest.raises(BaseException) as ei:
        run_virtual(lambda: group(ctx, need=1))
    assert "scripted env bug" in repr(ei.value)


@pytest.mark.parametrize("case", ["watched", "at_registration", "eval"])
def test_stale_multi_turn_rollout_is_cancelled_and_restarted(case: str) -> None:
    """Three 1 s turns; the next train step jumps to 2 (async_ratio 1), the engine loads version 1 at 1.5 s.

    watched: the jump comes at 1.5 s, during turn 2: that request is aborted, the sample restarts
    at once and ends at 4.5 s. at_registration: the jump comes at 0.5 s, so when turn 1 returns at
    1.0 s its version 0 is already too stale: restarted at 1.0 s without an engine abort, ends at
    4.0 s. eval: eval rollouts (group < 0) are never aborted for staleness.
    """
    from flashrl.wire.protocol import WeightManifest

    cfg = config(rollout={"max_turns": 3, "max_retries": 0}, scheduler={"async_ratio": 1})
    eng = FakeEngine("e0", lambda req, v: ([ord("3")], 1.0))
    suite = FakeSuite(turns=3)
    ctx = make_ctx(cfg, [eng], suite)
    ctx.staleness = Staleness(cfg.scheduler.async_ratio)
    group = -1 if case == "eval" else 0
    spec = RolloutSpec(task=suite.train_tasks()[3], group=group, index=0, temperature=1.0, seed_key=(group, 0),
                       sample_id=f"{group}-0")

    async def main() -> Trajectory:
        result: list[Trajectory] = []

        async def sample() -> None:
            result.append(await run_sample(ctx, spec, 0))

        async with anyio.create_task_group() as tg:
            ctx.router.take(0)
            tg.start_soon(sample)
            await anyio.sleep(0.5 if case == "at_registration" else 1.5)
            ctx.staleness.taken(1)  # the batch of step 1 was taken: step 2 is next
            assert ctx.staleness.next_step == 2
            ctx.abort_stale()
            await anyio.sleep(1.5 - anyio.current_time())
            await eng.update_weights(WeightManifest(version=1))
        return result[0]

    t = run_virtual(main).result
    assert t.status == "ok" and t.turns == 3 and t.reward == 1.0
    gen_versions = [v for v, m in zip(t.versions, t.loss_mask) if m]
    if case == "eval":
        assert t.attempts == 1 and "rollout/aborted_stale" not in ctx.counters and t.t_end == 3.0
        return
    assert ctx.counters["rollout/aborted_stale"] == 1 and t.attempts == 2
    assert gen_versions == [1, 1, 1]  # the restart is trained on, and it is fresh
    assert t.sample_id == "0-0" and t.index == 0  # same sample, same seeds: only the attempt changed
    if case == "watched":
        assert eng.aborted == ["0-0.0.1"] and t.t_end == 4.5
    else:
        assert eng.aborted == [] and t.t_end == 4.0
    assert ctx.watched == {} and ctx.live == {} and ctx.router.inflight == [0]
    assert suite.closed == suite.opened == 2


def test_trajectory_deadlines_expire_in_start_order_whatever_finished_before() -> None:
    """One timer serves every trajectory deadline (aio.Deadlines): attempts that ended are
    skipped, a retry's deadline counts from the retry, and each expiry is exact."""
    durations = {(0, 0): 1.0, (0, 1): 100.0, (1, 0): 100.0, (2, 0): 2.0}  # (sample, attempt) -> seconds

    def script(req: Generate, version: int) -> tuple[list[int], float]:
        sid, attempt, _turn = req.request_id.split(".")
        return [ord("1")], durations[(int(sid.split("-")[-1]), int(attempt))]

    cfg = config(rollout={"trajectory_timeout_s": 5.0, "max_retries": 1})
    suite = FakeSuite(fail=lambda task, call: "crash" if task.id == "t0" and call == 0 else None)
    eng = FakeEngine("e0", script)
    ctx = make_ctx(cfg, [eng], suite)

    async def main() -> dict[int, tuple[Trajectory, float]]:
        out: dict[int, tuple[Trajectory, float]] = {}

        async def one(k: int) -> None:
            spec = RolloutSpec(task=suite.train_tasks()[k], group=0, index=k, temperature=1.0, seed_key=(0, k), sample_id=f"0-{k}")
            ctx.router.take(0)
            t = await run_sample(ctx, spec, 0)
            out[k] = (t, anyio.current_time())

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(one, k)
        return out

    out = run_virtual(main).result
    assert (out[2][0].status, out[2][1]) == ("ok", 2.0)
    assert (out[1][0].failure, out[1][1]) == ("trajectory_timeout", 5.0)
    # sample 0 failed its env step at 1 s and was retried: the retry's deadline is 1 + 5 s
    assert (out[0][0].failure, out[0][0].attempts, out[0][1]) == ("trajectory_timeout", 2, 6.0)
    assert ctx.counters["rollout/failed_trajectory_timeout"] == 2 and ctx.counters["rollout/retry_env_crash"] == 1
    assert sorted(eng.aborted) == ["0-0.1.0", "0-1.0.0"]
    assert len(ctx.deadlines) == 0 and ctx.router.inflight == [0] and ctx.live == {}
    assert suite.closed == suite.opened == 4


def test_rollouts_cancelled_before_their_first_step_release_their_engine_counts() -> None:
    """A task cancelled before it ever ran never enters run_sample (whose finally releases the
    engine count): the group's cleanup releases it instead."""
    from flashrl.aio import cancel_and_wait

    ctx = make_ctx(config(), [FakeEngine("e0"), FakeEngine("e1")], FakeSuite())

    async def main() -> list[Any]:
        engines = [ctx.router.pick() for _ in range(3)]
        loop = asyncio.get_running_loop()
        specs = [RolloutSpec(task=ctx.suite.train_tasks()[0], group=0, index=k, temperature=1.0, seed_key=(0, k), sample_id=f"0-{k}")
                 for k in range(3)]
        tasks = [loop.create_task(run_sample(ctx, s, i)) for s, i in zip(specs, engines)]
        assert ctx.router.inflight == [2, 1]
        await cancel_and_wait(tasks, lambda k: ctx.router.release(engines[k]))  # before any of them ran
        return tasks

    tasks = run_virtual(main).result
    assert all(t.cancelled() for t in tasks)
    assert ctx.router.inflight == [0, 0] and ctx.suite.opened == 0


def test_a_bug_in_one_rollout_cancels_the_others_and_is_raised_from_the_group() -> None:
    suite = FakeSuite(crash=lambda task, call: call == 1)  # the second env step of the task is a bug
    eng = FakeEngine("e0", by_index([1.0, 2.0, 50.0]))
    ctx = make_ctx(config(), [eng], suite)

    async def main() -> None:
        await group(ctx, need=3)

    with pytest.raises(ValueError, match="scripted env bug on t0"):
        run_virtual(main)
    assert eng.aborted == ["0-2.0.0"]  # the slow one was aborted, not left running
    assert ctx.router.inflight == [0] and ctx.live == {} and suite.closed == suite.opened == 3


def test_a_prompt_is_tokenized_once_for_all_the_samples_that_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's samples share their prompt text: ctx.prompt_ids tokenizes each text once (a bounded
    cache, oldest out first) and hands every sample its own list."""
    import flashrl.controller.context as context

    calls: list[str] = []

    class Counting(FakeTokenizer):
        def encode(self, text: str) -> list[int]:
            calls.append(text)
            return super().encode(text)

    cfg = config(rollout={"group_size": 4, "batch_prompts": 1})
    ctx = RolloutContext(cfg=cfg, tokenizer=Counting(), suite=FakeSuite(), engines=[FakeEngine()],
                         router=Router(1, cfg.engine.max_num_seqs), version=lambda: 0)
    a, b = ctx.prompt_ids("12+3="), ctx.prompt_ids("12+3=")
    assert a == b == TOK.encode("12+3=") and calls == ["12+3="]
    a.append(0)  # a sample's ids are its own
    assert ctx.prompt_ids("12+3=") == TOK.encode("12+3=")
    monkeypatch.setattr(context, "PROMPT_CACHE", 2)
    ctx.prompt_ids("1+1=")
    ctx.prompt_ids("2+2=")  # the cache is full: "12+3=" (the oldest) goes
    ctx.prompt_ids("12+3=")
    assert calls == ["12+3=", "1+1=", "2+2=", "12+3="]


def test_a_slow_environment_never_blocks_an_engine() -> None:
    """One engine slot; one trajectory's tool call takes 1000 s. With env_async the engine serves the
    other trajectories meanwhile: it is busy every second until they are done; without, it idles."""

    def run(env_async: bool) -> tuple[float, float, float]:
        cfg = config(rollout={"env_async": env_async, "max_turns": 2, "turn_timeout_s": 5000.0,
                              "trajectory_timeout_s": 5000.0}, engine={"max_num_seqs": 1})
        suite = FakeSuite(turns=2, step_s=lambda task, turn: 1000.0 if task.id == "t0" and turn == 0 else 0.0)
        ctx = make_ctx(cfg, [FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))], suite)

        async def main() -> tuple[float, float, float]:
            slow = asyncio.ensure_future(group(ctx, need=1, uid=0))  # launched first: it has the slot first
            await asyncio.sleep(0)
            await group(ctx, need=3, uid=1)
            t_fast = anyio.current_time()
            busy = ctx.busy[0].busy_s(t_fast)
            await slow
            return t_fast, busy, anyio.current_time()

        return run_virtual(main).result

    t_fast, busy, t_slow = run(True)
    # 1 s for the slow rollout's first turn + 3 rollouts x 2 turns x 1 s, back to back: never idle
    assert t_fast == 7.0 and busy == 7.0
    assert t_slow == 1000.0 + 1.0 + 1.0  # its env step from t=1, then its second turn
    t_fast, busy, _ = run(False)
    assert t_fast > 1000.0 and busy < 10.0  # the slot idled through the slow env step


def _outcome_script(p_win: float = 0.5) -> Any:
    """Sample k of group uid wins (writes the answer digit) with probability p_win, seeded by (uid, k); a
    win takes 1-2 s, a loss 3-4 s: short wins, as in the guessing game and the tool task's direct answers."""

    def script(req: Generate, version: int) -> tuple[list[int], float]:
        sid = req.request_id.split(".")[0]
        uid, k = (int(x) for x in sid.split("-"))
        rng = random.Random(f"{uid}-{k}")
        win = rng.random() < p_win
        return [ord(str(uid % 10) if win else "x")], (1.0 if win else 3.0) + rng.random()

    return script


def _kept_rewards(keep: str, groups: int, need: int, extra: int) -> tuple[list[list[int]], list[float], list[float]]:
    cfg = config(rollout={"redundancy": extra, "redundant_keep": keep}, engine={"max_num_seqs": 1024})
    ctx = make_ctx(cfg, [FakeEngine("e0", _outcome_script())], FakeSuite(n_train=groups))

    async def main() -> list[list[Trajectory]]:
        outs = await asyncio.gather(*(group(ctx, need=need, extra=extra, uid=u) for u in range(groups)))
        assert all(ok for ok, _ in outs)
        return [o for _, o in outs]

    kept = run_virtual(main).result
    indices = [sorted(t.index for t in o) for o in kept]
    kept_mean = [sum(t.reward for t in o) / need for o in kept]
    # what the policy really does: the outcome of every launched sample, none selected
    script = _outcome_script()
    launched = [sum(script(Generate(request_id=f"{u}-{k}.0.0", prompt_ids=[1], max_tokens=1), 0)[0] == [ord(str(u % 10))]
                    for k in range(need + extra)) / (need + extra) for u in range(groups)]
    return indices, kept_mean, launched


def test_redundancy_finish_order_biases_the_kept_samples_toward_short_wins() -> None:
    indices, kept, launched = _kept_rewards("finish_order", groups=64, need=4, extra=4)
    # wins finish first, so the kept success rate is far above the policy's own
    assert sum(kept) / len(kept) > sum(launched) / len(launched) + 0.2


def test_redundancy_launch_order_keeps_an_unbiased_sample() -> None:
    indices, kept, _ = _kept_rewards("launch_order", groups=64, need=4, extra=4)
    assert indices == [[0, 1, 2, 3]] * 64  # nothing failed: the first four launched, whatever finished first
    firsts = []
    script = _outcome_script()
    for u in range(64):
        wins = [script(Generate(request_id=f"{u}-{k}.0.0", prompt_ids=[1], max_tokens=1), 0)[0] == [ord(str(u % 10))]
                for k in range(4)]
        firsts.append(sum(wins) / 4)
    assert kept == firsts  # the kept rewards are those of the first four launches exactly: no selection


def test_redundancy_launch_order_stands_in_for_failed_rollouts_only() -> None:
    # sample 1 fails for good (its env fails on every call); samples 4, 5 are the extras
    cfg = config(rollout={"redundancy": 2, "redundant_keep": "launch_order", "max_retries": 0})
    durations = [5.0, 1.0, 4.0, 3.0, 1.0, 1.0]
    # every sample runs the same task: its first env.step to arrive (sample 1's, at 1 s) fails, for good
    suite = FakeSuite(fail=lambda task, call: "crash" if call == 0 else None)
    eng = FakeEngine("e0", by_index(durations, token="0"))
    ctx = make_ctx(cfg, [eng], suite)

    async def main() -> tuple[bool, list[Trajectory], float]:
        ok, out = await group(ctx, need=4, extra=2)
        return ok, out, anyio.current_time()

    ok, out, t = run_virtual(main).result
    assert ok and [x.index for x in out] == [0, 2, 3, 4]  # launch order, sample 1 replaced by the first extra
    assert t == 5.0  # waited for sample 0 (the slowest kept), not for the fastest finishers
    assert ctx.counters["rollout/failed_env_crash"] == 1 and ctx.counters["rollout/aborted_redundant"] == 0
