"""flashrl/aio.py, the asyncio toolkit of the hot path, on its own (times on the virtual clock are exact)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from flashrl.aio import (
    Deadlines,
    Permits,
    Resumed,
    TaskCancel,
    as_coroutine,
    cancel_and_wait,
    first_step,
    shielded,
    supervised,
    timeout,
)
from flashrl.sim.clock import run_virtual


def now() -> float:
    return asyncio.get_running_loop().time()


def test_permits_hand_off_in_fifo_order_and_a_cancelled_waiter_passes_its_permit_on() -> None:
    async def main() -> None:
        p = Permits(1)
        assert p.try_acquire() and not p.try_acquire() and p.value == 0
        got: list[str] = []

        async def waiter(name: str) -> None:
            await p.acquire()
            got.append(name)

        a, b, c = (asyncio.get_running_loop().create_task(waiter(x)) for x in "abc")
        await asyncio.sleep(0)
        assert got == [] and p.value == 0
        p.release()  # handed to a ...
        a.cancel()  # ... which is cancelled before it runs: the permit must go on to b, not vanish
        for _ in range(3):
            await asyncio.sleep(0)
        assert a.cancelled() and got == ["b"] and p.value == 0
        p.release()
        await asyncio.sleep(0)
        assert got == ["b", "c"] and p.value == 0
        p.release()
        assert p.value == 1 and await c is None
        async with p:
            assert p.value == 0
        assert p.value == 1

    run_virtual(main)


# --------------------------------------------------------------------------- first_step / Resumed
def test_first_step_finishes_a_call_that_never_suspends_inline() -> None:
    async def at_once() -> int:
        return 7

    async def raises_at_once() -> int:
        raise TimeoutError("no")

    assert first_step(at_once()) == (True, 7)
    with pytest.raises(TimeoutError, match="no"):
        first_step(raises_at_once())


def test_resumed_goes_on_like_await_results_errors_and_cancels() -> None:
    log: list[str] = []

    async def slow(x: int) -> int:
        await asyncio.sleep(1.0)
        return x * 2

    async def fails() -> None:
        await asyncio.sleep(1.0)
        raise ValueError("late")

    async def holds() -> None:
        try:
            await asyncio.sleep(10.0)
        except asyncio.CancelledError:
            log.append("inner saw the cancel")
            raise

    async def main() -> None:
        c = slow(21)
        done, y = first_step(c)
        assert not done and isinstance(y, asyncio.Future)
        assert await Resumed(c, y) == 42 and now() == 1.0
        c2 = fails()
        with pytest.raises(ValueError, match="late"):
            await Resumed(c2, first_step(c2)[1])
        c3 = holds()
        done, y = first_step(c3)
        t = asyncio.get_running_loop().create_task(_await(Resumed(c3, y)))
        await asyncio.sleep(0.5)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert log == ["inner saw the cancel"]

    run_virtual(main)


async def _await(aw: Any) -> Any:
    return await aw


def test_as_coroutine_steps_any_awaitable() -> None:
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        c = as_coroutine(fut)
        done, y = first_step(c)
        assert not done and y is fut
        asyncio.get_running_loop().call_later(1.0, fut.set_result, "ok")
        assert await Resumed(c, y) == "ok" and now() == 1.0

        async def coro() -> int:
            return 1

        c2 = coro()
        assert as_coroutine(c2) is c2  # a coroutine is stepped as it is: no wrapper
        c2.close()

    run_virtual(main)


# --------------------------------------------------------------------------- timeout
def test_timeout_infinite_arms_no_timer_finite_expires_exactly() -> None:
    async def main() -> None:
        async with timeout(math.inf) as t:
            assert t.when() is None
        async with timeout(None) as t:
            assert t.when() is None
        with pytest.raises(TimeoutError):
            async with timeout(2.5):
                await asyncio.sleep(10.0)
        assert now() == 2.5

    run_virtual(main)


# --------------------------------------------------------------------------- Deadlines
def test_deadlines_expire_each_scope_exactly_on_one_timer_as_asyncio_timeout_would() -> None:
    d = Deadlines(5.0)

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        loop = asyncio.get_running_loop()

        async def scoped(name: str, start: float, work: float) -> None:
            await asyncio.sleep(start)
            task = asyncio.current_task()
            assert task is not None
            try:
                with d.scope(task):
                    await asyncio.sleep(work)
                out[name] = ("ok", now())
            except TimeoutError:
                out[name] = ("timeout", now())

        timers0 = len(loop._scheduled)  # type: ignore[attr-defined]
        tasks = [loop.create_task(scoped(n, s, w)) for n, s, w in
                 (("short", 0.0, 1.0), ("long", 0.5, 100.0), ("late", 2.0, 100.0), ("quick", 3.0, 0.5))]
        await asyncio.sleep(3.25)
        # four sleepers, one deadline timer (the earliest pending scope's), not one per scope
        assert len(loop._scheduled) - timers0 == 3 + 1  # type: ignore[attr-defined]
        await asyncio.gather(*tasks)
        return out

    out = run_virtual(main).result
    assert out == {"short": ("ok", 1.0), "long": ("timeout", 5.5), "late": ("timeout", 7.0), "quick": ("ok", 3.5)}
    assert len(d) == 0


def test_deadline_leaves_other_cancels_alone_and_inf_is_no_deadline() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Deadlines(2.0)

        async def hold() -> None:
            task = asyncio.current_task()
            assert task is not None
            with d.scope(task):
                await asyncio.sleep(10.0)

        t = loop.create_task(hold())
        await asyncio.sleep(1.0)
        t.cancel()  # the caller's cancel, before the deadline: a CancelledError, not a TimeoutError
        with pytest.raises(asyncio.CancelledError):
            await t
        t = loop.create_task(hold())
        loop.call_later(2.0, t.cancel)  # the same tick as its deadline: both pending, the cancel wins
        with pytest.raises(asyncio.CancelledError):
            await t
        assert now() == 3.0

        task = asyncio.current_task()
        assert task is not None
        with Deadlines(math.inf).scope(task):
            await asyncio.sleep(1e6)  # nothing cancels it
        with pytest.raises(ValueError, match="seconds must be > 0"):
            Deadlines(0.0)

    run_virtual(main)


# --------------------------------------------------------------------------- shielded
def test_shielded_cleanup_that_finishes_at_once_costs_no_task() -> None:
    async def close() -> str:
        return "closed"

    async def main() -> None:
        before = len(asyncio.all_tasks())
        assert await shielded(close(), 5.0) is True
        assert len(asyncio.all_tasks()) == before

    run_virtual(main)


def test_shielded_cleanup_runs_to_its_end_under_a_cancel_then_the_cancel_is_raised() -> None:
    ended: list[float] = []

    async def close() -> None:
        await asyncio.sleep(2.0)
        ended.append(now())

    async def owner() -> None:
        await shielded(close(), 5.0)

    async def main() -> None:
        t = asyncio.get_running_loop().create_task(owner())
        await asyncio.sleep(0.5)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert ended == [2.0] and now() == 2.0  # the cleanup finished before the cancel went on

    run_virtual(main)


def test_shielded_gives_up_after_its_bound_and_raises_the_cleanups_error() -> None:
    cancelled: list[float] = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(100.0)
        except asyncio.CancelledError:
            cancelled.append(now())
            raise

    async def broken() -> None:
        await asyncio.sleep(1.0)
        raise OSError("socket gone")

    async def main() -> None:
        assert await shielded(hangs(), 3.0) is False
        assert cancelled == [3.0]
        with pytest.raises(OSError, match="socket gone"):
            await shielded(broken(), 3.0)

    run_virtual(main)


# --------------------------------------------------------------------------- TaskCancel
def test_task_cancel_claims_only_its_own_cancel() -> None:
    async def main() -> list[str]:
        out: list[str] = []
        scopes: dict[str, TaskCancel] = {}

        async def work(name: str) -> None:
            task = asyncio.current_task()
            assert task is not None
            tc = scopes[name] = TaskCancel(task)
            try:
                await asyncio.sleep(10.0)
            except asyncio.CancelledError:
                if not tc.claim():
                    out.append(f"{name}: not mine")
                    raise
                out.append(f"{name}: mine, going on")
            await asyncio.sleep(1.0)
            out.append(f"{name}: done {now()}")

        loop = asyncio.get_running_loop()
        a = loop.create_task(work("a"))
        b = loop.create_task(work("b"))
        await asyncio.sleep(1.0)
        scopes["a"].cancel()
        scopes["a"].cancel()  # once only
        scopes["b"].cancel()
        b.cancel()  # a second cause (say, shutdown): it must go on up
        await a
        with pytest.raises(asyncio.CancelledError):
            await b
        assert a.cancelling() == 0
        return out

    assert sorted(run_virtual(main).result) == ["a: done 2.0", "a: mine, going on", "b: not mine"]


def test_task_cancel_under_an_expired_timeout_leaves_the_timeout_its_error() -> None:
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        tc = TaskCancel(task)
        asyncio.get_running_loop().call_later(2.0, tc.cancel)
        with pytest.raises(TimeoutError):
            async with timeout(2.0):  # expires in the same tick as the TaskCancel
                try:
                    await asyncio.sleep(10.0)
                except asyncio.CancelledError:
                    assert not tc.claim()  # two cancels pending: not ours alone
                    raise

    run_virtual(main)


# --------------------------------------------------------------------------- cancel_and_wait
def test_cancel_and_wait_releases_never_started_tasks_and_waits_for_cleanups() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        cleaned: list[float] = []

        async def worker() -> None:
            try:
                await asyncio.sleep(100.0)
            finally:
                await shielded(asyncio.sleep(1.0), 5.0)
                cleaned.append(now())

        started = [loop.create_task(worker()) for _ in range(2)]
        await asyncio.sleep(0)  # these two ran to their first await
        fresh = loop.create_task(worker())  # this one never runs
        released: list[int] = []
        await cancel_and_wait([*started, fresh], released.append)
        assert released == [2] and cleaned == [1.0, 1.0] and now() == 1.0
        assert all(t.cancelled() for t in (*started, fresh))

        # a cancel of the waiter is raised only once every task has ended
        t2 = loop.create_task(worker())
        await asyncio.sleep(0)
        waiter = loop.create_task(cancel_and_wait([t2]))
        await asyncio.sleep(0.5)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert t2.done() and now() == 2.0

    run_virtual(main)


async def test_supervised_raises_a_lone_failure_as_itself_and_several_as_a_group() -> None:
    async def fail(e: BaseException) -> None:
        await asyncio.sleep(0)
        raise e

    async def forever() -> None:
        await asyncio.Event().wait()

    cause = KeyError("why")
    err = RuntimeError("the sampler failed")
    err.__cause__ = cause
    other: asyncio.Task[None] | None = None
    with pytest.raises(RuntimeError, match="the sampler failed") as info:
        async with supervised() as tg:
            other = tg.create_task(forever())
            tg.create_task(fail(err))
            await forever()  # the body is cancelled too
    assert info.value is err and info.value.__cause__ is cause  # itself, its cause kept
    assert other is not None and other.cancelled()  # every other task ended
    with pytest.raises(ValueError, match="body"):  # the body's own error, as itself
        async with supervised():
            raise ValueError("body")
    with pytest.raises(ExceptionGroup) as group:  # noqa: F821 - Python >= 3.11 (TaskGroup)  # two different failures: both, as a group
        async with supervised() as tg:
            tg.create_task(fail(ValueError("a")))
            tg.create_task(fail(OSError("b")))
    assert sorted(type(e).__name__ for e in group.value.exceptions) == ["OSError", "ValueError"]


def test_busy_time_counts_a_server_busy_once_however_many_requests_overlap() -> None:
    from flashrl.aio import BusyTime
    from flashrl.sim.clock import run_virtual

    busy = BusyTime(2)

    async def req(i: int, start: float, length: float) -> None:
        await asyncio.sleep(start)
        with busy.request(i):
            await asyncio.sleep(length)

    async def main() -> list[int]:
        # server 0: [0, 3] and [1, 2] overlap (busy 3 s), then [5, 6] (1 s); server 1: [1, 3] (2 s)
        jobs = [req(0, 0, 3), req(0, 1, 1), req(0, 5, 1), req(1, 1, 2)]
        tasks = [asyncio.create_task(j) for j in jobs]
        await asyncio.sleep(1.5)
        seen = list(busy.inflight)
        await asyncio.gather(*tasks)
        return seen

    assert run_virtual(main).result == [2, 1]
    assert busy.busy_s == pytest.approx(6.0) and busy.inflight == [0, 0]
    assert busy.least_loaded([0, 1]) == 0 and busy.least_loaded([1]) == 1
