"""The Controller end to end on fakes, on a virtual clock (flashrl.sim.clock.run_virtual).

Every run here is minutes of scheduled time that takes milliseconds; times asserted are exact.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.config import Config
from flashrl.controller.controller import Controller, RunSummary
from flashrl.controller.scheduler import DataStream, request_seed
from flashrl.core.records import StepRecord
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import (
    FakeEngine,
    FakeSuite,
    FakeTokenizer,
    FakeTrainer,
    default_script,
)
from flashrl.wire.protocol import Generate, TrainBatch
from flashrl.wire.trajectory import Trajectory

TOK = FakeTokenizer()


def config(**sections: Any) -> Config:
    return msgspec.convert(sections, Config)


def run(c: Controller) -> tuple[RunSummary, set[asyncio.Task[Any]]]:
    """Run the controller; also return the tasks still alive after run() returned (must be none)."""

    async def main() -> tuple[RunSummary, set[asyncio.Task[Any]]]:
        summary = await c.run()
        return summary, {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    return run_virtual(main).result


def long_tail(seed: int) -> Any:
    """Seeded lengths with a long tail: most samples take ~1 s, one in four takes 5-30x longer."""

    def script(req: Generate, version: int) -> tuple[list[int], float]:
        rng = random.Random(req.seed)
        n = rng.randint(1, req.max_tokens)
        slow = rng.random() < 0.25
        return [rng.choice(b"0123456789") for _ in range(n)], (rng.uniform(5, 30) if slow else rng.uniform(0.5, 1.5))

    return script


def check_staleness(batches: list[TrainBatch], ratio: int) -> int:
    worst = 0
    for b in batches:
        for s in b.samples:
            start = next(v for v, m in zip(s.versions, s.loss_mask) if m)
            assert b.step - start <= ratio, f"step {b.step} trained {s.sample_id} started at version {start}"
            worst = max(worst, b.step - start)
    return worst


# --------------------------------------------------------------------------- the synchronous baseline
async def hand_written_sync_loop(cfg: Config, suite: FakeSuite, engine: FakeEngine, trainer: FakeTrainer) -> None:
    """The textbook loop: admit a batch, generate every sample, train, sync, repeat."""
    data = DataStream(suite.train_tasks(), cfg.run.seed)
    for step in range(cfg.run.steps):
        samples = []
        for _ in range(cfg.rollout.batch_prompts):
            uid, task = data.next()
            for j in range(cfg.rollout.group_size):
                env = suite.make_env()
                ids = TOK.encode(await env.reset(task))
                out = await engine.generate(Generate(
                    request_id=f"{uid}-{j}",
                    prompt_ids=ids,
                    max_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    seed=request_seed(cfg.run.seed, uid, j, 0),
                ))
                res = await env.step(TOK.decode(out.token_ids))
                await env.close()
                samples.append(Trajectory(
                    prompt_ids=ids, response_ids=out.token_ids, loss_mask=[1] * len(out.token_ids),
                    behav_logp=out.logprobs, versions=out.versions, reward=res.reward, group=uid, sample_id=f"{uid}-{j}",
                ))
        await trainer.train_step(TrainBatch(step=step, samples=samples))
        manifest = await trainer.prepare_weights(step + 1)
        await trainer.send_weights(step + 1)
        await engine.update_weights(manifest)


TRAINED = ("sample_id", "group", "prompt_ids", "response_ids", "loss_mask", "behav_logp", "versions", "reward")


def trained(batches: list[TrainBatch]) -> list[tuple[int, list[tuple[object, ...]]]]:
    """What the trainer trains on, by step: each sample's tokens, per-token data and reward (its lineage and
    timings left out: the hand-written loop does not record them)."""
    return [(b.step, [tuple(getattr(t, f) for f in TRAINED) for t in b.samples]) for b in batches]


def test_sync_baseline_reproduces_the_synchronous_loop_exactly() -> None:
    cfg = config(
        run={"steps": 5, "seed": 11, "eval_every": 2},
        rollout={"group_size": 3, "batch_prompts": 2, "max_new_tokens": 6},
        scheduler={"async_ratio": 0, "queue_scheduling": False},
    )
    step_s = lambda task, turn: (int(task.id[1:]) % 4) * 0.3  # noqa: E731  (completion order != admission order)
    engines = [FakeEngine(f"e{i}", default_script(token_s=0.1 * (i + 1)), sync_s=1.0) for i in range(3)]
    trainer = FakeTrainer(train_s=0.5)
    c = Controller(cfg, TOK, FakeSuite(n_train=7, n_eval=3, step_s=step_s), engines, trainer)
    summary, left = run(c)
    assert summary.steps == 5 and left == set()

    ref_engine, ref_trainer = FakeEngine("ref"), FakeTrainer()
    run_virtual(lambda: hand_written_sync_loop(cfg, FakeSuite(n_train=7, step_s=step_s), ref_engine, ref_trainer))
    assert len(trainer.batches) == 5
    assert trained(trainer.batches) == trained(ref_trainer.batches)  # same samples, same order, same versions
    assert all(v == b.step for b in trainer.batches for s in b.samples for v in s.versions)
    # all three engines served training samples, yet every sample equals the one-engine loop's
    assert all(any(r.request_id[0].isdigit() for r in e.requests) for e in engines)


def test_sync_baseline_waits_for_published_weights() -> None:
    """Sync: no sample of step s+1 is requested before step s's weights are published."""
    cfg = config(
        run={"steps": 4},
        rollout={"group_size": 2, "batch_prompts": 2},
        scheduler={"async_ratio": 0, "queue_scheduling": False},
    )
    eng = FakeEngine("e0", long_tail(0))
    trainer = FakeTrainer(train_s=1.0)
    run(Controller(cfg, TOK, FakeSuite(), [eng], trainer))
    for r, t in zip(eng.requests, eng.request_times):
        uid = int(r.request_id.split("-")[0])
        step = uid // 2
        if step > 0:
            assert t >= trainer.train_times[step - 1] + 1.0


# --------------------------------------------------------------------------- staleness and capacity
# The run shapes both bound properties (drop's here, wait's below) are checked over.
RUN_SHAPES = dict(
    ratio=st.integers(0, 3),
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    group=st.integers(1, 3),
    n_engines=st.integers(1, 3),
    queue=st.booleans(),
    redundancy=st.integers(0, 1),
    overlap=st.booleans(),
)


@settings(max_examples=25, deadline=None)
@given(**RUN_SHAPES)
def test_staleness_bound_never_violated(ratio: int, seed: int, batch: int, group: int, n_engines: int, queue: bool,
                                        redundancy: int, overlap: bool) -> None:
    cfg = config(
        run={"steps": 8, "seed": seed},
        rollout={"group_size": group, "batch_prompts": batch, "redundancy": redundancy, "max_new_tokens": 4},
        scheduler={"async_ratio": ratio, "queue_scheduling": queue, "stale": "drop"},
        weight_sync={"overlap": overlap},
    )
    # the sync takes a while (0.5 s engines, 0.3 s trainer): with overlap it runs beside the next step
    engines = [FakeEngine(f"e{i}", long_tail(seed + i), sync_s=0.5) for i in range(n_engines)]
    trainer = FakeTrainer(train_s=random.Random(seed).uniform(0.1, 1.0), sync_s=0.3)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, FakeSuite(n_train=5), engines, trainer, on_step=lambda r: records.append(r.to_dict()))
    summary, left = run(c)
    assert left == set() and summary.steps == 8
    worst = check_staleness(trainer.batches, ratio)
    assert max(r["staleness/max"] for r in records) == worst <= ratio
    assert [len(b.samples) for b in trainer.batches] == [batch * group] * 8
    assert all(len({s.group for s in b.samples}) == batch for b in trainer.batches)
    # every trained group was trained once
    groups = [s.group for b in trainer.batches for s in b.samples]
    assert len(set(groups)) == 8 * batch


def test_stale_sample_is_dropped_counted_and_regenerated() -> None:
    cfg = config(
        run={"steps": 6},
        rollout={"group_size": 1, "batch_prompts": 1},
        scheduler={"async_ratio": 1, "queue_scheduling": True, "stale": "drop"},
    )
    # prompt uid 1's first sample: 4 tokens over 3.5 s (first token at 0.875 s, version 0); others 1 s
    def script(r: Generate, v: int) -> tuple[list[int], float]:
        return ([ord("1")] * 4, 3.5) if r.request_id.startswith("1-0.") else ([ord("1")], 1.0)

    eng = FakeEngine("e0", script)
    trainer = FakeTrainer()
    records: list[dict[str, Any]] = []
    summary, _ = run(Controller(cfg, TOK, FakeSuite(), [eng], trainer, on_step=lambda r: records.append(r.to_dict())))
    assert summary.counters["stale/dropped_samples"] == 1
    assert check_staleness(trainer.batches, 1) <= 1
    trained = [s.sample_id for b in trainer.batches for s in b.samples]
    assert "1-0" not in trained and "1-1" in trained
    assert records[-1]["count/stale/dropped_samples"] == 1


@pytest.mark.parametrize("ratio,batch,queue", [(0, 2, True), (1, 2, True), (2, 3, True), (2, 3, False)])
def test_admission_fills_capacity_exactly(ratio: int, batch: int, queue: bool) -> None:
    cfg = config(
        run={"steps": ratio + 2},  # more groups to train than the capacity: the capacity is what binds
        rollout={"group_size": 2, "batch_prompts": batch},
        scheduler={"async_ratio": ratio, "queue_scheduling": queue},
    )
    eng = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))
    trainer = FakeTrainer(train_s=100.0)  # nothing is trained (no slot freed) for 100 s
    run(Controller(cfg, TOK, FakeSuite(n_train=50), [eng], trainer))
    first_publish = trainer.train_times[0] + 100.0
    uids = {r.request_id.split("-")[0] for r, t in zip(eng.requests, eng.request_times) if t < first_publish}
    assert len(uids) == (ratio + 1) * batch


def test_async_beats_sync_on_a_long_tail() -> None:
    def elapsed(ratio: int, queue: bool) -> float:
        cfg = config(
            run={"steps": 8, "seed": 3},
            rollout={"group_size": 4, "batch_prompts": 4},
            scheduler={"async_ratio": ratio, "queue_scheduling": queue},
        )
        engines = [FakeEngine(f"e{i}", long_tail(i)) for i in range(2)]
        summary, _ = run(Controller(cfg, TOK, FakeSuite(), engines, FakeTrainer(train_s=1.0)))
        return summary.elapsed_s

    sync, flash = elapsed(0, False), elapsed(2, True)
    assert sync / flash > 1.5, (sync, flash)


# --------------------------------------------------------------------------- eval, records, snapshot
def test_eval_records_at_start_every_n_and_end() -> None:
    def script(req: Generate, version: int) -> tuple[list[int], float]:
        prompt = TOK.decode(req.prompt_ids)  # "e<k>?"
        right = prompt.startswith("e") and version >= 2
        return [ord(str(int(prompt[1:-1]) % 10)) if right else ord("x")], 1.0

    cfg = config(run={"steps": 5, "eval_every": 2}, rollout={"group_size": 2, "batch_prompts": 2, "eval_temperature": 0.0})
    engines = [FakeEngine("e0", script), FakeEngine("e1", script)]
    records: list[dict[str, Any]] = []
    snaps = []
    c = Controller(cfg, TOK, FakeSuite(n_eval=4), engines, FakeTrainer(train_s=0.5), on_step=lambda r: records.append(r.to_dict()))
    c.on_step = lambda r: (records.append(r.to_dict()), snaps.append(c.snapshot()))
    summary, _ = run(c)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r} == {0: 0.0, 2: 1.0, 4: 1.0, 5: 1.0}
    assert summary.eval_accuracy == 1.0
    evals = [r for e in engines for r in e.requests if r.request_id.startswith("eval")]
    assert len(evals) == 4 * 4 and {r.temperature for r in evals} == {0.0}
    assert all(sum(r.request_id.startswith("eval") for r in e.requests) == 8 for e in engines)  # spread
    for key in ("version", "reward/mean", "time/step_s", "staleness/mean", "staleness/max", "time/weight_sync_s",
                "samples_per_s", "tokens_per_s", "loss", "train/samples"):
        assert key in records[1], key
    assert records[3]["version"] == 3 and records[3]["samples"] == 4
    # a record goes out with its sync: one held back by an eval (publisher.hold) goes out with the next
    assert snaps[3].version in (3, 4) and [e.name for e in snaps[3].engines] == ["e0", "e1"]
    assert snaps[-1].eval_history == [(0, 0.0), (2, 1.0), (4, 1.0), (5, 1.0)]
    assert len(snaps[-1].reward_history) == 5
    assert c.snapshot().status == "done"


def test_max_time_stops_the_run() -> None:
    cfg = config(run={"steps": 1000, "max_time_s": 5.5}, rollout={"group_size": 1, "batch_prompts": 1})
    eng = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=2), [eng], FakeTrainer(), on_step=lambda r: records.append(r.to_dict())))
    assert summary.stop_reason == "max_time" and left == set()
    # exactly one record per step (metrics.jsonl: one line per step), in order, step 0 = first eval
    assert [r["step"] for r in records] == list(range(summary.steps + 1))
    assert 0 < summary.steps < 1000
    last = records[-1]
    assert last["time/elapsed_s"] < 5.5  # the deadline came while waiting for the next batch
    # the final weights are still evaluated, merged into the record of the step that made them
    assert "eval/accuracy" in last and "reward/mean" in last and last["version"] == summary.steps
    every = cfg.run.eval_every
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, every, summary.steps]
    assert summary.steps % every != 0  # so the final eval was not a scheduled one
    assert summary.elapsed_s == 5.5 + last["time/eval_s"]


@pytest.mark.parametrize("eval_every", [0, 2])
def test_max_time_one_line_per_step_whatever_the_eval_cadence(eval_every: int) -> None:
    """Deadline after a step (final eval in it) or while waiting (held record gets it): no duplicate."""
    for max_time in (4.0, 4.5, 5.0, 5.5, 7.25):
        cfg = config(run={"steps": 1000, "max_time_s": max_time, "eval_every": eval_every},
                     rollout={"group_size": 1, "batch_prompts": 1})
        eng = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0))
        typed: list[StepRecord] = []
        summary, _ = run(Controller(cfg, TOK, FakeSuite(n_eval=1), [eng], FakeTrainer(train_s=0.25),
                                    on_step=typed.append))
        records = [r.to_dict() for r in typed]
        assert [r["step"] for r in records] == list(range(summary.steps + 1)), max_time
        assert "eval/accuracy" in records[-1] and records[-1]["step"] == summary.steps
        evals = [r["step"] for r in records if "eval/accuracy" in r]
        expected = sorted({0, summary.steps} | ({k for k in range(1, summary.steps + 1) if k % eval_every == 0} if eval_every else set()))
        assert evals == expected, (max_time, evals)


# --------------------------------------------------------------------------- failures and shutdown
@pytest.mark.parametrize("stop", ["steps", "steps-no-drain", "max_time"])
def test_shutdown_aborts_inflight_closes_envs_leaves_no_task(stop: str) -> None:
    """A run that ends at its step count admitted nothing past its last batch (scheduler.drain, buffer
    invariant 5): it ends with nothing generating, no rollout thrown away. Without drain, or stopped by
    max_time_s, it aborts what still runs."""
    run_cfg: dict[str, Any] = {"steps": 50, "max_time_s": 3.0} if stop == "max_time" else {"steps": 3}
    cfg = config(run=run_cfg, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": 2, "drain": stop != "steps-no-drain"})
    engines = [FakeEngine(f"e{i}", long_tail(i)) for i in range(2)]
    suite = FakeSuite()
    c = Controller(cfg, TOK, suite, engines, FakeTrainer(train_s=0.2))
    summary, left = run(c)
    assert left == set()
    aborted = sum(len(e.aborted) for e in engines)
    if stop == "steps":
        assert aborted == 0 and c.counters["admitted/groups"] == 3 * 2 == c.counters["trained/groups"]
    elif stop == "steps-no-drain":
        assert aborted > 0 and c.counters["admitted/groups"] > c.counters["trained/groups"] == 3 * 2
    else:
        assert summary.steps < 50 and aborted > 0  # rollouts still running at the deadline were aborted
    assert [e.inflight for e in engines] == [0, 0] and c.router.inflight == [0, 0] and c.ctx.live == {}
    assert suite.closed == suite.opened
    assert c.status == "done"


@pytest.mark.parametrize("where", ["trainer", "env"])
def test_crash_propagates_after_cleanup(where: str) -> None:
    cfg = config(run={"steps": 5}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    engines = [FakeEngine(f"e{i}", long_tail(i)) for i in range(2)]
    suite = FakeSuite(n_train=4, crash=(lambda t, call: t.id == "t3") if where == "env" else None)
    trainer = FakeTrainer(fail_at_step=2 if where == "trainer" else None)
    c = Controller(cfg, TOK, suite, engines, trainer)

    async def main() -> set[asyncio.Task[Any]]:
        with pytest.raises((RuntimeError, ValueError)) as ei:
            await c.run()
        assert ("fake trainer failure at step 2" if where == "trainer" else "scripted env bug on t3") in str(ei.value)
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert run_virtual(main).result == set()
    assert c.status == "crashed"
    assert [e.inflight for e in engines] == [0, 0] and suite.closed == suite.opened


def test_dead_engine_mid_run_is_survived_and_skipped_at_sync() -> None:
    cfg = config(run={"steps": 6}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    dying = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0), die_at=2.5)
    healthy = FakeEngine("e1", lambda r, v: ([ord("1")], 1.0))
    c = Controller(cfg, TOK, FakeSuite(), [dying, healthy], FakeTrainer())
    summary, left = run(c)
    assert summary.steps == 6 and left == set()
    assert summary.counters["engine/deaths"] == 1
    assert summary.counters["engine/retried_requests"] >= 1
    assert summary.counters["weight_sync/skipped_dead_engines"] >= 1
    assert healthy.updates == [1, 2, 3, 4, 5, 6]
    assert c.snapshot().engines[0].alive is False


def test_failed_weight_load_is_a_loud_error() -> None:
    cfg = config(run={"steps": 3}, rollout={"group_size": 1, "batch_prompts": 1})
    engines = [FakeEngine("e0"), FakeEngine("bad", update_ok=False)]
    c = Controller(cfg, TOK, FakeSuite(), engines, FakeTrainer())
    with pytest.raises(RuntimeError, match="engine bad failed to load weights version 1"):
        run(c)


def test_refused_adapter_is_counted_and_the_engine_kept() -> None:
    """LoRA: a version an engine's vLLM refuses leaves that engine live at its version (no restart), counted;
    the next version loads there as everywhere. Refusals in a row end the run, naming the error."""
    cfg = config(run={"steps": 4}, rollout={"group_size": 1, "batch_prompts": 1})
    picky = FakeEngine("picky", refuse_adapter=lambda v: v == 2)
    c = Controller(cfg, TOK, FakeSuite(), [FakeEngine("e0"), picky], FakeTrainer())
    summary, left = run(c)
    assert summary.steps == 4 and left == set()
    assert summary.counters["weight_sync/adapter_refused"] == 1
    assert summary.counters.get("engine/deaths", 0) == 0 and summary.counters.get("weight_sync/engine_failed", 0) == 0
    assert picky.updates == [1, 3, 4] and c.snapshot().engines[1].alive

    cfg = config(run={"steps": 6}, rollout={"group_size": 1, "batch_prompts": 1})
    engines = [FakeEngine("e0"), FakeEngine("bad", refuse_adapter=lambda v: v >= 2)]
    c = Controller(cfg, TOK, FakeSuite(), engines, FakeTrainer())
    with pytest.raises(RuntimeError, match="engine bad refused LoRA adapter version 4 and still serves version 1: "
                                           "adapter v4 refused by vLLM .fake.; 3 versions refused in a row"):
        run(c)


class _Watched(FakeEngine):
    """A FakeEngine that records, for each request sent to it, its own version and the published one then."""

    controller: Controller | None = None

    async def generate(self, req: Generate) -> Any:
        assert self.controller is not None
        self.seen = [*getattr(self, "seen", []), (req.request_id, self.version, self.controller.published.version)]
        return await super().generate(req)


def test_refused_adapter_version_is_never_served_as_published() -> None:
    """LoRA: an engine that refused version 2 keeps version 1. The published version (a lower bound on every new
    token's version) and the engines agree: the refuser takes no request while behind, and the eval of
    version 2 runs on the engine that holds it, not on both (no mixed versions)."""
    cfg = config(run={"steps": 4, "eval_every": 2}, rollout={"group_size": 1, "batch_prompts": 1})
    ok, picky = _Watched("e0"), _Watched("picky", refuse_adapter=lambda v: v == 2)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, FakeSuite(n_eval=4), [ok, picky], FakeTrainer(), on_step=lambda r: records.append(r.to_dict()))
    ok.controller = picky.controller = c
    summary, left = run(c)
    assert summary.steps == 4 and left == set()
    assert summary.counters["weight_sync/adapter_refused"] == 1 and 2 not in picky.updates and 2 in ok.updates
    stale = [(rid, held, pub) for e in (ok, picky) for rid, held, pub in e.seen if held < pub]
    assert stale == []  # no request went to an engine behind the published version
    assert summary.counters.get("eval/mixed_versions", 0) == 0 and "eval/refused_versions" not in summary.counters
    assert {r["step"] for r in records if "eval/accuracy" in r} == {0, 2, 4}
    assert c.published.version == 4 and c.engine_versions == [4, 4]


def test_eval_of_a_version_no_engine_holds_is_refused_not_mixed() -> None:
    """LoRA: the only engine refuses version 2, the one an eval is due for: the published version stays 1 (what
    the engine holds), and the eval of 2 is not run on version 1's weights: counted, its record without an eval;
    the run goes on to version 3."""
    cfg = config(run={"steps": 4, "eval_every": 2}, rollout={"group_size": 1, "batch_prompts": 1})
    picky = _Watched("picky", refuse_adapter=lambda v: v == 2)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, FakeSuite(n_eval=4), [picky], FakeTrainer(), on_step=lambda r: records.append(r.to_dict()))
    picky.controller = c
    summary, left = run(c)
    assert summary.steps == 4 and left == set()
    assert [held for _, held, pub in picky.seen if held != pub] == []  # published agreed with the engine throughout
    assert summary.counters.get("eval/mixed_versions", 0) == 0
    assert summary.counters["eval/refused_versions"] == 1
    assert {r["step"] for r in records if "eval/accuracy" in r} == {0, 4}
    assert not any(rid.startswith("eval2-") for rid, _, _ in picky.seen)
    assert c.published.version == 4


def test_env_failures_are_retried_not_lost() -> None:
    cfg = config(run={"steps": 4}, rollout={"group_size": 2, "batch_prompts": 2, "max_retries": 1})
    suite = FakeSuite(fail=lambda t, call: "crash" if call == 0 else None)
    trainer = FakeTrainer()
    summary, _ = run(Controller(cfg, TOK, suite, [FakeEngine("e0")], trainer))
    assert summary.steps == 4
    assert summary.counters["rollout/retry_env_crash"] == len(suite.calls)  # first step of every task seen
    assert "dropped/groups_unfillable" not in summary.counters


async def test_runs_on_the_real_event_loop_clock_too() -> None:
    """The same code on real time (pytest-asyncio's loop), with millisecond latencies."""
    cfg = config(run={"steps": 3}, rollout={"group_size": 2, "batch_prompts": 2})
    engines = [FakeEngine(f"e{i}", default_script(token_s=0.001)) for i in range(2)]
    trainer = FakeTrainer(train_s=0.002)
    summary = await Controller(cfg, TOK, FakeSuite(n_eval=2), engines, trainer).run()
    assert summary.steps == 3 and len(trainer.batches) == 3
    assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()
    check_staleness(trainer.batches, 2)


def test_held_step_record_is_emitted_when_the_run_crashes_while_waiting() -> None:
    """max_time set: a step's record waits for the next batch; a crash meanwhile must not lose it."""
    cfg = config(run={"steps": 50, "max_time_s": 1000.0}, rollout={"group_size": 1, "batch_prompts": 1},
                 scheduler={"async_ratio": 0, "queue_scheduling": False})
    # sync loop: uid k is step k; the env of uid 3's task crashes (a bug) while step 3 waits for it
    data = DataStream(FakeSuite().train_tasks(), cfg.run.seed)
    bad = [data.next()[1].id for _ in range(4)][3]
    suite = FakeSuite(crash=lambda t, call: t.id == bad)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, suite, [FakeEngine("e0")], FakeTrainer(), on_step=lambda r: records.append(r.to_dict()))
    with pytest.raises(ValueError, match=f"scripted env bug on {bad}"):
        run(c)
    assert c.version == 3
    assert [r["step"] for r in records] == [1, 2, 3]  # step 3's held line was written on the way out
    assert suite.aclosed == 1  # the suite is released on the crash path too


# --------------------------------------------------------------------------- dashboard numbers
def test_snapshot_rates_and_busy_fraction_are_current_not_run_averages() -> None:
    """Sync loop, one engine: 1 s requests for uids 0-4, then 3 s; train 1 s. Exact windowed numbers.

    Steps end at t = 2, 4, ..., 10 (fast), then 14, 18, 22, 26, 30. At t = 30 the last 10 s hold
    the busy periods [20, 21] (tail of [18, 21]), [22, 25], [26, 29]: 7 s busy; 3 samples of 2
    tokens. Run averages would read 20/30 busy and 10/30 samples/s instead.
    """
    def script(req: Generate, version: int) -> tuple[list[int], float]:
        uid = int(req.request_id.split("-")[0])
        return [ord("1")] * 2, (1.0 if uid < 5 else 3.0)

    cfg = config(run={"steps": 10}, rollout={"group_size": 1, "batch_prompts": 1},
                 scheduler={"async_ratio": 0, "queue_scheduling": False})
    eng = FakeEngine("e0", script)
    snaps: dict[int, Any] = {}
    c = Controller(cfg, TOK, FakeSuite(), [eng], FakeTrainer(train_s=1.0))
    before = c.snapshot()
    assert before.samples_per_s == 0.0 and before.engines[0].busy_fraction == 0.0
    c.on_step = lambda r: snaps.__setitem__(r.step, (c.snapshot(), r.to_dict()))
    # the loop clock does not start at 0 (a real loop's never does): windows count from run()'s start
    summary = run_virtual(c.run, start=100.0).result
    s2, _ = snaps[2]  # t = 4: less than a window since the start, so over 4 s
    assert s2.elapsed_s == 4.0
    assert s2.engines[0].busy_fraction == pytest.approx(2 / 4)
    assert s2.samples_per_s == pytest.approx(2 / 4) and s2.tokens_per_s == pytest.approx(4 / 4)
    s10, r10 = snaps[10]
    assert s10.elapsed_s == 30.0 == summary.elapsed_s
    assert s10.engines[0].busy_fraction == pytest.approx(7 / 10)
    assert s10.samples_per_s == pytest.approx(3 / 10)
    assert s10.engines[0].tokens_per_s == pytest.approx(6 / 10) == s10.tokens_per_s
    # the step record keeps the run averages (trained) and the windowed rates (generated)
    assert r10["run/samples_per_s"] == pytest.approx(10 / 30) and r10["run/tokens_per_s"] == pytest.approx(20 / 30)
    assert r10["rate/samples_per_s"] == pytest.approx(3 / 10) and r10["rate/tokens_per_s"] == pytest.approx(6 / 10)
    # after run() the clock stops at the run's end: the numbers stay those of t = 30
    after = c.snapshot()
    assert after.engines[0].busy_fraction == pytest.approx(7 / 10) and after.samples_per_s == pytest.approx(3 / 10)


# --------------------------------------------------------------------------- environment suites
def test_suite_counters_exported_and_suite_closed() -> None:
    cfg = config(run={"steps": 4}, rollout={"group_size": 2, "batch_prompts": 2, "max_retries": 1})
    suite = FakeSuite(fail=lambda t, call: "crash" if call == 0 else None)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, suite, [FakeEngine("e0")], FakeTrainer(), on_step=lambda r: records.append(r.to_dict()))
    summary, _ = run(c)
    assert suite.aclosed == 1
    assert summary.counters["env/fail:crash"] == summary.counters["rollout/retry_env_crash"] == len(suite.calls)
    assert summary.counters["env/steps"] == suite.counters["steps"]
    assert records[-1]["env/fail:crash"] == suite.counters["fail:crash"]
    assert c.snapshot().counters["env/steps"] == suite.counters["steps"]
    # the controller's own Counter (read by the bench) is not mixed with the suite's
    assert not any(k.startswith("env/") for k in c.counters)


def test_faulty_suite_counters_and_aclose_pass_through() -> None:
    """The real envs.faults wrapper: its injected-fault counts reach the records, aclose reaches the inner suite."""
    from envs.faults import FaultySuite, parse_faults

    cfg = config(run={"steps": 4}, rollout={"group_size": 2, "batch_prompts": 2, "max_retries": 3})
    inner = FakeSuite()
    suite = FaultySuite(inner, parse_faults({"crash": 0.3, "delay": {"kind": "constant", "seconds": 0.25}}), seed=1)
    records: list[dict[str, Any]] = []
    summary, _ = run(Controller(cfg, TOK, suite, [FakeEngine("e0")], FakeTrainer(), on_step=lambda r: records.append(r.to_dict())))
    assert inner.aclosed == 1
    crashes = summary.counters["env/crash"]
    assert crashes > 0
    assert crashes == summary.counters.get("rollout/retry_env_crash", 0) + summary.counters.get("rollout/failed_env_crash", 0)
    assert records[-1]["env/delay_s"] == pytest.approx(0.25 * records[-1]["env/calls"])
    assert isinstance(summary.counters["env/delay_s"], int)


# --------------------------------------------------------------------------- dead engines, stale samples
class KillingTrainer(FakeTrainer):
    """Kills an engine from inside prepare_weights(version): dead, and no rollout has noticed yet."""

    def __init__(self, victim: FakeEngine, at_version: int, train_s: float = 0.0) -> None:
        super().__init__(train_s=train_s)
        self.victim, self.at_version = victim, at_version

    async def prepare_weights(self, version: int) -> Any:
        if version == self.at_version:
            self.victim.kill()
        return await super().prepare_weights(version)


def test_engine_dead_before_the_sync_is_skipped_not_fatal() -> None:
    cfg = config(run={"steps": 6}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    script = lambda r, v: ([ord("1")], 1.0)  # noqa: E731
    victim, healthy = FakeEngine("e0", script), FakeEngine("e1", script)
    c = Controller(cfg, TOK, FakeSuite(), [victim, healthy], KillingTrainer(victim, at_version=2, train_s=0.5))
    summary, left = run(c)
    assert summary.steps == 6 and left == set()
    assert summary.counters["weight_sync/found_dead_engines"] == 1
    assert summary.counters["engine/deaths"] == 1  # found at the sync; its rollouts did not count it again
    assert summary.counters["weight_sync/skipped_dead_engines"] == 5  # versions 2..6
    assert victim.updates == [1] and healthy.updates == [1, 2, 3, 4, 5, 6]
    assert c.router.alive == [False, True] and c.snapshot().engines[0].alive is False
    assert summary.counters["engine/retried_requests"] >= 1  # its in-flight rollouts moved to e1


def test_all_engines_dead_at_the_sync_is_a_loud_error() -> None:
    # sync loop: nothing is generating during the sync, so the sync is the first to find out
    cfg = config(run={"steps": 3}, rollout={"group_size": 1, "batch_prompts": 1},
                 scheduler={"async_ratio": 0, "queue_scheduling": False})
    eng = FakeEngine("e0")
    with pytest.raises(RuntimeError, match="no live engine to publish weights version 2"):
        run(Controller(cfg, TOK, FakeSuite(), [eng], KillingTrainer(eng, at_version=2)))


def test_multi_turn_sample_too_stale_is_aborted_early_and_restarted() -> None:
    """Three turns of 1 s each; uid 1's second turn (attempt 0) would take 10 s.

    async_ratio 1, one prompt per step: uid 1 starts at version 0 (t = 0). Batches are taken at
    t = 3 (step 0) and t = 6 (step 1); from t = 6 only steps >= 2 remain, which need version >= 1:
    uid 1 is aborted at t = 6 and restarted at once, instead of running to t = 12 to be dropped.
    """
    def script(r: Generate, v: int) -> tuple[list[int], float]:
        return [ord("1")], (10.0 if r.request_id == "1-0.0.1" else 1.0)

    cfg = config(run={"steps": 4}, rollout={"group_size": 1, "batch_prompts": 1, "max_turns": 3, "max_retries": 0},
                 scheduler={"async_ratio": 1, "queue_scheduling": True, "stale": "drop"})
    eng = FakeEngine("e0", script)
    trainer = FakeTrainer()
    suite = FakeSuite(turns=3)
    summary, left = run(Controller(cfg, TOK, suite, [eng], trainer))
    assert summary.steps == 4 and left == set()
    assert summary.counters["rollout/aborted_stale"] == 1
    assert "stale/dropped_samples" not in summary.counters  # nothing ran to completion only to be dropped
    assert "1-0.0.1" in eng.aborted
    restart = {r.request_id: t for r, t in zip(eng.requests, eng.request_times)}["1-0.1.0"]
    assert restart == 6.0
    trained = {s.sample_id: s for b in trainer.batches for s in b.samples}
    assert "1-0" in trained and min(v for v in trained["1-0"].versions if v >= 0) >= 1
    assert check_staleness(trainer.batches, 1) <= 1
    assert suite.closed == suite.opened


def test_single_turn_stale_sample_is_left_to_the_buffer() -> None:
    """Its first-token version is known only once it is done: no early abort (see rollout.py)."""
    cfg = config(run={"steps": 6}, rollout={"group_size": 1, "batch_prompts": 1},
                 scheduler={"async_ratio": 1, "queue_scheduling": True, "stale": "drop"})
    eng = FakeEngine("e0", lambda r, v: ([ord("1")] * 4, 3.5) if r.request_id.startswith("1-0.") else ([ord("1")], 1.0))
    summary, _ = run(Controller(cfg, TOK, FakeSuite(), [eng], FakeTrainer()))
    assert "rollout/aborted_stale" not in summary.counters
    assert summary.counters["stale/dropped_samples"] == 1


# --------------------------------------------------------------------------- engine restarts
class FakeRestarter:
    """An EngineRestarter: after ``delay`` s of loop time a fresh FakeEngine of the same name (or give up)."""

    def __init__(self, delay: float = 3.0, give_up: bool = False) -> None:
        self.delay, self.give_up = delay, give_up
        self.calls: list[int] = []
        self.made: list[FakeEngine] = []

    async def restart(self, i: int) -> FakeEngine:
        self.calls.append(i)
        await asyncio.sleep(self.delay)
        if self.give_up:
            raise RuntimeError("engine.max_restarts reached (fake)")
        e = FakeEngine(f"e{i}", lambda r, v: ([ord("1")], 1.0))
        self.made.append(e)
        return e


class DiesInSync(FakeEngine):
    """Dies in the middle of the weight sync to ``at_version`` (its process gone mid-broadcast)."""

    def __init__(self, name: str, at_version: int) -> None:
        super().__init__(name, lambda r, v: ([ord("1")], 1.0))
        self.at_version = at_version

    async def update_weights(self, manifest: Any) -> Any:
        if manifest.version == self.at_version:
            await asyncio.sleep(0.05)
            self.kill()
        return await super().update_weights(manifest)


def _check_caught_up(new: FakeEngine, c: Controller) -> None:
    """The restarted engine loaded the published weights before its first request, and then every version."""
    assert new.updates, "the restarted engine never got weights"
    first_load = new._history[1][0]
    assert new.request_times and first_load <= min(new.request_times)
    assert new.updates == list(range(new.updates[0], c.version + 1)) and new.updates[0] >= 1


@pytest.mark.parametrize("how", ["during generation", "during the weight sync"])
def test_dead_engine_is_restarted_caught_up_and_used_again(how: str) -> None:
    cfg = config(run={"steps": 10}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    script = lambda r, v: ([ord("1")], 1.0)  # noqa: E731
    victim = FakeEngine("e0", script, die_at=2.5) if how == "during generation" else DiesInSync("e0", at_version=2)
    healthy = FakeEngine("e1", script)
    restarter = FakeRestarter(delay=3.0)
    c = Controller(cfg, TOK, FakeSuite(), [victim, healthy], FakeTrainer(train_s=0.5), restarter=restarter)
    summary, left = run(c)
    assert summary.steps == 10 and left == set()
    assert summary.counters["engine/deaths"] == 1 and summary.counters["engine/restarts"] == 1
    assert restarter.calls == [0] and c.engines[0] is restarter.made[0] and c.router.alive == [True, True]
    _check_caught_up(restarter.made[0], c)
    assert healthy.updates == list(range(1, 11))  # the live engine never waited on the dead one
    if how == "during generation":
        assert summary.counters["engine/retried_requests"] >= 1  # its in-flight requests moved to e1
    else:
        assert summary.counters["weight_sync/engine_died"] == 1


class HangsOnDeadPeer(FakeTrainer):
    """A send to an engine that died waits until the controller drops that engine (DropWeightPeer), as
    gloo's send to a dead peer can wait its whole timeout (a CI run waited 300 s on an engine SIGKILLed
    mid-sync)."""

    def __init__(self, engines: dict[str, FakeEngine], **kw: Any) -> None:
        super().__init__(**kw)
        self.engines = engines

    async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
        await super().send_weights(version, peers)
        names = list(self.engines) if peers is None else peers
        for _ in range(100_000):  # polled (virtual time), like the sender's wait on each peer's broadcast
            if not any(self.engines[p].dead and p not in self.dropped for p in names if p in self.engines):
                return
            await asyncio.sleep(0.01)
        raise TimeoutError("send to a dead engine never dropped")


@pytest.mark.parametrize("restarts", [True, False])
def test_an_engine_dead_mid_sync_is_dropped_at_the_trainer_so_the_sync_ends(restarts: bool) -> None:
    """The sync to v2 sends to e0, which dies meanwhile: the trainer's send would wait on it until the
    weight-sync timeout; the supervisor's drop ends it, the run goes on with e1 (and e0 comes back when there
    is a restarter)."""
    cfg = config(run={"steps": 10}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    victim, healthy = DiesInSync("e0", at_version=2), FakeEngine("e1", lambda r, v: ([ord("1")], 1.0))
    trainer = HangsOnDeadPeer({"e0": victim}, train_s=0.5)
    restarter = FakeRestarter(delay=3.0) if restarts else None
    c = Controller(cfg, TOK, FakeSuite(), [victim, healthy], trainer, restarter=restarter)
    summary, left = run(c)
    assert summary.steps == 10 and left == set()
    assert trainer.dropped == ["e0"] and healthy.updates == list(range(1, 11))
    if restarter is not None:
        assert summary.counters["engine/restarts"] == 1
        _check_caught_up(restarter.made[0], c)
    else:
        assert c.router.alive == [False, True]


def test_only_engine_dies_rollouts_wait_for_its_restart() -> None:
    cfg = config(run={"steps": 6}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    only = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0), die_at=2.5)
    restarter = FakeRestarter(delay=5.0)
    c = Controller(cfg, TOK, FakeSuite(), [only], FakeTrainer(train_s=0.5), restarter=restarter)
    summary, left = run(c)
    assert summary.steps == 6 and left == set()
    assert summary.counters["engine/restarts"] == 1 and summary.counters.get("rollout/failed_engine_dead", 0) == 0
    _check_caught_up(restarter.made[0], c)


def test_engine_given_up_stays_down_and_the_run_goes_on() -> None:
    cfg = config(run={"steps": 6}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    script = lambda r, v: ([ord("1")], 1.0)  # noqa: E731
    victim, healthy = FakeEngine("e0", script, die_at=2.5), FakeEngine("e1", script)
    c = Controller(cfg, TOK, FakeSuite(), [victim, healthy], FakeTrainer(train_s=1.0), restarter=FakeRestarter(give_up=True))
    summary, left = run(c)
    assert summary.steps == 6 and left == set()
    assert summary.counters["engine/gave_up"] == 1 and summary.counters.get("engine/restarts", 0) == 0
    assert c.router.alive == [False, True]


def test_all_engines_given_up_is_a_loud_error() -> None:
    cfg = config(run={"steps": 6}, rollout={"group_size": 2, "batch_prompts": 2}, scheduler={"async_ratio": 1})
    only = FakeEngine("e0", lambda r, v: ([ord("1")], 1.0), die_at=2.5)
    c = Controller(cfg, TOK, FakeSuite(), [only], FakeTrainer(), restarter=FakeRestarter(give_up=True))
    with pytest.raises(RuntimeError, match="no live engine"):
        run(c)


# --------------------------------------------------------------------------- weight sync beside training
class TimedTrainer(FakeTrainer):
    """Records when each send of a version ended (loop time) and which calls overlapped."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.sent_at: dict[int, float] = {}
        self.sending = 0
        self.prepared_while_sending: list[int] = []

    async def prepare_weights(self, version: int) -> Any:
        if self.sending:
            self.prepared_while_sending.append(version)
        return await super().prepare_weights(version)

    async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
        self.sending += 1
        try:
            await super().send_weights(version, peers)
        finally:
            self.sending -= 1
        self.sent_at[version] = asyncio.get_running_loop().time()


class Recording(FakeEngine):
    """A FakeEngine that keeps every reply's request id and token versions; an eval request takes ``eval_s``."""

    def __init__(self, name: str, eval_s: float, *, sync_s: float) -> None:
        super().__init__(name, lambda r, v: ([ord("1")] * 3, eval_s if r.request_id.startswith("eval") else 0.2),
                         sync_s=sync_s)
        self.outputs: list[tuple[str, list[int]]] = []

    async def generate(self, req: Generate) -> Any:
        out = await super().generate(req)
        self.outputs.append((req.request_id, out.versions))
        return out


def _overlap_run(overlap: bool, ratio: int = 2, steps: int = 6) -> tuple[RunSummary, TimedTrainer, list[FakeEngine], list[dict[str, Any]]]:
    cfg = config(run={"steps": steps, "eval_every": 2}, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": ratio}, weight_sync={"overlap": overlap})
    engines = [FakeEngine(f"e{i}", lambda r, v: ([ord("1")], 0.1), sync_s=1.5) for i in range(2)]
    trainer = TimedTrainer(train_s=2.0, sync_s=1.0)
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=3), engines, trainer, on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == steps
    return summary, trainer, engines, records


def test_overlap_trains_the_next_step_while_the_engines_load() -> None:
    summary, trainer, engines, records = _overlap_run(True)
    serial, s_trainer, s_engines, s_records = _overlap_run(False)
    # the batch of step s+1 is ready (async_ratio 2, generation takes 0.1 s): its training starts before
    # the sync of version s+1 has reached the engines (1.5 s) -- with overlap, never without
    for s in range(1, 6):
        synced = max(e._history[s][0] for e in engines)  # version s loaded on every engine
        assert trainer.train_times[s] < synced, s
        s_synced = max(e._history[s][0] for e in s_engines)
        assert s_trainer.train_times[s] >= s_synced, s
    assert trainer.prepared_while_sending == [] and s_trainer.prepared_while_sending == []
    # every engine loaded every version, in order; the records say where the time went
    assert all(e.updates == [1, 2, 3, 4, 5, 6] for e in engines + s_engines)
    assert [r["step"] for r in records] == [r["step"] for r in s_records] == [0, 1, 2, 3, 4, 5, 6]
    for r, q in zip(records[1:], s_records[1:]):
        assert r["time/weight_sync_s"] == q["time/weight_sync_s"] == pytest.approx(1.5)  # the sync's own time
        assert q["time/sync/wait_s"] == pytest.approx(1.5)  # serial: all of it on the step's path
    assert [r["time/sync/wait_s"] for r in records[2:]] == [0.0] * 5  # 2 s of training hid the 1.5 s sync
    assert records[1]["time/sync/wait_s"] == 0.0  # nothing was pending before step 1
    # same steps, same versions trained per step (generation is fast: on-policy either way), 1.5 s less a step
    assert summary.elapsed_s < serial.elapsed_s - 5 * 1.4
    assert [len(b.samples) for b in trainer.batches] == [len(b.samples) for b in s_trainer.batches]


@pytest.mark.parametrize("eval_s", [0.3, 3.0])
def test_overlap_eval_tokens_come_only_from_the_evaluated_version(eval_s: float) -> None:
    """An eval shorter than the sync (0.3 s against 1 s: it must wait for its version to be loaded)
    and one longer than a train step (3 s against 1 s: the next sync must wait for it): every eval
    token is from the version the eval is of."""
    cfg = config(run={"steps": 7, "eval_every": 2}, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": 2})
    engines = [Recording("e0", eval_s, sync_s=1.0), Recording("e1", eval_s, sync_s=1.0)]
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=4), engines, FakeTrainer(train_s=1.0, sync_s=0.5),
                                   on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == 7
    evals = [(rid, v) for e in engines for rid, v in e.outputs if rid.startswith("eval")]
    assert {int(rid[4:].split("-")[0]) for rid, _ in evals} == {0, 2, 4, 6, 7}
    assert len(evals) == 5 * 4
    for rid, versions in evals:
        version = int(rid[4:].split("-")[0])
        assert versions and set(versions) == {version}, (rid, versions)
    assert [r["step"] for r in records] == list(range(8))
    # every evaluated version was loaded; versions made while an eval held the engines were skipped
    # (one sync to the newest when it ended), each step's record saying so
    for e in engines:
        assert e.updates == sorted(set(e.updates)) and {2, 4, 6, 7} <= set(e.updates) and e.updates[-1] == 7
    skipped = [r["step"] for r in records if r.get("time/sync/skipped")]
    assert len(skipped) == summary.counters.get("weight_sync/skipped_versions", 0)
    assert len(engines[0].updates) == 7 - len(skipped)


def _eval_run(eval_s: float, n_eval: int, *, steps: int = 9, eval_every: int = 4, ratio: int = 2,
              lend: bool = True) -> tuple[RunSummary, list[dict[str, Any]], FakeTrainer]:
    """Training generation 0.2 s a sample, train steps 1 s, eval requests ``eval_s`` each."""
    cfg = config(run={"steps": steps, "eval_every": eval_every}, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": ratio, "admit_during_evals": lend})
    engines = [FakeEngine(f"e{i}", lambda r, v: ([ord("1")] * 3, eval_s if r.request_id.startswith("eval") else 0.2),
                          sync_s=0.1) for i in range(2)]
    trainer = FakeTrainer(train_s=1.0, sync_s=0.05)
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=n_eval), engines, trainer,
                                   on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == steps
    assert [r["step"] for r in records] == list(range(0 if n_eval else 1, steps + 1))
    return summary, records, trainer


def test_a_slow_eval_does_not_stop_the_train_loop() -> None:
    """An eval of 2.5 s (2.5 train steps) at steps 0, 4, 8 and 9: the trainer steps on beside it, on
    samples of the evaluated version (fresh for async_ratio = 2 more steps), so every step takes
    the same time as in a run without evals, and no step waits for an eval."""
    base, base_records, _ = _eval_run(2.5, 0)
    summary, records, trainer = _eval_run(2.5, 4)
    steps = [r for r in records if r["step"] >= 1]
    assert [r["time/step_s"] for r in steps] == [r["time/step_s"] for r in base_records]
    assert all(r["time/eval_wait_s"] == 0.0 for r in steps)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4, 8, 9]
    assert all(r["time/eval_s"] >= 2.5 and r["time/eval/trainer_wait_s"] == 0.0 for r in evals)
    assert all(0.0 < r["eval/engine_share"] <= 1.0 for r in evals)
    # the training clock ran as without evals; only the final eval comes after the last step
    assert steps[-1]["time/elapsed_s"] == base_records[-1]["time/elapsed_s"]
    assert summary.eval_trainer_wait_s == 0.0 and summary.eval_s == pytest.approx(sum(r["time/eval_s"] for r in evals))
    # it trained samples of the held version 2 steps on, and (scheduler.admit_during_evals) groups admitted
    # during the eval into the deferred batches' slots, within 2 * ratio + 1 of their first token
    assert 2 < check_staleness(trainer.batches, 2 * 2 + 1) <= 5 and summary.counters["admitted/lent_slots"] > 0
    assert summary.counters["weight_sync/skipped_versions"] > 0
    assert summary.counters.get("eval/hedged", 0) == 0  # single-turn: a copy would only repeat the same generation
    # without lent slots, every first token is within the bound itself, and no step waits here either
    _, unlent, trainer = _eval_run(2.5, 4, lend=False)
    assert check_staleness(trainer.batches, 2) == 2 and all(r["time/eval_wait_s"] == 0.0 for r in unlent[1:])


def test_slots_lent_during_a_long_eval_spare_the_trainer_a_first_turn_wait() -> None:
    """An eval longer than the bound (6 s, ratio 1, train steps 1 s): without lent slots the trainer waits
    from step 2 to the eval's end (3.8 s); with them (scheduler.admit_during_evals) the groups admitted into them during
    the eval train steps 3 and 4 (first tokens 2R + 1 = 3 versions old at most) and the wait is 1.8 s;
    every group is trained within the bound of the version it counts as completed at."""
    unlent, _, _ = _eval_run(6.0, 2, steps=6, eval_every=0, ratio=1, lend=False)
    lent, _, trainer = _eval_run(6.0, 2, steps=6, eval_every=0, ratio=1)
    assert lent.counters["admitted/lent_slots"] > 0 and "admitted/lent_slots" not in unlent.counters
    assert lent.eval_trainer_wait_s == pytest.approx(unlent.eval_trainer_wait_s - 2.0)
    assert lent.counters.get("stale/over_bound_groups", 0) == 0
    assert check_staleness(trainer.batches, 2 * 1 + 1) == 3


def test_an_eval_longer_than_the_staleness_bound_makes_the_trainer_wait_and_says_so() -> None:
    """An eval of 6 s: after async_ratio steps on the held version's samples the trainer must wait
    for the eval's end (the bound holds); the wait is in the step's time/eval_wait_s and the eval's
    time/eval/trainer_wait_s, and no training rollout generated meanwhile (time/eval/gen_wait_s).
    Without slots lent during the eval (scheduler.admit_during_evals: the test below)."""
    summary, records, trainer = _eval_run(6.0, 2, steps=6, eval_every=0, ratio=1, lend=False)
    check_staleness(trainer.batches, 1)
    waits = {r["step"]: r["time/eval_wait_s"] for r in records if r["step"] >= 1}
    first = records[0]
    assert first["step"] == 0 and first["time/eval/trainer_wait_s"] > 3.0
    assert sum(waits.values()) == pytest.approx(summary.eval_trainer_wait_s)
    assert first["time/eval/trainer_wait_s"] == pytest.approx(sum(waits.values()))
    assert first["time/eval/gen_wait_s"] > 0.0  # the admission slots of the held batches wait for the eval's end
    assert sum(r.get("time/eval/gen_wait_s", 0.0) for r in records) == pytest.approx(summary.eval_gen_wait_s)


@pytest.mark.parametrize("eval_s", [1.1 + 0.05 * k for k in range(30)])
def test_an_eval_ending_during_a_prepare_does_not_send_the_version_it_replaces(eval_s: float) -> None:
    """The eval may end while the train loop prepares the version that supersedes the deferred one:
    the deferred one must not be sent then (the trainer no longer holds it: SendWeights would fail)."""
    cfg = config(run={"steps": 6, "eval_every": 0}, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": 2})
    engines = [FakeEngine("e0", lambda r, v: ([ord("1")] * 3, eval_s if r.request_id.startswith("eval") else 0.2))]
    trainer = FakeTrainer(train_s=1.0, sync_s=0.05, prepare_s=0.1)
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=1), engines, trainer))
    assert left == set() and summary.steps == 6
    assert trainer.sent == engines[0].updates and trainer.sent[-1] == 6


def test_evals_closer_than_one_eval_queue_and_each_sees_one_version() -> None:
    """eval_every 1 with evals of 2.5 s (> a step): each eval waits for the one before; the version it
    evaluates is pinned (never skipped) and every one of its tokens is from that version."""
    cfg = config(run={"steps": 5, "eval_every": 1}, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": 2})
    engines = [Recording("e0", 2.5, sync_s=0.1), Recording("e1", 2.5, sync_s=0.1)]
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=2), engines, FakeTrainer(train_s=1.0, sync_s=0.05),
                                   on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and [r["step"] for r in records] == list(range(6))
    assert [r["step"] for r in records if "eval/accuracy" in r] == list(range(6))
    for e in engines:
        assert e.updates == [1, 2, 3, 4, 5]
        for rid, versions in e.outputs:
            if rid.startswith("eval"):
                assert set(versions) == {int(rid[4:].split("-")[0])}, (rid, versions)
    assert summary.counters.get("eval/mixed_versions", 0) == 0
    # each eval starts when the one before ends: their wall times do not overlap
    assert summary.eval_s == pytest.approx(sum(r["time/eval_s"] for r in records))


def _straggler_run(straggle_s: float) -> tuple[RunSummary, list[dict[str, Any]], list[tuple[str, list[int]]]]:
    """A multi-turn run (2 turns, env steps of 0.1 s) whose step-0 eval has one straggler: the first
    env call of held-out task e3 takes ``straggle_s`` (a tool call in the latency's tail). Train steps
    1 s, async_ratio 2: the trainer can go 3 steps beside an eval."""
    suite = FakeSuite(n_eval=10, turns=2)
    suite.step_s = lambda task, turn: straggle_s if task.id == "e3" and suite.calls[task.id] == 1 else 0.1
    cfg = config(run={"steps": 8, "eval_every": 0}, scheduler={"async_ratio": 2},
                 rollout={"group_size": 2, "batch_prompts": 2, "max_turns": 2})
    # seeded answers: an eval episode's reward is a function of its sampling seeds
    engine = Recording("e0", 0.0, sync_s=0.1)
    engine.script = lambda r, v: ([ord(str(random.Random(r.seed).randrange(10)))], 0.2)
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, suite, [engine], FakeTrainer(train_s=1.0, sync_s=0.05),
                                   on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == 8
    return summary, records, [(rid, v) for rid, v in engine.outputs if rid.startswith("eval")]


def test_a_multi_turn_eval_straggler_gets_a_second_copy_and_the_trainer_does_not_wait() -> None:
    """configs/tools.toml: an eval lasted as long as its slowest episode (one tool call in the latency's
    tail), longer than the async_ratio + 1 steps the trainer can take beside it, so the trainer waited.
    Once 75% of a multi-turn eval's episodes are done, each one still running gets a second copy
    (same task, same seeds, same weights): the copy finishes first here, the eval ends in ~1 s instead of
    30 s, the trainer never waits for it, and the eval's result is the one a run without the straggler gets."""
    summary, records, tokens = _straggler_run(30.0)
    plain, plain_records, plain_tokens = _straggler_run(0.1)
    assert summary.eval_trainer_wait_s == 0.0, summary.eval_trainer_wait_s  # 27 s before the copies
    assert all(r["time/eval_wait_s"] == 0.0 for r in records if r["step"] >= 1)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 8] and evals[0]["time/eval_s"] < 2.0
    assert summary.counters["eval/hedge_won"] == 1 and summary.counters["eval/hedged"] >= 1
    # the same result as without the straggler: the copy sampled the same tokens, on version 0 only
    assert [r["eval/accuracy"] for r in evals] == [r["eval/accuracy"] for r in plain_records if "eval/accuracy" in r]
    won = [(rid, v) for rid, v in tokens if rid.startswith("eval0-3-h1")]
    assert won and all(set(v) == {0} for _, v in won)
    assert all(set(v) == {int(rid[4:].split("-")[0])} for rid, v in tokens)
    # the trainer's steps took the same time as without the straggler
    assert [r["time/step_s"] for r in records if r["step"] >= 1] == [r["time/step_s"] for r in plain_records if r["step"] >= 1]


def test_single_turn_evals_get_no_copies() -> None:
    """A single-turn eval's time is its generation, which a copy with the same seeds repeats on a real
    engine: no copies (configs/tiny.toml's evals are as before), even with one slow request."""
    cfg = config(run={"steps": 4, "eval_every": 0}, scheduler={"async_ratio": 2, "admit_during_evals": False},
                 rollout={"group_size": 2, "batch_prompts": 2})
    engine = FakeEngine("e0", lambda r, v: ([ord("1")], 5.0 if r.request_id.startswith("eval0-3") and "-h" not in r.request_id else 0.2), sync_s=0.1)
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=10), [engine], FakeTrainer(train_s=1.0, sync_s=0.05)))
    assert left == set() and summary.steps == 4
    assert summary.counters.get("eval/hedged", 0) == 0 and summary.eval_trainer_wait_s > 0.0  # it did wait


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["engine", "trainer"])
def test_sync_failure_ends_the_run_with_its_named_error(overlap: bool, where: str) -> None:
    class FailingSend(FakeTrainer):
        async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
            await super().send_weights(version, peers)
            if version == 3:
                raise RuntimeError("trainer rank 0 died while sending weights version 3 (fake)")

    cfg = config(run={"steps": 6}, rollout={"group_size": 1, "batch_prompts": 1}, scheduler={"async_ratio": 2},
                 weight_sync={"overlap": overlap})
    bad = FakeEngine("bad", update_ok=where != "engine")
    trainer = FailingSend(train_s=1.0, sync_s=0.5) if where == "trainer" else FakeTrainer(train_s=1.0, sync_s=0.5)
    engines = [FakeEngine("e0"), bad]
    c = Controller(cfg, TOK, FakeSuite(), engines, trainer)

    async def main() -> set[asyncio.Task[Any]]:
        with pytest.raises(RuntimeError) as ei:
            await c.run()
        want = "engine bad failed to load weights version 1" if where == "engine" else "while sending weights version 3"
        assert want in str(ei.value)
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert run_virtual(main).result == set()
    assert c.status == "crashed"
    assert c.version <= (1 if where == "engine" else 4)  # at most the step beside the failed sync was trained


@pytest.mark.parametrize("overlap", [True, False])
def test_sync_mode_with_overlap_runs_to_completion_on_policy(overlap: bool) -> None:
    """async_ratio 0: the next batch needs the new weights, so the loop is serial whatever the switch;
    every token of step s's batch is from version s; evals and checkpoints on the way."""
    cfg = config(run={"steps": 6, "eval_every": 2}, rollout={"group_size": 2, "batch_prompts": 2},
                 scheduler={"async_ratio": 0, "queue_scheduling": False}, weight_sync={"overlap": overlap})
    engines = [FakeEngine(f"e{i}", long_tail(i), sync_s=0.5) for i in range(2)]
    trainer = FakeTrainer(train_s=1.0, sync_s=0.25)
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=2), engines, trainer, on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == 6 and summary.stop_reason == "steps"
    assert all(v == b.step for b in trainer.batches for s in b.samples for v in s.versions)
    assert summary.counters.get("stale/dropped_samples", 0) == 0
    assert [r["step"] for r in records] == list(range(7))


def test_a_step_record_says_how_busy_the_least_busy_engine_was() -> None:
    """Each WeightsUpdated carries how busy its engine was since its previous update; the step record
    of that sync gets the least busy engine's (engine/stepping, engine/commands, engine/busy = their sum)."""
    cfg = config(run={"steps": 3, "eval_every": 0}, rollout={"group_size": 2, "batch_prompts": 2})
    occ = [{"stepping": 0.7, "commands": 0.25}, {"stepping": 0.5, "commands": 0.1}]
    engines = [FakeEngine(f"e{i}", lambda r, v: ([ord("1")], 0.01), occupancy=occ[i]) for i in range(2)]
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=3), engines, FakeTrainer(),
                                   on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == 3
    for r in records[1:]:
        assert (r["engine/stepping"], r["engine/commands"]) == (0.5, 0.1)
        assert r["engine/busy"] == pytest.approx(0.6)
        assert not any(k.startswith("time/sync/occupancy") for k in r)
    assert StepRecord.from_dict(records[1]).to_dict() == records[1]


def test_a_step_record_has_the_largest_engine_sync_extra_bytes() -> None:
    """engine/sync_extra_bytes: the most receive-buffer bytes any engine held for the step's sync (weight_sync.load)."""
    cfg = config(run={"steps": 3, "eval_every": 0}, rollout={"group_size": 2, "batch_prompts": 2})
    # the engine holding less answers last: the record must keep the largest, not the last
    engines = [FakeEngine(f"e{i}", lambda r, v: ([ord("1")], 0.01), occupancy={"stepping": 0.5}, extra_bytes=b, sync_s=s)
               for i, (b, s) in enumerate(((1000, 0.1), (64 << 20, 0.0)))]
    records: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_eval=3), engines, FakeTrainer(),
                                   on_step=lambda r: records.append(r.to_dict())))
    assert left == set() and summary.steps == 3
    assert [r["engine/sync_extra_bytes"] for r in records[1:]] == [64 << 20] * 3


# --------------------------------------------------------------------------- stale modes: wait and partial
@settings(max_examples=25, deadline=None)
@given(**RUN_SHAPES, turns=st.integers(1, 2))
def test_wait_never_trains_a_sample_past_the_bound_and_never_drops_one(
        ratio: int, seed: int, batch: int, group: int, n_engines: int, queue: bool, redundancy: int, overlap: bool,
        turns: int) -> None:
    cfg = config(
        run={"steps": 8, "seed": seed},
        rollout={"group_size": group, "batch_prompts": batch, "redundancy": redundancy, "max_new_tokens": 4,
                 "max_turns": turns},
        scheduler={"async_ratio": ratio, "queue_scheduling": queue, "stale": "wait"},
        weight_sync={"overlap": overlap},
    )
    engines = [FakeEngine(f"e{i}", long_tail(seed + i), sync_s=0.5) for i in range(n_engines)]
    trainer = FakeTrainer(train_s=random.Random(seed).uniform(0.1, 1.0), sync_s=0.3)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, FakeSuite(n_train=5, turns=turns), engines, trainer,
                   on_step=lambda r: records.append(r.to_dict()))
    summary, left = run(c)
    assert left == set() and summary.steps == 8
    worst = check_staleness(trainer.batches, ratio)
    assert max(r["staleness/max"] for r in records) == worst <= ratio
    for name in ("stale/dropped_samples", "stale/dropped_tokens", "rollout/aborted_stale", "stale/over_bound_groups"):
        assert name not in summary.counters, (name, summary.counters)
    assert [len(b.samples) for b in trainer.batches] == [batch * group] * 8
    groups = [s.group for b in trainer.batches for s in b.samples]
    assert len(set(groups)) == 8 * batch


def test_drop_mode_drops_on_the_same_long_tail() -> None:
    """The long tail of the wait test does make drop mode drop samples: that test is not vacuous."""
    dropped = 0
    for seed in range(4):
        cfg = config(run={"steps": 8, "seed": seed}, rollout={"group_size": 2, "batch_prompts": 2, "max_new_tokens": 4},
                     scheduler={"async_ratio": 1, "stale": "drop"})
        records: list[dict[str, Any]] = []
        summary, _ = run(Controller(cfg, TOK, FakeSuite(n_train=5), [FakeEngine("e0", long_tail(seed), sync_s=0.5)],
                                    FakeTrainer(train_s=0.5, sync_s=0.3), on_step=lambda r, out=records: out.append(r.to_dict())))
        dropped += summary.counters["stale/dropped_samples"]
        # each step's line says what it dropped since the previous one: they add up to the run's counters
        assert sum(r["dropped/samples"] for r in records if "samples" in r) == summary.counters["stale/dropped_samples"]
        assert sum(r["dropped/tokens"] for r in records if "samples" in r) == summary.counters["stale/dropped_tokens"] > 0
    assert dropped > 0


class RecordingEngine(FakeEngine):
    """A FakeEngine that keeps every answer it returned (what the trainer must be given, token by token)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.answers: dict[str, Any] = {}

    async def generate(self, req: Generate) -> Any:
        out = await super().generate(req)
        self.answers[req.request_id] = out
        return out


@pytest.mark.parametrize("mode", ["wait", "partial"])
def test_a_response_spanning_two_weight_updates_is_trained_with_the_engines_versions_and_logprobs(mode: str) -> None:
    """uid 1's only sample generates 10 tokens over 10 s while other steps are trained and published
    (every other sample takes 1 s): its tokens carry at least versions 0, 1 and 2 and the behaviour
    logprobs the engine returned, and the trainer gets exactly those, token by token (no drop, no
    regeneration). wait holds step 2 for it (its deadline); partial trains on without it."""
    def script(r: Generate, v: int) -> tuple[list[int], float]:
        return ([ord("7")] * 10, 10.0) if r.request_id.startswith("1-0.") else ([ord("1")], 1.0)

    cfg = config(run={"steps": 12}, rollout={"group_size": 1, "batch_prompts": 1, "max_new_tokens": 10},
                 scheduler={"async_ratio": 2, "stale": mode}, log={"samples_per_step": 1})
    eng = RecordingEngine("e0", script)
    trainer = FakeTrainer(train_s=1.0)
    records: list[dict[str, Any]] = []
    lines: list[dict[str, Any]] = []
    summary, left = run(Controller(cfg, TOK, FakeSuite(n_train=9), [eng], trainer,
                                   on_step=lambda r: records.append(r.to_dict()), on_samples=lines.extend))
    assert summary.steps == 12 and left == set()
    trained = {s.sample_id: (b.step, s) for b in trainer.batches for s in b.samples}
    step, sample = trained["1-0"]
    got = eng.answers["1-0.0.0"]  # one attempt, one turn: nothing was regenerated
    assert [r.request_id for r in eng.requests if r.request_id.startswith("1-0.")] == ["1-0.0.0"]
    assert len(set(got.versions)) >= 3 and got.versions == sorted(got.versions)  # spans two updates or more
    assert sample.response_ids == got.token_ids
    assert sample.versions == got.versions and sample.behav_logp == got.logprobs
    assert sample.loss_mask == [1] * 10
    if mode == "wait":
        assert step == 2 and set(got.versions) == {0, 1, 2}  # held at its deadline: s - version_start <= 2
    else:
        assert step - got.versions[-1] <= 2 and step > 2  # trained within the bound of its completion
    assert "stale/dropped_samples" not in summary.counters
    # its lineage, in samples.jsonl and in its step's metrics.jsonl line
    line = next(ln for ln in lines if ln["sample_id"] == "1-0")
    first, last = got.versions[0], got.versions[-1]
    assert line["step"] == step + 1 and line["response_tokens"] == 10
    assert (line["version_first"], line["version_last"], line["updates_spanned"]) == (first, last, last - first)
    assert line["interrupted"] is True and line["restarts"] == 0 and line["staleness"] == step - first
    assert line["token_staleness_mean"] == pytest.approx(step - sum(got.versions) / 10)
    rec = next(r for r in records if r["step"] == step + 1)
    assert rec["tokens/trained"] == 10 and rec["len/trained_mean"] == 10.0
    assert rec["lineage/updates_spanned_mean"] == last - first and rec["lineage/interrupted_frac"] == 1.0
    assert rec["staleness/token_mean"] == pytest.approx(step - sum(got.versions) / 10)
    assert all(r["dropped/samples"] == 0 and r["dropped/tokens"] == 0 for r in records if "samples" in r)
    others = [ln for ln in lines if ln["sample_id"] != "1-0"]
    assert others and not any(ln["interrupted"] for ln in others)  # 1 s samples ran between two updates


class WeighingTrainer(FakeTrainer):
    """Reports a per-sample behaviour weight as a real trainer does (here: the sample's length, to tell them apart)."""

    async def train_step(self, batch: TrainBatch) -> Any:
        r = await super().train_step(batch)
        return msgspec.structs.replace(r, sample_iw=[float(len(s.response_ids)) for s in batch.samples])


def test_samples_jsonl_carries_each_trained_samples_importance_ratio() -> None:
    cfg = config(run={"steps": 3}, rollout={"group_size": 3, "batch_prompts": 2, "max_new_tokens": 6},
                 log={"samples_per_step": 6})
    lines: list[dict[str, Any]] = []
    run(Controller(cfg, TOK, FakeSuite(), [FakeEngine("e0")], WeighingTrainer(), on_samples=lines.extend))
    train = [ln for ln in lines if ln["kind"] == "train"]
    assert len(train) == 18
    assert all(ln["importance_ratio"] == float(ln["response_tokens"]) for ln in train)
    # a trainer that does not report it: null, not a made-up number
    lines.clear()
    run(Controller(cfg, TOK, FakeSuite(), [FakeEngine("e0")], FakeTrainer(), on_samples=lines.extend))
    assert all(ln["importance_ratio"] is None for ln in lines if ln["kind"] == "train")
