"""No scorer task dies unseen (issue 51, item 4): the judge's start and watcher tasks and the reward model's
dispatcher and batch tasks. Each test makes one crash and checks that what waits on the scorer hears an
``aio.TaskDied`` naming the task and its error within seconds (virtual time), never a wait of
judge.startup_timeout_s (600 s) for an engine nothing will start, nor a hang, nor a bug retried as an outage.
The judge's engine processes are stand-ins here (no process, no socket): ``JudgeEngines._spawn`` returns them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from envs.arithmetic import ArithmeticSuite
from flashrl.aio import TaskDied
from flashrl.config import JudgeConfig, RewardModelConfig
from flashrl.judge.engines import JudgeEngines
from flashrl.rewardmodel.client import RewardModelClient
from flashrl.rewardmodel.fake import FakeScorer
from flashrl.rewardmodel.suite import RewardModelSuite
from flashrl.rewards import RewardFailed
from flashrl.sim.clock import run_virtual
from flashrl.wire.protocol import Generated


# ------------------------------------------------------------------------------------------- the judge
class _Child:
    pid = 4242

    def __init__(self, exit_after_s: float) -> None:
        self.exit_after_s = exit_after_s

    async def exited(self) -> int:
        await asyncio.sleep(self.exit_after_s)
        return -9


class _Client:
    def fail(self, err: Exception) -> None:
        pass

    async def generate(self, req: Any) -> Generated:
        return Generated(request_id=req.request_id, token_ids=[5])


class _Engine:
    """An EngineProcess stand-in: up after ``ready_s`` (or its start raises ``ready_error``), exits after
    ``exit_after_s``; its discard (the launcher's kill and stop) raises ``discard_error`` after ``discard_s``."""

    log_path = Path("judge0.log")

    def __init__(self, *, ready_s: float = 0.5, exit_after_s: float = 1e9, ready_error: BaseException | None = None,
                 discard_error: BaseException | None = None, discard_s: float = 0.0) -> None:
        self.ready_s = ready_s
        self.child = _Child(exit_after_s)
        self.client = _Client()
        self.ready_error = ready_error
        self.discard_error = discard_error
        self.discard_s = discard_s

    async def wait_ready(self, timeout: float) -> float:
        await asyncio.sleep(self.ready_s)
        if self.ready_error is not None:
            raise self.ready_error
        return self.ready_s

    async def discard(self) -> None:
        await asyncio.sleep(self.discard_s)
        if self.discard_error is not None:
            raise self.discard_error

    async def terminate(self, timeout: float = 10.0) -> int:
        return 0


class _Launcher:
    name = "fake"
    curve = None

    async def close(self) -> None:
        pass


def _engines(tmp_path: Path, engines: list[_Engine]) -> JudgeEngines:
    je = JudgeEngines(JudgeConfig(model="x", startup_timeout_s=600.0, max_restarts=5), "model", tmp_path,
                      launcher=_Launcher())  # type: ignore[arg-type]
    queue = list(engines)

    async def spawn(i: int) -> _Engine:
        return queue.pop(0)

    je._spawn = spawn  # type: ignore[assignment,method-assign]
    return je


def _verdict(je: JudgeEngines) -> Any:
    return je.generate([1, 2, 3], max_tokens=4, temperature=0.0, seed=0)


def test_a_judge_watcher_whose_discard_raises_stops_the_run_named_at_once(tmp_path: Path) -> None:
    """Engine 0 dies at t = 1.5; its watcher's discard (the launcher's kill and stop) raises at t = 3.5. A verdict
    asked at t = 2 waits for a live engine: it hears TaskDied naming the watcher at t = 3.5, and so does every
    later verdict. Before: the watcher died silently, nothing restarted the engine, and the verdict waited
    judge.startup_timeout_s = 600 s (then the next retry as long)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        je = _engines(tmp_path, [_Engine(exit_after_s=1.0, discard_error=RuntimeError("node agent gone"), discard_s=2.0),
                                 _Engine()])
        await je.start(wait=True)
        assert (await _verdict(je)).token_ids == [5]  # up at t = 0.5
        await asyncio.sleep(1.5)
        t0 = loop.time()
        with pytest.raises(TaskDied, match=r"judge task 'judge0-watcher' died: RuntimeError: node agent gone") as e:
            async with asyncio.timeout(30):
                await _verdict(je)
        assert loop.time() - t0 == pytest.approx(1.5) and isinstance(e.value.__cause__, RuntimeError)
        with pytest.raises(TaskDied, match="judge0-watcher"):
            await _verdict(je)
        await je.aclose()

    run_virtual(main)


def test_a_judge_start_task_cancelled_from_elsewhere_stops_the_run_named(tmp_path: Path) -> None:
    """The start task ends by a cancel that is not the judge's own (a CancelledError leaking out of a start):
    no engine will come, so the verdict waiting for one hears TaskDied naming the start task at once. Before:
    it waited judge.startup_timeout_s."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        je = _engines(tmp_path, [_Engine(ready_s=2.0, ready_error=asyncio.CancelledError())])
        await je.start()
        with pytest.raises(TaskDied, match=r"judge task 'judge0-start' was cancelled before the judge closed"):
            async with asyncio.timeout(30):
                await _verdict(je)
        assert loop.time() == pytest.approx(2.0)
        await je.aclose()

    run_virtual(main)


def test_a_judge_start_whose_discard_raises_reports_the_start_error_and_restarts(tmp_path: Path) -> None:
    """A start that fails and whose discard raises too: the start's own error is counted and the engine is
    started again (the discard's error logged), as for any failed start; the verdict is served by the restart."""

    async def main() -> None:
        je = _engines(tmp_path, [_Engine(ready_error=TimeoutError("no Ping"), discard_error=RuntimeError("stuck")),
                                 _Engine()])
        await je.start()
        async with asyncio.timeout(30):
            assert (await _verdict(je)).token_ids == [5]
        assert je.counts["judge_engine_start_failed"] == 1 and je.counts["judge_engine_restarts"] == 1
        await je.aclose()

    run_virtual(main)


def test_closing_the_judge_is_no_crash(tmp_path: Path) -> None:
    async def main() -> None:
        je = _engines(tmp_path, [_Engine(ready_s=5.0)])
        await je.start()
        await asyncio.sleep(1.0)
        await je.aclose()  # cancels the start task: its own cancel, not a crash
        assert je._crash is None

    run_virtual(main)


# ------------------------------------------------------------------------------------------- the reward model
def _right(text: str) -> float:
    return 1.0


def test_a_reward_model_dispatcher_that_raises_fails_every_score_named() -> None:
    """The dispatcher crashes: the episode waiting for its score hears TaskDied naming it at once, and so does
    every later one. Before: the score waited forever (nothing dispatches it)."""

    async def main() -> None:
        c = RewardModelClient(FakeScorer(_right), max_batch=4, batch_wait_s=0.005)

        async def broken() -> None:
            await asyncio.sleep(0.5)
            raise RuntimeError("dispatcher bug")

        c._dispatch = broken  # type: ignore[method-assign]
        with pytest.raises(TaskDied, match=r"reward-model task 'rm-dispatcher' died: RuntimeError: dispatcher bug"):
            async with asyncio.timeout(5):
                await c.score("1+2=3")
        with pytest.raises(TaskDied, match="rm-dispatcher"):
            await c.score("1+2=4")
        await c.aclose()

    run_virtual(main)


class _BuggyScorer(FakeScorer):
    async def score_batch(self, texts: list[str], timeout_s: float) -> list[float | str]:
        raise KeyError("a bug in the backend")


def test_a_reward_model_batch_that_crashes_stops_the_run_not_retried_as_an_outage() -> None:
    """A batch task whose backend raises a bug (not ScoreFailed): its episodes hear TaskDied naming the batch task,
    which RewardModelEnv does not turn into an EnvFailure (the run stops, named). Before: RewardFailed("rm_error"),
    an infrastructure failure: the rollouts were retried on a bug and the task's error never read."""

    async def main() -> None:
        inner = ArithmeticSuite(ArithmeticSuite.Params(), seed=0, eval_size=10)
        suite = RewardModelSuite(inner, RewardModelClient(_BuggyScorer(_right), max_batch=4), RewardModelConfig())
        task = inner.train_tasks()[0]
        env = suite.make_env()
        await env.reset(task)
        with pytest.raises(TaskDied, match=r"reward-model task 'rm-batch' died: KeyError: 'a bug in the backend'"):
            async with asyncio.timeout(5):
                await env.step(task.answer)
        with pytest.raises(TaskDied, match="rm-batch"):
            await suite.client.score("again")
        await suite.aclose()

    run_virtual(main)


def test_closing_the_reward_model_fails_what_waits_as_closed_not_as_a_crash() -> None:
    async def main() -> None:
        c = RewardModelClient(FakeScorer(_right, delay_s=10.0), max_batch=1, batch_wait_s=0.0)
        waiting = asyncio.ensure_future(c.score("1+2=3"))
        await asyncio.sleep(1.0)
        await c.aclose()
        with pytest.raises(RewardFailed, match="closed"):
            await waiting
        assert c._crash is None

    run_virtual(main)
