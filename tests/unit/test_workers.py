"""flashrl/workers.py: the worker-process pool's rules, on stand-in processes (no process, no socket).

The real processes are tests/integration/test_env_remote_process.py's (ZeroMQ env workers, eager) and
tests/integration/test_rewards_process.py's (stdin/stdout reward workers, on demand, one call each).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from flashrl.workers import Worker, WorkerPool


class Failed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class FakeProc:
    """A process that exits when killed (or when told to die)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.code: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.killed = False

    def kill(self) -> None:
        self.killed = True
        self.die(-9)

    def die(self, code: int) -> None:
        if not self.code.done():
            self.code.set_result(code)

    async def exited(self) -> int:
        return await self.code


class Stand:
    """start/ready/on_exit for a pool of FakeProcs; ``ready_after`` gates readiness."""

    def __init__(self, never_ready: bool = False) -> None:
        self.procs: list[FakeProc] = []
        self.exited: list[str] = []
        self.never_ready = never_ready
        self.gate = asyncio.Event()
        self.gate.set()

    async def start(self, slot: int, gen: int) -> tuple[FakeProc, FakeProc]:
        p = FakeProc(f"{slot}.{gen}")
        self.procs.append(p)
        return p, p

    async def ready(self, p: FakeProc) -> None:
        if self.never_ready:
            raise RuntimeError("bad import")
        await self.gate.wait()

    async def on_exit(self, w: Worker[FakeProc]) -> None:
        self.exited.append(w.handle.name)

    def pool(self, size: int, **kw: object) -> WorkerPool[FakeProc]:
        return WorkerPool("fake worker", size, start=self.start, ready=self.ready, on_exit=self.on_exit,
                          failure=Failed, **kw)  # type: ignore[arg-type]


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def test_on_demand_with_capacity_one_hands_each_worker_to_one_caller_at_a_time() -> None:
    s = Stand()
    pool = s.pool(2, capacity=1, eager=False)
    a = await pool.acquire()
    b = await pool.acquire()
    assert {a.slot, b.slot} == {0, 1} and pool.counters["spawned"] == 2  # started on demand, one per caller
    third = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.05)
    assert not third.done()  # both busy: it waits for room
    pool.release(a)
    assert (await asyncio.wait_for(third, 1.0)) is a
    await pool.aclose()
    assert all(p.killed for p in s.procs) and sorted(s.exited) == ["0.0", "1.1"]


async def test_a_killed_worker_is_counted_never_handed_out_and_replaced_on_the_next_call() -> None:
    s = Stand()
    pool = s.pool(1, capacity=1, eager=False)
    w = await pool.acquire()
    pool.kill(w, "timeout")
    assert not w.alive and pool.counters["killed:timeout"] == 1
    w2 = await asyncio.wait_for(pool.acquire(), 2.0)  # waits for the exit, then starts a new one
    assert w2 is not w and w2.generation > w.generation and pool.counters["spawned"] == 2
    assert pool.counters["restarts"] == 0  # on demand: replaced by the call, not by the supervisor
    await pool.aclose()


async def test_eager_pools_replace_an_exited_worker_at_once() -> None:
    s = Stand()
    pool = s.pool(2, eager=True)
    w = await pool.acquire()
    assert len(pool.workers()) == 2  # every slot started up front
    s.procs[w.slot].die(1)
    await _until(lambda: pool.counters["restarts"] == 1)
    assert pool.counters["exits"] == 1 and len(pool.workers()) == 2 and w not in pool.workers()
    assert s.exited == [w.handle.name]  # on_exit ran for it (the owner's clients closed there)
    await pool.aclose()


async def test_eager_least_loaded_and_no_live_worker_fails_at_once() -> None:
    s = Stand()
    pool = s.pool(2, eager=True)
    a = await pool.acquire()
    b = await pool.acquire()
    assert a is not b  # the least loaded first
    s.gate.clear()  # replacements will not become ready
    for p in list(s.procs):
        p.die(1)
    await _until(lambda: not any(w.alive for w in (a, b)) and pool.counters["exits"] == 2)
    # both slots are restarting (a 1 s pause: they died young): a caller fails at once, not left waiting
    assert pool.workers() == []
    with pytest.raises(Failed, match="no fake worker is alive"):
        await asyncio.wait_for(pool.acquire(), 0.5)
    await _until(lambda: pool.counters["restarts"] == 2)  # then the replacements come
    await pool.aclose()


async def test_wait_restarts_makes_a_caller_wait_for_a_replacement_instead_of_failing() -> None:
    """envs/remote.py's pool: a rollout that failed fast here would burn its retries in microseconds while
    the workers restart (a tool-use run with worker exits once counted 1.3 M retries in 4 minutes)."""
    s = Stand()
    pool = s.pool(2, eager=True, wait_restarts=True)
    a = await pool.acquire()
    b = await pool.acquire()
    s.gate.clear()
    for p in list(s.procs):
        p.die(1)
    await _until(lambda: not any(w.alive for w in (a, b)) and pool.counters["exits"] == 2)
    assert pool.workers() == []
    waiting = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.2)
    assert not waiting.done()  # no live worker: it waits, it does not fail
    s.gate.set()  # the replacements become ready
    w = await asyncio.wait_for(waiting, 5.0)
    assert w.alive and w not in (a, b) and pool.counters["restarts"] >= 1
    await pool.aclose()


async def test_a_worker_that_never_becomes_ready_fails_its_callers_with_the_reason() -> None:
    s = Stand(never_ready=True)
    pool = s.pool(1, capacity=1, eager=False, startup_timeout_s=1.0)
    with pytest.raises(Failed, match=r"crash: fake worker 0 did not start \(RuntimeError: bad import\)"):
        await asyncio.wait_for(pool.acquire(), 2.0)
    await _until(lambda: s.procs[0].killed)  # and it was killed, not left running
    await pool.aclose()


async def test_a_startup_deadline_kills_a_silent_worker() -> None:
    s = Stand()
    s.gate.clear()
    pool = s.pool(1, eager=False, startup_timeout_s=0.2)
    with pytest.raises(Failed, match=r"did not start \(TimeoutError"):
        await asyncio.wait_for(pool.acquire(), 2.0)
    await pool.aclose()


async def test_a_failing_supervisor_is_logged_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    s = Stand()

    async def broken(w: Worker[FakeProc]) -> None:
        raise ValueError("on_exit bug")

    pool = WorkerPool("fake worker", 1, start=s.start, ready=s.ready, on_exit=broken, failure=Failed, eager=False)
    w = await pool.acquire()
    with caplog.at_level(logging.ERROR, logger="flashrl.workers"):
        w.handle.die(3)
        await _until(lambda: "on_exit bug" in caplog.text)
    assert "fake worker 0.0 failed" in caplog.text
    await pool.aclose()
