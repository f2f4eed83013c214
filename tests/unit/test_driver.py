"""flashrl/launch/driver.py: every task of `flashrl run` is supervised. A helper that crashes (the
dashboard refresher, the memory sampler, the tokenizer load) ends the run at once with its error,
named, and the controller is cancelled: nothing hangs, nothing fails unseen.

The processes are stand-ins (``local_cluster`` yields no engines and a trainer that records what it is
asked), so these tests start no process and open no socket; the controller is a stand-in that would
run forever unless cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flashrl.config import Config, load
from flashrl.launch import driver

DEADLINE_S = 20.0  # the run must fail well within this; a hang fails the test instead of stalling it


class ForeverController:
    """Stands in for controller.Controller: run() waits until cancelled (a long run), and says so."""

    instances: list[ForeverController] = []
    snapshot_error: Exception | None = None

    def __init__(self, cfg: Config, *args: Any, **kwargs: Any) -> None:
        self.cancelled = False
        self.status = "running"
        ForeverController.instances.append(self)

    async def run(self) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def snapshot(self) -> Any:
        from flashrl.metrics import Snapshot

        if ForeverController.snapshot_error is not None:
            raise ForeverController.snapshot_error
        return Snapshot()


class NoTrainer:
    async def save_model(self, path: Path, replace: bool = False) -> None:
        raise AssertionError("a failed run writes no final policy")


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    from flashrl import models
    from flashrl.controller import controller
    from flashrl.models import tokenizer

    @asynccontextmanager
    async def no_processes(*args: Any, **kwargs: Any) -> AsyncIterator[tuple[list[Any], NoTrainer]]:
        yield [], NoTrainer()

    monkeypatch.setattr(driver, "local_cluster", no_processes)
    monkeypatch.setattr(models, "ensure_model", lambda cfg, **kw: str(tmp_path / "model"))
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda *a: object())
    monkeypatch.setattr(controller, "Controller", ForeverController)
    ForeverController.instances = []
    ForeverController.snapshot_error = None
    return load(None, [f"run.output_dir={tmp_path}", "run.dashboard=off"])


async def test_a_crashing_dashboard_refresher_fails_the_run_loudly(stand_ins: Config) -> None:
    ForeverController.snapshot_error = ValueError("refresher boom")
    with pytest.raises(RuntimeError, match=r"the dashboard refresher failed: ValueError: refresher boom") as err:
        await asyncio.wait_for(driver.run_local(stand_ins), DEADLINE_S)
    assert isinstance(err.value.__cause__, ValueError)  # the original error (and its traceback) is kept
    assert [c.cancelled for c in ForeverController.instances] == [True]  # the controller was stopped, not left


async def test_a_crashing_memory_sampler_fails_the_run_loudly(stand_ins: Config,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: driver.MemorySampler) -> int:
        raise OSError("sampler boom")

    monkeypatch.setattr(driver.MemorySampler, "sample", broken)
    with pytest.raises(RuntimeError, match=r"the memory sampler failed: OSError: sampler boom"):
        await asyncio.wait_for(driver.run_local(stand_ins), DEADLINE_S)
    # the sampler's first sample may fail before the controller was even built; if built, it was stopped
    assert all(c.cancelled for c in ForeverController.instances)


async def test_a_failing_tokenizer_load_fails_the_run_at_once(stand_ins: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.models import tokenizer

    def no_tokenizer(*args: Any) -> Any:
        raise FileNotFoundError("tokenizer.json")

    monkeypatch.setattr(tokenizer, "load_tokenizer", no_tokenizer)
    with pytest.raises(RuntimeError, match=r"the tokenizer load failed: FileNotFoundError: tokenizer.json"):
        await asyncio.wait_for(driver.run_local(stand_ins), DEADLINE_S)
    assert ForeverController.instances == []  # it failed before the controller was built


async def test_no_helper_is_left_running_when_the_run_ends(stand_ins: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller that finishes: run_local returns (the sampler is stopped, the group ends) and the
    summary is the controller's; every task it started has ended."""
    from flashrl.controller import controller

    class Result(msgspec.Struct):
        stop_reason: str = "interrupted"  # no final policy to write (NoTrainer refuses)
        segment_s: float = 0.3

    class Done(ForeverController):
        async def run(self) -> Any:
            await asyncio.sleep(0.3)  # the refresher and the sampler get to run
            return Result()

    monkeypatch.setattr(controller, "Controller", Done)
    before = asyncio.all_tasks()
    summary = await asyncio.wait_for(driver.run_local(stand_ins), DEADLINE_S)
    assert summary["run"] == stand_ins.run.name and "final_policy" not in summary
    assert asyncio.all_tasks() - before == set()


def test_the_cpu_sampler_counts_a_reused_pid_as_a_new_process() -> None:
    """cpu_s keeps each process's CPU time as last seen, also once it exited; a new process the kernel gives an
    exited one's pid (another start time) is counted beside it, not hidden under the old one's larger total."""
    from types import SimpleNamespace

    class Proc:
        def __init__(self, pid: int, started: float, cpu: float) -> None:
            self.pid, self.started, self.cpu = pid, started, cpu

        def create_time(self) -> float:
            return self.started

        def cpu_times(self) -> Any:
            return SimpleNamespace(user=self.cpu, system=0.0)

        def memory_info(self) -> Any:
            return SimpleNamespace(rss=1)

    class Root(Proc):
        kids: list[Proc] = []

        def children(self, recursive: bool = False) -> list[Proc]:
            return self.kids

    sampler = driver.MemorySampler()
    root = Root(1, 0.0, 1.0)
    sampler._proc = root  # type: ignore[assignment]
    root.kids = [Proc(50, 10.0, 5.0)]
    sampler.sample()
    root.kids = []  # pid 50 exited: its 5 s still count
    sampler.sample()
    assert sampler.cpu_s == pytest.approx(6.0)
    root.kids = [Proc(50, 20.0, 2.0)]  # a new process of the run got pid 50
    sampler.sample()
    assert sampler.cpu_s == pytest.approx(8.0)


# ---------------------------------------------------------------------- the run folder and final failures (issue 51)
def test_a_supervised_restart_never_sets_a_complete_checkpoint_aside(tmp_path: Path) -> None:
    """A fresh start by a --supervise restart (RESTART_ENV) that finds a complete checkpoint refuses, naming
    it and the --resume that continues it, and moves nothing; the user's own fresh start sets it aside,
    kept, and says where and how to continue it; only killed saves (no complete step) go aside quietly."""
    from flashrl.launch.rundir import FreshStartRefused, prepare_run_dir
    from tests.unit.test_checkpoint import _checkpointed_run

    cfg = _checkpointed_run(tmp_path)
    run_dir, root = cfg.run_dir, cfg.run_dir / "checkpoints"
    (root / "latest").unlink()  # the pointer alone does not make a checkpoint: the step folders do
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(FreshStartRefused, match=rf"holds a complete checkpoint \({root / 'step-4'}, step 4\)"):
        prepare_run_dir(cfg, None, restart=True)
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing set aside
    prepare_run_dir(cfg, None)  # the user's own `flashrl run` without --resume: a fresh start
    aside = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoints."))
    assert len(aside) == 1 and not root.exists() and (run_dir / aside[0] / "step-4").is_dir()
    (root / "step-9.tmp").mkdir(parents=True)  # a killed save, no complete step: nothing to keep
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    prepare_run_dir(cfg, None, restart=True)
    assert not root.exists() and len([p for p in run_dir.iterdir() if p.name.startswith("checkpoints.")]) == 2
    assert len(list(run_dir.glob("metrics.*.jsonl"))) == 2  # two in one second: neither overwrote the other


def test_final_failures_are_found_through_wrappers_and_groups() -> None:
    from flashrl.config import ConfigError
    from flashrl.controller.publisher import AdapterRefused
    from flashrl.judge.engines import JudgeDown

    down = JudgeDown("every judge engine is down for good")
    try:
        raise RuntimeError("the controller failed") from down  # as _helper and the task group wrap it
    except RuntimeError as e:
        assert driver.final_failure(e) == (down, driver.FINAL_EXIT)
    refused = AdapterRefused("3 versions refused in a row")
    group = BaseExceptionGroup("several", [ValueError("x"), refused])
    assert driver.final_failure(group) == (refused, driver.FINAL_EXIT)
    try:
        try:
            raise ConfigError("judge.template: longer than judge.max_model_len")
        except ConfigError:
            raise RuntimeError("while building the judge") from None  # __context__ kept for the record
    except RuntimeError as e:
        e.__suppress_context__ = False
        found = driver.final_failure(e)
        assert found is not None and found[1] == 2 and isinstance(found[0], ConfigError)
    assert driver.final_failure(RuntimeError("engine died")) is None  # a restart may get past it
    assert driver.final_failure(OSError("disk")) is None
    from flashrl.distill.build import TeacherModelError
    from flashrl.distill.engines import TeacherDown

    teacher = TeacherDown("every engine of teacher exact is down for good")
    assert driver.final_failure(BaseExceptionGroup("run", [teacher])) == (teacher, driver.FINAL_EXIT)
    vocab = TeacherModelError("distill.teachers[t]: the teacher's tokenizer is not the student's")
    assert driver.final_failure(vocab) == (vocab, 2)  # a config that cannot work: 2, never restarted


def test_a_final_failure_ends_the_run_with_its_code_and_record_not_an_auto_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.judge.engines import JudgeDown

    cfg = load(None, [f"run.output_dir={tmp_path}", "run.dashboard=off", "run.auto_resume=3"])
    calls = []

    async def judge_down(cfg: Config, resume: Any = None) -> Any:
        calls.append(resume)
        raise RuntimeError("the controller failed") from JudgeDown("every judge engine is down for good")

    monkeypatch.setattr(driver, "_main_with_signals", judge_down)
    monkeypatch.setattr(driver, "_auto_resume", lambda *a: pytest.fail("a final failure is not auto-resumed"))
    assert driver.main(cfg) == driver.FINAL_EXIT == 3
    assert len(calls) == 1
    rec = msgspec.json.decode((cfg.run_dir / driver.FAILURE_FILE).read_bytes())
    assert rec["error"] == "JudgeDown" and rec["exit_code"] == 3 and "down for good" in rec["message"]
    monkeypatch.setattr(driver, "_main_with_signals", lambda *a: asyncio.sleep(0, result=None))
    assert driver.main(cfg) == 130 and not (cfg.run_dir / driver.FAILURE_FILE).exists()  # a new run clears it


def test_a_supervised_fresh_restart_over_a_checkpoint_exits_2_naming_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """driver.main under RESTART_ENV: the refusal is the run's end (exit 2, failure.json), before anything starts."""
    from tests.unit.test_checkpoint import _checkpointed_run

    cfg = with_dashboard_off(_checkpointed_run(tmp_path))
    monkeypatch.setenv(driver.RESTART_ENV, "1")
    monkeypatch.setattr(driver, "_main_with_signals", lambda *a: pytest.fail("nothing starts"))
    assert driver.main(cfg) == 2
    rec = msgspec.json.decode((cfg.run_dir / driver.FAILURE_FILE).read_bytes())
    assert rec["error"] == "FreshStartRefused" and "step-4" in rec["message"] and rec["exit_code"] == 2
    assert (cfg.run_dir / "checkpoints" / "step-4").is_dir()


def with_dashboard_off(cfg: Config) -> Config:
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, dashboard="off"))
