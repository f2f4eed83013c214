"""trainer/loop.py: rank 0's command loop and its RPC shell, with a fake rank, fan-out and server (the
loop is a thread: real time, short waits). What the loop promises: commands run one at a time in
arrival order; a command's error is its own reply; a handed-off command completes while the loop goes
on; shutdown is close -> cancel -> wait, and a command still running is not waited for."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from flashrl.trainer.loop import CommandLoop, serve
from flashrl.wire.protocol import (
    DropWeightPeer,
    Error,
    Msg,
    Ok,
    Ping,
    Pong,
    PrepareWeights,
    SendWeights,
    Shutdown,
    TrainStep,
)


class _Rank:
    """Rank 0 of two: records what it runs; SendWeights is handed off (completed by the test)."""

    rank, world, version = 0, 2, 7

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.handed: Future[Any] = Future()
        self.hold = threading.Event()
        self.hold.set()

    def beside(self, msg: Msg) -> Future[Any] | None:
        if isinstance(msg, SendWeights):
            self.log.append(f"handed {msg.version}")
            return self.handed
        if isinstance(msg, PrepareWeights) and msg.version < 0:
            raise ValueError("PrepareWeights(-1): refused")
        return None

    def drop_weight_peer(self, peer: str) -> Msg:
        self.log.append(f"dropped {peer}")
        return Ok(info=f"dropped {peer}")

    def execute(self, msg: Msg) -> Msg | None:
        assert self.hold.wait(30)
        self.log.append(f"run {type(msg).__name__}")
        if isinstance(msg, TrainStep):
            raise RuntimeError("bad batch")
        return Ok(info=type(msg).__name__)


class _Fanout:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def send(self, msg: Msg) -> None:
        self.log.append(f"fanout {type(msg).__name__}")

    def recv(self) -> Msg | None:
        raise AssertionError("rank 0 never receives")


class _Server:
    """Captures the handler; records what it saw when cancelled."""

    def __init__(self, handle: Callable[[Msg], Any], commands: CommandLoop, log: list[str]) -> None:
        self.handle, self.commands, self.log = handle, commands, log

    async def serve(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.log.append(f"cancel (closed={self.commands.closed})")
            raise


async def _until(cond: Callable[[], bool]) -> None:
    """Poll ``cond`` (made true by the loop thread or the shell) for at most 10 s."""
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


def _setup() -> tuple[list[str], _Rank, CommandLoop, list[_Server]]:
    log: list[str] = []
    rank = _Rank(log)
    return log, rank, CommandLoop(rank, _Fanout(log), keepalive_s=60.0), []  # type: ignore[arg-type]


def test_commands_run_in_order_errors_are_replies_and_a_handed_off_command_lets_the_loop_go_on() -> None:
    log, rank, commands, servers = _setup()

    async def main() -> bool:
        def make(handle: Callable[[Msg], Any]) -> _Server:
            servers.append(_Server(handle, commands, log))
            return servers[0]

        task = asyncio.create_task(serve(commands, make))
        await _until(lambda: bool(servers))
        handle = servers[0].handle
        assert await handle(Ping()) == Pong(version=7)  # answered at once, never queued
        send = asyncio.ensure_future(handle(SendWeights(version=3)))
        await _until(lambda: "handed 3" in log)
        assert await handle(PrepareWeights(version=4)) == Ok(info="PrepareWeights")  # while the send is out
        assert not send.done()
        with pytest.raises(ValueError, match="refused"):
            await handle(PrepareWeights(version=-1))  # refused before it fans out
        with pytest.raises(RuntimeError, match="bad batch"):
            await handle(TrainStep(batch=None))  # type: ignore[arg-type]
        rank.handed.set_result(Ok(info="sent 3"))
        assert await send == Ok(info="sent 3")
        assert await handle(Shutdown()) == Ok(info="Shutdown")
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(asyncio.wait_for(main(), 30)) is True
    assert log == ["handed 3", "fanout PrepareWeights", "run PrepareWeights", "fanout TrainStep", "run TrainStep",
                   "fanout Shutdown", "run Shutdown", "cancel (closed=True)"]
    assert not [t for t in threading.enumerate() if t.name == "trainer-loop"]


def test_a_stop_is_close_then_cancel_then_wait() -> None:
    """SIGTERM while idle: new commands are refused (close), the server is cancelled, then the loop thread
    is waited for (it ends: serve returns True)."""
    log, rank, commands, servers = _setup()
    stop = asyncio.Event()
    replies: list[Any] = []

    async def main() -> bool:
        def make(handle: Callable[[Msg], Any]) -> _Server:
            servers.append(_Server(handle, commands, log))
            return servers[0]

        task = asyncio.create_task(serve(commands, make, stop=stop))
        await _until(lambda: bool(servers))
        stop.set()
        await asyncio.sleep(0.05)  # serve is in its 0.2 s grace: closed, not yet cancelled
        log.append(f"closed={commands.closed}")
        replies.append(await servers[0].handle(PrepareWeights(version=1)))
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(asyncio.wait_for(main(), 30)) is True
    assert log == ["closed=True", "cancel (closed=True)"]
    assert isinstance(replies[0], Error) and replies[0].kind == "shutdown"
    assert not [t for t in threading.enumerate() if t.name == "trainer-loop"]


def test_a_stop_during_a_command_does_not_wait_for_it() -> None:
    """SIGTERM while a command runs (it may sit in a collective whose peers are gone): serve returns False
    at once, after closing and cancelling, and the caller exits without waiting."""
    log, rank, commands, servers = _setup()
    rank.hold.clear()
    stop = asyncio.Event()

    async def main() -> bool:
        def make(handle: Callable[[Msg], Any]) -> _Server:
            servers.append(_Server(handle, commands, log))
            return servers[0]

        task = asyncio.create_task(serve(commands, make, stop=stop, wait_s=60.0))
        await _until(lambda: bool(servers))
        step = asyncio.ensure_future(servers[0].handle(PrepareWeights(version=1)))
        await _until(lambda: commands.running is not None)
        # a dead engine's drop is answered while the command runs (a send queued behind it may wait on that engine)
        assert await asyncio.wait_for(servers[0].handle(DropWeightPeer(peer="engine0")), 5) == Ok(info="dropped engine0")
        stop.set()
        ended = await asyncio.wait_for(task, 5)  # not the 60 s wait
        step.cancel()
        return ended

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) is False
        assert log == ["fanout PrepareWeights", "dropped engine0", "cancel (closed=True)"]
    finally:
        rank.hold.set()


def test_a_follower_runs_what_rank_0_broadcasts_in_order_logs_errors_and_ends_at_shutdown_or_sigterm() -> None:
    log: list[str] = []
    rank = _Rank(log)
    rank.rank = 1

    class _Received(_Fanout):
        def __init__(self, msgs: list[Msg | None]) -> None:
            super().__init__(log)
            self.msgs = msgs

        def recv(self) -> Msg | None:
            return self.msgs.pop(0)

    CommandLoop(rank, _Received([Ping(), TrainStep(batch=None), Shutdown(), Ping()])).run()  # type: ignore[arg-type]
    assert log == ["run Ping", "run TrainStep", "run Shutdown"]  # the bad batch logged, the loop kept in step
    log.clear()
    CommandLoop(rank, _Received([PrepareWeights(version=1), None])).run()  # type: ignore[arg-type]  # None: SIGTERM
    assert log == ["run PrepareWeights"]
