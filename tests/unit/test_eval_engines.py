"""run.eval_engines: evals on engines set apart, the others loading each new version meanwhile
(controller/publisher.py, scheduler.Router.reserve), on fakes and a virtual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from flashrl.config import Config, ConfigError, load
from flashrl.controller.controller import Controller, RunSummary
from flashrl.controller.scheduler import EVAL_ENGINES, Router
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeSuite, FakeTokenizer, FakeTrainer
from flashrl.wire.protocol import Generate, TrainBatch

TOK = FakeTokenizer()


class Recording(FakeEngine):
    """Keeps every reply's request id and token versions; an eval request takes ``eval_s``."""

    def __init__(self, name: str, eval_s: float) -> None:
        super().__init__(name, lambda r, v: ([ord("1")] * 3, eval_s if r.request_id.startswith("eval") else 0.2),
                         sync_s=0.1)
        self.outputs: list[tuple[str, list[int]]] = []

    async def generate(self, req: Generate) -> Any:
        out = await super().generate(req)
        self.outputs.append((req.request_id, out.versions))
        return out


def _run(eval_engines: int, eval_s: float, *, eval_every: int, steps: int = 8, ratio: int = 1,
         n_engines: int = 2) -> tuple[RunSummary, list[dict[str, Any]], list[Recording], FakeTrainer]:
    cfg = msgspec.convert({"run": {"steps": steps, "eval_every": eval_every, "eval_engines": eval_engines},
                           "rollout": {"group_size": 2, "batch_prompts": 2},
                           # no slots lent during evals (scheduler.admit_during_evals): the hold stalls as it would
                           "scheduler": {"async_ratio": ratio, "admit_during_evals": False},
                           "engine": {"count": n_engines}}, Config)
    engines = [Recording(f"e{i}", eval_s) for i in range(n_engines)]
    trainer = FakeTrainer(train_s=1.0, sync_s=0.05)
    records: list[dict[str, Any]] = []
    c = Controller(cfg, TOK, FakeSuite(n_eval=4), engines, trainer, on_step=lambda r: records.append(r.to_dict()))

    async def main() -> tuple[RunSummary, set[asyncio.Task[Any]]]:
        summary = await c.run()
        return summary, {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    summary, left = run_virtual(main).result
    assert left == set() and summary.steps == steps
    assert [r["step"] for r in records] == list(range(steps + 1))
    return summary, records, engines, trainer


def _staleness(batches: list[TrainBatch], ratio: int) -> None:
    for b in batches:
        for s in b.samples:
            start = next(v for v, m in zip(s.versions, s.loss_mask) if m)
            assert b.step - start <= ratio, (b.step, s.sample_id, start)


def _eval_tokens_of_their_version(engines: list[Recording]) -> list[str]:
    """Every eval token is of the version its eval is of; returns the engines that served evals."""
    served = []
    for e in engines:
        for rid, versions in e.outputs:
            if rid.startswith("eval"):
                assert set(versions) == {int(rid[4:].split("-")[0])}, (e.name, rid, versions)
                served.append(e.name)
    return sorted(set(served))


def test_an_eval_longer_than_the_staleness_bound_stalls_the_trainer_only_when_it_holds_every_engine() -> None:
    """A 6 s eval (6 train steps, async_ratio 1). On every engine (eval_engines = 0) the trainer waits
    for its end, as the bound requires. On one of two, the other engine loads each new version
    meanwhile and serves the training rollouts: no wait, the bound still holds, every eval token is
    of the evaluated version, and once the eval ends its engine catches up and serves training again."""
    held, held_records, _, held_trainer = _run(0, 6.0, eval_every=0)
    assert held.eval_trainer_wait_s > 3.0  # the case this mode exists for
    summary, records, engines, trainer = _run(1, 6.0, eval_every=0)
    assert summary.eval_trainer_wait_s == 0.0 and all(r["time/eval_wait_s"] == 0.0 for r in records[1:])
    _staleness(trainer.batches, 1)
    _staleness(held_trainer.batches, 1)
    assert summary.counters.get("eval/mixed_versions", 0) == 0
    _eval_tokens_of_their_version(engines)
    step0 = {e.name for e in engines for rid, _ in e.outputs if rid.startswith("eval0-")}
    assert len(step0) == 1
    other = next(e for e in engines if e.name not in step0)
    apart = next(e for e in engines if e.name in step0)
    # the other engine took every version as made; the eval's engine caught up after its eval, in one load
    assert other.updates == list(range(1, 9))
    assert apart.updates[-1] == 8 and len(apart.updates) < len(other.updates)
    assert summary.counters["weight_sync/eval_rejoins"] >= 1
    # no training request went to the eval's engine while it held version 0 (its training tokens are 0
    # only from rollouts routed before the eval began)
    late = [rid for rid, v in apart.outputs if not rid.startswith("eval") and v and v[0] == 0 and v[-1] == 0]
    assert len(late) <= 4  # step 0's first batch, routed before the eval's first request
    # it trained on fresh samples: the run took about steps x train time, not the eval's length
    assert records[-1]["time/elapsed_s"] < held_records[-1]["time/elapsed_s"] - 3.0


def test_queued_evals_on_engines_set_apart_each_see_their_version() -> None:
    """eval_every 1 with 2.5 s evals: each eval waits for the one before; its version goes to the other
    engine at once and to the eval's engine when that one ends (the trainer keeps it until then)."""
    summary, records, engines, trainer = _run(1, 2.5, eval_every=1, steps=5, ratio=2)
    assert [r["step"] for r in records if "eval/accuracy" in r] == list(range(6))
    assert summary.counters.get("eval/mixed_versions", 0) == 0
    _eval_tokens_of_their_version(engines)
    _staleness(trainer.batches, 2)
    for e in engines:
        assert e.updates == sorted(set(e.updates)) and e.updates[-1] == 5


def test_one_engine_evals_on_it_as_before() -> None:
    """eval_engines = 1 with one engine: nothing to set apart, the eval holds it (and the trainer waits)."""
    summary, _, engines, trainer = _run(1, 6.0, eval_every=0, n_engines=1)
    assert summary.eval_trainer_wait_s > 3.0 and summary.counters.get("weight_sync/eval_rejoins", 0) == 0
    _eval_tokens_of_their_version(engines)
    _staleness(trainer.batches, 1)


def test_router_keeps_training_off_reserved_engines_and_evals_on_them() -> None:
    r = Router(3, 4)
    r.reserve(frozenset({1}))
    assert sorted(r.pick() for _ in range(6)) == [0, 0, 0, 2, 2, 2]
    token = EVAL_ENGINES.set(frozenset({1}))
    try:
        assert [r.pick() for _ in range(3)] == [1, 1, 1]
        r.mark_dead(1)
        assert r.pick() in (0, 2)  # none of the eval's engines is live: any live one
    finally:
        EVAL_ENGINES.reset(token)
    r.revive(1)
    r.mark_dead(0)
    r.mark_dead(2)
    assert r.pick() == 1  # training on a reserved engine only when no other is live
    r.revive(0)
    r.reserve(frozenset())
    picks = {r.pick() for _ in range(4)}
    assert picks == {0, 1}


def test_eval_engines_over_the_engine_count_is_refused(tmp_path: Any) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[run]\neval_engines = 3\n[engine]\ncount = 2\n')
    with pytest.raises(ConfigError, match=r"run.eval_engines: 3 .* engine.count = 2; set run.eval_engines <= engine.count"):
        load(p)


class Timeline(FakeEngine):
    """Keeps (start, end, request id) of every request on the loop clock."""

    def __init__(self, name: str) -> None:
        super().__init__(name, lambda r, v: ([ord("1")] * 3, 1.0 if r.request_id.startswith("eval") else 0.3),
                         sync_s=0.1)
        self.spans: list[tuple[float, float, str]] = []

    async def generate(self, req: Generate) -> Any:
        t0 = asyncio.get_running_loop().time()
        out = await super().generate(req)
        self.spans.append((t0, asyncio.get_running_loop().time(), req.request_id))
        return out


def test_an_eval_on_engines_set_apart_starts_once_their_training_rollouts_ended() -> None:
    """Multi-turn training episodes routed to an engine before an eval set it apart stay there: the eval
    waits for them (their later turns would wait behind the eval's requests for the engine's permits, and
    their groups with them). On every engine, no training request runs while an eval request does."""
    suite = FakeSuite(n_eval=6, turns=3)
    suite.step_s = lambda task, turn: 0.2
    cfg = msgspec.convert({"run": {"steps": 6, "eval_every": 2, "eval_engines": 1}, "scheduler": {"async_ratio": 2},
                           "rollout": {"group_size": 2, "batch_prompts": 4, "max_turns": 3},
                           "engine": {"count": 2, "max_num_seqs": 4}}, Config)
    engines = [Timeline(f"e{i}") for i in range(2)]
    c = Controller(cfg, TOK, suite, engines, FakeTrainer(train_s=1.0, sync_s=0.05))

    async def main() -> RunSummary:
        return await c.run()

    summary = run_virtual(main).result
    assert summary.steps == 6
    overlaps = 0
    for e in engines:
        evals = [(a, b) for a, b, rid in e.spans if rid.startswith("eval")]
        for a, b, rid in e.spans:
            if not rid.startswith("eval"):
                overlaps += sum(1 for x, y in evals if a < y and x < b)
    assert overlaps == 0
