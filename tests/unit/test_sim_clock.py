"""The virtual clock: sleeps add up exactly, timers fire in deadline order, runs are deterministic."""

from __future__ import annotations

import asyncio
import random

import anyio
import pytest

from flashrl.sim.clock import VirtualDeadlock, VirtualEventLoop, run_virtual


def test_sleeps_add_up_exactly_and_take_no_real_time() -> None:
    async def main() -> float:
        for _ in range(1000):
            await asyncio.sleep(3600.0)  # 1000 simulated hours
        return asyncio.get_running_loop().time()

    run = run_virtual(main)
    t = run.result
    virtual = run.virtual_s
    cpu = run.cpu_s
    assert t == 3_600_000.0
    assert virtual == 3_600_000.0
    assert cpu < 2.0


def test_concurrent_sleepers_finish_at_their_own_deadlines() -> None:
    async def main() -> list[tuple[float, int]]:
        loop = asyncio.get_running_loop()
        done: list[tuple[float, int]] = []

        async def sleeper(i: int) -> None:
            await asyncio.sleep(0.5 * (5 - i))
            done.append((loop.time(), i))

        await asyncio.gather(*(sleeper(i) for i in range(5)))
        return done

    run = run_virtual(main)
    done = run.result
    virtual = run.virtual_s
    assert done == [(0.5, 4), (1.0, 3), (1.5, 2), (2.0, 1), (2.5, 0)]
    assert virtual == 2.5  # concurrent, not 7.5


def test_timeouts_and_anyio_use_virtual_time() -> None:
    async def main() -> tuple[bool, float, float]:
        timed_out = False
        try:
            async with asyncio.timeout(2.0):
                await asyncio.sleep(10.0)
        except TimeoutError:
            timed_out = True
        t1 = anyio.current_time()
        with anyio.move_on_after(3.0):
            await anyio.sleep(100.0)
        return timed_out, t1, anyio.current_time()

    timed_out, t1, t2 = run_virtual(main).result
    assert timed_out
    assert t1 == 2.0
    assert t2 == 5.0


def test_same_program_same_trace() -> None:
    def trace() -> list[tuple[float, int]]:
        async def main() -> list[tuple[float, int]]:
            rng = random.Random(7)
            loop = asyncio.get_running_loop()
            out: list[tuple[float, int]] = []

            async def worker(i: int) -> None:
                for _ in range(20):
                    await asyncio.sleep(rng.random())
                    out.append((loop.time(), i))

            await asyncio.gather(*(worker(i) for i in range(10)))
            return out

        return run_virtual(main).result

    a, b = trace(), trace()
    assert a == b
    assert len(a) == 200


def test_deadlock_is_reported_not_hung() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualDeadlock, match="no timer is scheduled"):
        run_virtual(main)


def test_executor_runs_inline_in_zero_virtual_time() -> None:
    async def main() -> tuple[int, float]:
        r = await asyncio.get_running_loop().run_in_executor(None, sum, [1, 2, 3])
        return r, asyncio.get_running_loop().time()

    r, t = run_virtual(main).result
    assert (r, t) == (6, 0.0)


def test_start_offset() -> None:
    loop = VirtualEventLoop(start=100.0)
    try:
        assert loop.run_until_complete(asyncio.sleep(1.0, result=loop.time())) == 100.0
        assert loop.time() == 101.0
    finally:
        loop.close()
