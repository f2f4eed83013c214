"""Checkpoints and resume on fakes (virtual clock): atomic folders, resume equivalence, faults, bad input.

The real-process version (vLLM engines, a trainer rank, `flashrl run --resume`) is in
tests/integration/test_resume.py (slow).
"""

from __future__ import annotations

import asyncio
import errno
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flashrl.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    ControllerState,
    list_checkpoints,
    read_latest,
    verify,
)
from flashrl.config import Config, from_dict, to_toml
from flashrl.controller.controller import Controller, RunSummary
from flashrl.controller.scheduler import DataStream
from flashrl.core.records import StepRecord
from flashrl.metrics import MetricsWriter, read_jsonl
from flashrl.resuming import continue_metrics, find_checkpoint, prepare_resume
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import (
    FakeEngine,
    FakeSuite,
    FakeTokenizer,
    FakeTrainer,
    default_script,
)
from flashrl.wire.protocol import TrainBatch
from flashrl.wire.trajectory import snapshot

TOK = FakeTokenizer()


def untimed(batches: list[TrainBatch]) -> list[TrainBatch]:
    """The batches with their samples as a checkpoint keeps them: without the generating process's timings."""
    return [TrainBatch(step=b.step, samples=[snapshot(t) for t in b.samples]) for b in batches]

def config(tmp: Path, **sections: Any) -> Config:
    sections.setdefault("run", {})
    sections["run"] = {"output_dir": str(tmp), "name": "r", **sections["run"]}
    return msgspec.convert(sections, Config)


def with_run(cfg: Config, **run: Any) -> Config:
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, **run))


class Run:
    """One controller run on fakes with checkpoints and a metrics.jsonl, like launch.driver.run_local."""

    def __init__(self, cfg: Config, suite: FakeSuite, *, resume: Any = None, engines: int = 2,
                 trainer: FakeTrainer | None = None, stop_at_s: float | None = None, script: Any = None,
                 background: bool = False) -> None:
        self.cfg = cfg
        self.trainer = trainer or FakeTrainer(train_s=0.5)
        self.engines = [FakeEngine(f"e{i}", script or default_script(token_s=0.05 * (i + 1)), sync_s=0.2)
                        for i in range(engines)]
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = cfg.run_dir / "metrics.jsonl"
        if resume is not None:
            continue_metrics(metrics, resume)
        self.writer = MetricsWriter(metrics)
        self.records: list[dict[str, Any]] = []
        self.ckpt = CheckpointWriter(cfg.run_dir / "checkpoints", self.trainer, to_toml(cfg), cfg.run.keep_checkpoints,
                                     last_step=resume.step if resume else None, background=background)
        self.controller = Controller(cfg, TOK, suite, self.engines, self.trainer, on_step=self._on_step,
                                     checkpoints=self.ckpt, resume=resume.state if resume else None)
        self.stop_at_s = stop_at_s

    def _on_step(self, r: StepRecord) -> None:
        self.records.append(r.to_dict())
        self.writer.write(r)

    def go(self) -> RunSummary:
        async def main() -> RunSummary:
            if self.stop_at_s is not None:
                asyncio.get_running_loop().call_later(self.stop_at_s, self.controller.request_stop)
            return await self.controller.run()

        try:
            return run_virtual(main).result
        finally:
            self.writer.close()


def trained(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    return {r["step"]: r["prompt_uids"] for r in records if "prompt_uids" in r}


def sync_cfg(tmp: Path, stale: str = "partial", **run: Any) -> Config:
    return config(
        tmp,
        run={"steps": 6, "seed": 3, "eval_every": 2, "checkpoint_every": 2, **run},
        rollout={"group_size": 3, "batch_prompts": 2, "max_new_tokens": 5},
        scheduler={"async_ratio": 0, "queue_scheduling": True, "stale": stale},
    )


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
@pytest.mark.parametrize("stale", ["drop", "partial"])
def test_sync_resume_trains_exactly_what_the_uninterrupted_run_trains(tmp_path: Path, stale: str,
                                                                       background: bool) -> None:
    """async_ratio 0: stop at step 3, resume to 6 == 6 uninterrupted steps (prompts, samples, versions).

    The first run ends at its step count, so it admitted nothing past its last batch (buffer invariant
    5): nothing is in flight at its final checkpoint, and the resumed run admits the next prompts of
    the same stream. Stops mid-run, with rollouts in flight, are tests/unit/test_resume_rollouts.py's.
    background: the checkpoints are written while the next steps train (trainer.checkpoint_async)."""
    suite = lambda: FakeSuite(n_train=5, n_eval=3)  # noqa: E731  (5 prompts: the epoch ends mid-batch)
    ref = Run(sync_cfg(tmp_path / "a", stale), suite())
    ref.go()

    cfg = sync_cfg(tmp_path / "b", stale, steps=3)
    trainer = FakeTrainer(train_s=0.5)
    trainer.ckpt_write_s = 0.8  # longer than a step: the step after the checkpoint trains beside its write
    first = Run(cfg, suite(), trainer=trainer, background=background)
    s1 = first.go()
    if background:
        assert trainer.train_during_write == [2]  # step-2's write went on while step 3 (batch 2) trained
        assert [(r["step"], r["time/ckpt_write_s"]) for r in first.records if "time/ckpt_write_s" in r] == [
            (3, pytest.approx(0.8, abs=0.01))]  # reported with the step it completed in
    else:
        assert trainer.train_during_write == []
    assert s1.steps == 3 and s1.checkpoints == 2 and s1.last_checkpoint == str(cfg.run_dir / "checkpoints" / "step-3")
    assert [n for n, _ in list_checkpoints(cfg.run_dir / "checkpoints")] == [2, 3]
    r = prepare_resume(with_run(cfg, steps=6))  # run.steps may change on resume
    assert r.step == 3 and r.state.metrics_through == 3
    second = Run(with_run(cfg, steps=6), suite(), resume=r, background=background)
    s2 = second.go()
    assert s2.steps == 6 and s2.resumed_from == 3

    if stale == "partial":
        both = trained(first.records) | trained(second.records)
        assert {k: sorted(v) for k, v in both.items()} == {k: sorted(v) for k, v in trained(ref.records).items()}
        assert s2.counters["resume/restored_groups"] == 0 and s2.counters["resume/regenerated_tokens"] == 0
    else:
        assert trained(first.records) | trained(second.records) == trained(ref.records)
        # same samples, same versions (the timings of the processes that generated them differ: not compared)
        assert untimed(first.trainer.batches + second.trainer.batches) == untimed(ref.trainer.batches)
    # the resumed engines got the checkpoint's weights (version 3) before any request
    assert [e.version for e in second.engines] == [6, 6] and second.trainer.prepared[0] == 3
    # metrics.jsonl: every step exactly once, the evals where the uninterrupted run has them
    lines = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [x["step"] for x in lines] == list(range(7))
    evals = [x["step"] for x in ref.records if "eval/accuracy" in x]
    assert [x["step"] for x in lines if "eval/accuracy" in x] == sorted(evals + [3])  # + the first run's final eval
    assert lines[-1]["time/elapsed_s"] == pytest.approx(ref.records[-1]["time/elapsed_s"], rel=0.2)


def test_env_suite_counters_continue_across_a_resume(tmp_path: Path) -> None:
    """The suite's own counters (env/<name> in metrics.jsonl) are in the checkpoint: a resumed run's
    records continue them (here env/steps: one per rollout) instead of starting again from 0."""
    suite = lambda: FakeSuite(n_train=5, n_eval=0)  # noqa: E731
    ref = Run(sync_cfg(tmp_path / "a", eval_every=0), suite())
    ref.go()
    cfg = sync_cfg(tmp_path / "b", steps=3, eval_every=0)
    first = Run(cfg, suite())
    first.go()
    r = prepare_resume(with_run(cfg, steps=6))
    assert r.state.env_counters["env/steps"] == first.records[-1]["env/steps"] > 0
    second = Run(with_run(cfg, steps=6), suite(), resume=r)
    second.go()
    assert second.controller.suite.counters["steps"] < second.records[-1]["env/steps"]  # this process's share only
    assert second.records[-1]["env/steps"] == ref.records[-1]["env/steps"] == 6 * 2 * 3


def test_dropped_uids_are_checkpointed_and_kept_on_resume(tmp_path: Path) -> None:
    """A group given up (dropped/groups_*) is named by uid in the checkpoint, and a resumed run keeps the list."""
    cfg = sync_cfg(tmp_path, steps=3, eval_every=0)
    first = Run(cfg, FakeSuite(n_train=5, n_eval=0))
    first.go()
    r = prepare_resume(with_run(cfg, steps=6))
    assert r.state.dropped_uids == []
    r.state.dropped_uids = [97]  # as if uid 97 had been dropped before the checkpoint
    Run(with_run(cfg, steps=6), FakeSuite(n_train=5, n_eval=0), resume=r).go()
    assert find_checkpoint(cfg.run_dir).state.dropped_uids == [97]


def epoch_check(stream: DataStream, uids: list[int], epochs: int) -> None:
    """Every prompt of each of the first ``epochs`` epochs trained exactly once."""
    assert len(uids) == len(set(uids)), "a prompt uid was trained twice"
    n = stream.size
    for e in range(epochs):
        ids = sorted(stream.task_of(u).id for u in uids if u // n == e)
        assert ids == sorted(t.id for t in FakeSuite(n_train=n).train_tasks()), f"epoch {e}: {ids}"


@pytest.mark.parametrize("stops", [1, 3])
def test_async_resume_trains_every_prompt_of_an_epoch_once(tmp_path: Path, stops: int) -> None:
    """async_ratio 2, interrupted (request_stop, as on Ctrl-C) ``stops`` times with rollouts in flight."""
    cfg = config(tmp_path, run={"steps": 20, "seed": 5, "eval_every": 0, "checkpoint_every": 3},
                 rollout={"group_size": 3, "batch_prompts": 2, "max_new_tokens": 6},
                 scheduler={"async_ratio": 2, "queue_scheduling": True, "stale": "drop"})
    suite = lambda: FakeSuite(n_train=7, n_eval=2)  # noqa: E731  (7 prompts: 5+ epochs in 20 steps)
    records: list[dict[str, Any]] = []
    run = Run(cfg, suite(), stop_at_s=3.0)
    summary = run.go()
    assert summary.stop_reason == "interrupted" and 0 < summary.steps < 8
    records += run.records
    readmitted = 0
    for k in range(stops):
        r = find_checkpoint(cfg.run_dir)
        assert r.step == summary.steps  # the stop wrote a checkpoint of the last finished step
        readmitted += len(r.state.readmit)
        run = Run(cfg, suite(), resume=r, stop_at_s=2.5 if k + 1 < stops else None)
        summary = run.go()
        records = [x for x in records if x["step"] <= r.state.metrics_through] + run.records
    assert summary.steps == 20 and summary.stop_reason == "steps"
    assert readmitted > 0  # rollouts were in flight at the checkpoints: their prompts came back
    uids = [u for x in records for u in x.get("prompt_uids", [])]
    epoch_check(DataStream(suite().train_tasks(), 5), uids, epochs=5)
    lines = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [x["step"] for x in lines] == list(range(21))  # no duplicate, no missing step
    assert max(x["staleness/max"] for x in lines if x["step"]) <= 2


def tail_script(req: Any, version: int) -> tuple[list[int], float]:
    """One sample in four takes 4-8 s, the others 0.2-0.6 s (a long tail that makes drop mode drop)."""
    rng = random.Random(req.seed)
    n = rng.randint(1, req.max_tokens)
    return [ord("1")] * n, rng.uniform(4, 8) if rng.random() < 0.25 else rng.uniform(0.2, 0.6)


@pytest.mark.parametrize("mode", ["drop", "wait", "partial"])
def test_resume_loses_none_of_the_lineage_bookkeeping(tmp_path: Path, mode: str) -> None:
    """Interrupted with rollouts in flight, then resumed: metrics.jsonl's per-step dropped/samples,
    dropped/tokens and tokens/trained add up to the run's totals (nothing counted twice or lost across
    the resume), wait keeps its strict bound and nothing is dropped outside drop."""
    cfg = config(tmp_path, run={"steps": 14, "seed": 2, "eval_every": 0, "checkpoint_every": 2},
                 rollout={"group_size": 2, "batch_prompts": 2, "max_new_tokens": 6},
                 scheduler={"async_ratio": 1, "queue_scheduling": True, "stale": mode})
    suite = lambda: FakeSuite(n_train=9, n_eval=0)  # noqa: E731
    first = Run(cfg, suite(), stop_at_s=9.0, script=tail_script)
    s1 = first.go()
    assert s1.stop_reason == "interrupted" and 2 < s1.steps < 14
    r = find_checkpoint(cfg.run_dir)
    second = Run(cfg, suite(), resume=r, script=tail_script)
    s2 = second.go()
    assert s2.steps == 14 and s2.resumed_from == s1.steps
    lines = [x for x in read_jsonl(cfg.run_dir / "metrics.jsonl") if "samples" in x]
    assert [x["step"] for x in lines] == list(range(1, 15))
    c = s2.counters
    assert sum(x["dropped/samples"] for x in lines) == c.get("stale/dropped_samples", 0) + c.get("rollout/aborted_stale", 0)
    assert sum(x["dropped/tokens"] for x in lines) == c.get("stale/dropped_tokens", 0)
    assert sum(x["tokens/trained"] for x in lines) == s2.tokens_trained
    if mode == "drop":
        assert r.state.counters.get("stale/dropped_samples", 0) > 0  # drops on both sides of the resume
        assert c["stale/dropped_samples"] > r.state.counters["stale/dropped_samples"]
    else:
        assert sum(x["dropped/samples"] for x in lines) == 0 and "stale/over_bound_groups" not in c
    if mode == "wait":
        assert max(x["staleness/max"] for x in lines) <= 1


def test_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = sync_cfg(tmp_path, steps=6)
    trainer = FakeTrainer(train_s=0.5)
    run = Run(cfg, FakeSuite(n_train=5), trainer=trainer)
    saves = []
    orig = trainer.save_checkpoint

    async def save(path: Any) -> None:
        saves.append(path)
        if len(saves) >= 2:  # the disk fills up after the first checkpoint
            trainer.fail_save = OSError(errno.ENOSPC, "No space left on device")
        await orig(path)

    trainer.save_checkpoint = save  # type: ignore[method-assign]
    summary = run.go()
    root = cfg.run_dir / "checkpoints"
    assert summary.steps == 6  # training went on
    assert summary.counters["checkpoint/failed"] == 2 and summary.last_checkpoint is None
    assert [n for n, _ in list_checkpoints(root)] == [2] and read_latest(root) == root / "step-2"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2"]  # no half-written step-4.tmp
    verify(root / "step-2")
    msgs = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("step-4 not written" in m and "No space left" in m and "step-2 is intact" in m for m in msgs), msgs
    assert run.records[-1]["count/checkpoint/failed"] == 1  # in the step records (the last failure came after)


def _checkpointed_run(tmp: Path) -> Config:
    cfg = sync_cfg(tmp, steps=4, checkpoint_every=1, keep_checkpoints=2)
    Run(cfg, FakeSuite(n_train=5)).go()
    return cfg


def test_corrupt_latest_checkpoint_falls_back_or_is_named(tmp_path: Path) -> None:
    cfg = _checkpointed_run(tmp_path)
    root = cfg.run_dir / "checkpoints"
    assert [n for n, _ in list_checkpoints(root)] == [3, 4]  # keep_checkpoints = 2
    data = next((root / "step-4" / "trainer").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # truncated, as by a full disk or a torn copy
    r = find_checkpoint(cfg.run_dir)
    assert r.step == 3 and len(r.skipped) == 1 and str(data) in r.skipped[0] and "truncated" in r.skipped[0]
    with pytest.raises(CheckpointError, match=rf"{data}: truncated: 100 bytes"):
        find_checkpoint(cfg.run_dir, root / "step-4")  # named explicitly: an error, no silent fall-back
    (root / "step-3" / "controller.json").write_bytes((root / "step-3" / "controller.json").read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is unusable[\s\S]*step-4[\s\S]*step-3/controller.json: corrupt"):
        find_checkpoint(cfg.run_dir)


def test_resume_refuses_bad_input_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint in .*checkpoints"):
        prepare_resume(sync_cfg(tmp_path / "empty"))
    cfg = _checkpointed_run(tmp_path)
    more = with_run(cfg, steps=10, eval_every=5, max_time_s=100.0, dashboard="off", checkpoint_every=7)
    assert prepare_resume(more).step == 4  # known-safe keys may change
    changed = msgspec.structs.replace(more, rollout=msgspec.structs.replace(more.rollout, group_size=4))
    with pytest.raises(CheckpointError, match=r"rollout.group_size: 3 -> 4.*config.toml"):
        prepare_resume(changed)
    other_model = msgspec.structs.replace(more, model=msgspec.structs.replace(more.model, path="/models/qwen"))
    with pytest.raises(CheckpointError, match=r"model.path: 'builtin:tiny' -> '/models/qwen'"):
        prepare_resume(other_model)
    with pytest.raises(CheckpointError, match=r"at step 4 and run.steps = 4.*raise run.steps"):
        prepare_resume(cfg)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        prepare_resume(more, cfg.run_dir / "checkpoints" / "step-99")


def test_resume_names_the_lr_jump_when_run_steps_changes_under_a_decay(tmp_path: Path) -> None:
    from flashrl.resuming import lr_jump

    def cfg(steps: int, decay: str) -> Config:
        return from_dict({"run": {"steps": steps}, "trainer": {"lr": 1e-3, "warmup_steps": 0, "lr_decay": decay,
                                                               "min_lr_ratio": 0.1}})

    assert lr_jump(cfg(100, "none"), cfg(200, "none"), 50) == ""  # constant lr: nothing changes
    assert lr_jump(cfg(100, "cosine"), cfg(100, "cosine"), 50) == ""  # same run.steps: the same schedule
    msg = lr_jump(cfg(100, "linear"), cfg(200, "linear"), 50)
    # step 51 (index 50): 1e-3 * (0.1 + 0.9 * (1 - 50/99)) under the old schedule, 1e-3 * (0.1 + 0.9 * (1 - 50/199)) now
    assert "run.steps 100 -> 200" in msg and "from 0.000545 " in msg and "to 0.000774" in msg
    assert "decays to 0.0001 at step 200" in msg and "keep run.steps = 100" in msg


def test_continue_metrics_drops_lines_after_the_checkpoint_and_a_torn_line(tmp_path: Path) -> None:
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text("".join(f'{{"step": {i}}}\n' for i in range(6)) + '{"step": 6, "rew')
    st = ControllerState(step=4, version=4, elapsed_s=1.0, metrics_through=3)
    from flashrl.resuming import Resume

    assert continue_metrics(m, Resume(path=str(tmp_path / "run" / "checkpoints" / "step-4"), state=st)) == 3
    assert [x["step"] for x in read_jsonl(m)] == [0, 1, 2, 3]
    # resuming into a new run folder: the lines come from the checkpoint's own run
    other = tmp_path / "fork" / "metrics.jsonl"
    other.parent.mkdir()
    other.write_text('{"step": 0, "other": 1}\n{"step": 9}\n')  # an unrelated earlier run there: set aside
    continue_metrics(other, Resume(path=str(tmp_path / "run" / "checkpoints" / "step-4"), state=st))
    assert [x["step"] for x in read_jsonl(other)] == [0, 1, 2, 3] and "other" not in read_jsonl(other)[0]
    assert len(list(other.parent.glob("metrics.*.jsonl"))) == 1


def test_resume_from_an_older_checkpoint_sets_the_newer_aside(tmp_path: Path) -> None:
    """--resume PATH to step-3 while step-4 exists: step-4 is kept as step-4.abandoned, never overwritten
    or resumed by accident; the run dir is prepared by the same function a restart after a failure uses."""
    from flashrl.launch.driver import prepare_run_dir

    cfg = _checkpointed_run(tmp_path)
    root = cfg.run_dir / "checkpoints"
    (root / "step-5.tmp").mkdir()  # a save that was killed
    more = with_run(cfg, steps=6)
    r = prepare_resume(more, root / "step-3")
    assert r.step == 3
    assert prepare_run_dir(more, r) == 1  # step 4's line dropped from metrics.jsonl
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3", "step-4.abandoned"]
    Run(more, FakeSuite(n_train=5), resume=r).go()
    assert [n for n, _ in list_checkpoints(root)] == [5, 6] and (root / "step-4.abandoned").is_dir()
    assert [x["step"] for x in read_jsonl(cfg.run_dir / "metrics.jsonl")] == list(range(1, 7))  # (no eval split: no step 0)


# ---------------------------------------------------------------------- background (asynchronous) checkpoints
def _state(step: int) -> ControllerState:
    return ControllerState(step=step, version=step, elapsed_s=float(step), train_size=5, next_uid=2 * step)


def test_a_background_checkpoint_counts_only_once_its_write_completes(tmp_path: Path) -> None:
    """save(wait=False) returns once staged; step-N and ``latest`` appear only after the trainer's write
    finished; on_done hears it then; a second save waits for the first (last_wait_s)."""
    root = tmp_path / "checkpoints"
    trainer = FakeTrainer()
    trainer.ckpt_write_s = 5.0
    w = CheckpointWriter(root, trainer, "", keep=3, background=True, timeout_s=60.0)
    done: list[tuple[Any, Any]] = []

    async def main() -> None:
        import anyio

        assert await w.save(_state(1), wait=False, on_done=lambda p, e: done.append((p, e))) is None
        assert w.in_flight and w.last_wait_s == 0.0
        await anyio.sleep(4.0)
        assert not (root / "step-1").exists() and read_latest(root) is None and done == []
        t0 = anyio.current_time()
        await w.save(_state(2), wait=False, on_done=lambda p, e: done.append((p, e)))  # waits for step-1 first
        assert anyio.current_time() - t0 == pytest.approx(1.0, abs=0.01) and w.last_wait_s > 0
        assert done == [(root / "step-1", None)] and read_latest(root) == root / "step-1"
        assert not (root / "step-2").exists()
        await w.close()
        assert read_latest(root) == root / "step-2" and done[-1] == (root / "step-2", None)

    run_virtual(main)
    assert w.saved == 2 and w.failed == 0 and w.take_write_s() == pytest.approx(10.0, abs=0.1)
    assert verify(root / "step-2").step == 2


def test_a_failed_or_late_background_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    trainer = FakeTrainer()
    w = CheckpointWriter(root, trainer, "", keep=3, background=True, timeout_s=10.0)
    errors: list[Any] = []

    async def main() -> None:
        await w.save(_state(1))  # wait=True: complete on return
        trainer.fail_write = OSError(errno.ENOSPC, "No space left on device")
        await w.save(_state(2), wait=False, on_done=lambda p, e: errors.append(e))
        await w.wait()
        trainer.fail_write = None
        trainer.ckpt_write_s = 100.0  # past timeout_s: the trainer's finish gives up, nothing is sealed
        await w.save(_state(3), wait=False, on_done=lambda p, e: errors.append(e))
        await w.close()

    run_virtual(main)
    assert [type(e).__name__ for e in errors] == ["CheckpointError", "CheckpointError"]
    assert "step-2 not written" in str(errors[0]) and "No space left" in str(errors[0]) and "step-1 is intact" in str(errors[0])
    assert "step-3 not written" in str(errors[1])
    assert read_latest(root) == root / "step-1" and [n for n, _ in list_checkpoints(root)] == [1]
    assert w.saved == 1 and w.failed == 2
    assert find_checkpoint(tmp_path).step == 1


def test_the_run_end_waits_for_a_background_checkpoint_and_records_it(tmp_path: Path) -> None:
    """A controller run whose writes outlast its steps: the final checkpoint waits for the one in flight and
    for itself; the summary names it; time/ckpt_wait_s says how long a save waited for the write before it."""
    cfg = sync_cfg(tmp_path, steps=4, checkpoint_every=1)
    trainer = FakeTrainer(train_s=0.5)
    trainer.ckpt_write_s = 2.0  # 4 steps of 0.5 s: each checkpoint waits for the one before
    run = Run(cfg, FakeSuite(n_train=5), trainer=trainer, background=True)
    s = run.go()
    root = cfg.run_dir / "checkpoints"
    assert s.checkpoints == 4 and s.last_checkpoint == str(root / "step-4") and read_latest(root) == root / "step-4"
    waits = [r.get("time/ckpt_wait_s") for r in run.records if "time/ckpt_wait_s" in r]
    assert waits and max(waits) > 0.5  # a save waited for the write before it
    assert trainer.train_during_write  # and steps trained beside the writes
    assert not list(root.glob("*.tmp"))
