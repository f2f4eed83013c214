"""Background tasks whose crash must be loud at once (issue 36): each test makes the task crash and checks
that its owner fails at once with a named error, not at shutdown (or never).

    aio.until_stopped           the helper: a watched task that ends before the stop raises TaskDied
    trainer rank 0's keepalive  its command loop dies: serve raises TaskDied naming it (main() exits the rank, code 1)
    the slurm launcher's poller watch() / spawn() / close() raise its LaunchError; local_cluster ends with it

(The sandbox's I/O tasks need a process: tests/integration/test_env_sandbox.py.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from flashrl.aio import TaskDied, until_stopped
from flashrl.launch.base import LaunchError
from flashrl.sim.clock import run_virtual
from flashrl.wire.protocol import Ping, PollProcs, ProcStates, StopAll
from tests.unit.test_slurm import _agent_cfg


# ------------------------------------------------------------------------------------------- the helper
def test_until_stopped_returns_on_stop_and_names_a_task_that_ends_first() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        async def crash() -> None:
            await asyncio.sleep(1.0)
            raise ValueError("boom")

        forever = loop.create_task(asyncio.Event().wait(), name="server")
        t = loop.create_task(crash(), name="keepalive")
        t0 = loop.time()
        with pytest.raises(TaskDied, match=r"task 'keepalive' died: ValueError: boom") as e:
            await until_stopped(stop, [forever, t])
        assert loop.time() - t0 == pytest.approx(1.0) and isinstance(e.value.__cause__, ValueError)
        assert not forever.done()  # left to the caller

        done = loop.create_task(asyncio.sleep(0.5), name="short")
        with pytest.raises(TaskDied, match=r"task 'short' returned before its owner stopped"):
            await until_stopped(stop, [forever, done])

        loop.call_later(2.0, stop.set)
        await until_stopped(stop, [forever])  # the stop: no error
        forever.cancel()

    run_virtual(main)


# ------------------------------------------------------------------------------------------- the trainer
class _Server:
    async def serve(self) -> None:
        await asyncio.Event().wait()


class _Fanout:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        raise RuntimeError("broadcast to rank 1 failed")


class _Trainer:
    rank, world, version = 0, 2, 0


def test_a_trainer_loop_whose_keepalive_dies_fails_rank_0_at_once() -> None:
    """The keepalive's broadcast raises: rank 0's RPC shell raises TaskDied naming the command loop and
    the error at the keepalive's first broadcast (before: nothing until shutdown; the other ranks'
    receive would have timed out half an hour later). Real time: the loop is a thread."""
    from flashrl.trainer.loop import CommandLoop, serve

    fanout = _Fanout()
    commands = CommandLoop(_Trainer(), fanout, keepalive_s=0.05)  # type: ignore[arg-type]
    seen: dict[str, float] = {}

    async def main() -> None:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(30):  # the old leader waited for a stop that never came
                await serve(commands, lambda handle: _Server())
        finally:
            seen["s"] = time.monotonic() - t0

    with pytest.raises(TaskDied, match=r"task 'trainer-loop' died: RuntimeError: broadcast to rank 1 failed"):
        asyncio.run(main())
    assert seen["s"] <= 5.0 and [type(m) for m in fanout.sent] == [Ping]


# ------------------------------------------------------------------------------------------- the slurm launcher
class _Agent:
    """A node agent's channel that answers PollProcs with something the poller does not expect."""

    def __init__(self) -> None:
        self.polls = 0

    async def request(self, msg: Any, timeout: float) -> Any:
        if isinstance(msg, StopAll):  # close()
            return ProcStates()
        assert isinstance(msg, PollProcs)
        self.polls += 1
        raise KeyError("exited")  # a poller bug: not one of the agent errors it handles

    async def close(self) -> None:
        pass


def test_a_slurm_poller_that_dies_is_raised_by_watch_spawn_and_close(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from flashrl.launch import slurm

    launcher = slurm.SlurmLauncher(_agent_cfg(tmp_path, 29400), tmp_path)
    seen: dict[str, Any] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        launcher._agents = {0: _Agent()}  # type: ignore[dict-item]
        launcher._start_poller()
        t0 = loop.time()
        with pytest.raises(LaunchError, match=r"slurm launcher: the process poller died \(KeyError: 'exited'\)"):
            async with asyncio.timeout(60):
                await launcher.watch()
        seen["s"] = loop.time() - t0
        with pytest.raises(LaunchError, match="poller died"):
            await launcher.spawn("engine", 0, ["python"], {}, None)
        with pytest.raises(LaunchError, match="poller died"):  # everything stopped, the error not swallowed
            await launcher.close()

    with caplog.at_level(logging.ERROR, logger="flashrl.launch.slurm"):
        run_virtual(main)
    assert seen["s"] == pytest.approx(slurm.POLL_S)  # at the first poll, not at close
    assert any("process poller died" in r.getMessage() for r in caplog.records)  # logged when it happened


def test_local_cluster_ends_with_the_launchers_error_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """processes.local_cluster runs a launcher's watch() beside the engine watchers: the slurm poller's crash
    ends the run (here while the trainer group would still be starting) with the LaunchError, and the
    launcher is closed."""
    from flashrl.launch import processes, slurm

    cfg = _agent_cfg(tmp_path, 29400)
    launcher = slurm.SlurmLauncher(cfg, tmp_path)

    async def start() -> None:
        launcher._agents = {0: _Agent()}  # type: ignore[dict-item]
        launcher._start_poller()

    async def spawn(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()  # the trainer group never gets ready

    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(processes.TrainerGroup, "spawn", spawn)
    monkeypatch.setattr(processes, "resolve_deadlines", lambda cfg, path: cfg)
    seen: dict[str, float] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            async with asyncio.timeout(600):
                async with processes.local_cluster(cfg, tmp_path / "model", tmp_path, launcher=launcher,
                                                   preflighted=True):
                    pytest.fail("the cluster cannot be up")
        finally:
            seen["s"] = loop.time() - t0

    with pytest.raises(LaunchError, match=r"the process poller died \(KeyError"):
        run_virtual(main)
    assert seen["s"] < 5.0 and launcher._closed
