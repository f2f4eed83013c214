"""Virtual time for asyncio: an event loop whose clock jumps to the next timer when nothing is ready.

    run_virtual(main) -> VirtualRun(result, virtual_s, cpu_s): main() on a VirtualEventLoop
      _run_once():  ready callbacks?  -> run them, time stands still
                    none ready        -> selector.select(timeout) jumps the clock by ``timeout``
                                         (to the earliest timer) and returns no I/O events
                    no timer, nothing ready, nothing can come from outside -> VirtualDeadlock

Everything that reads the loop's clock (``loop.time()``, ``asyncio.sleep``, ``asyncio.timeout``,
``wait_for``, anyio deadlines and ``anyio.current_time()``) sees virtual seconds, so the real
controller runs unchanged and a simulated hour passes in the CPU time its callbacks take.

Determinism: the order of callbacks depends only on the program and on timer deadlines, never on
the machine's speed, so a run is a pure function of its seed. ``run_in_executor`` runs the function
inline (zero virtual time) for the same reason: a thread finishing "sometime" would make the order
depend on the machine. Real file descriptors still work (they are polled without waiting before the
clock jumps), but anything that depends on them is not deterministic; the simulator uses none.

Why not ``looptime`` (the maintained fake-time library): it spends 42 idle loop cycles and an
``epoll`` call before each time jump (to let naive code settle), which dominates a simulation with
millions of timer events; this loop jumps at once, which is exact for a discrete-event simulation.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: on virtual time nothing can ever happen again."""


class _VirtualSelector(selectors.BaseSelector):
    """Wraps the loop's real selector; ``select(timeout)`` advances virtual time instead of waiting."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualEventLoop) -> None:
        self._real = real
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.get_key(fileobj)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:
            # Callbacks are ready: time stands still. Skipping the poll here keeps the hot path free
            # of system calls; real I/O (only the self-pipe in a simulation) is seen at the next jump.
            return []
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            # Nothing scheduled and nothing ready. Only another thread could still wake us (through
            # the self-pipe); give it a short real grace period, then call it what it is.
            ready = self._real.select(self._loop.idle_grace_s)
            if ready:
                return ready
            raise VirtualDeadlock(
                f"virtual clock at t={self._loop.time():.3f}s: every task is waiting and no timer is "
                "scheduled, so nothing can happen any more (a coroutine awaits an event nobody sets; "
                "check the simulated engine/trainer/env for a missing reply)"
            )
        self._loop.jump(timeout)
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """A SelectorEventLoop whose ``time()`` is virtual (starts at ``start``, in seconds)."""

    def __init__(self, start: float = 0.0, idle_grace_s: float = 0.2) -> None:
        super().__init__()
        self._now = float(start)
        self.idle_grace_s = idle_grace_s
        self.jumps = 0  # how many times the clock advanced (a cost measure of a simulation)
        self._selector = _VirtualSelector(self._selector, self)  # type: ignore[has-type]

    def time(self) -> float:
        return self._now

    def jump(self, timeout: float) -> None:
        """Advance by ``timeout``, landing exactly on the earliest timer's deadline.

        Adding ``when - now`` back to ``now`` can fall a rounding error short of ``when``; landing on
        the deadline itself guarantees the timer fires in this loop iteration.
        """
        target = self._now + timeout
        scheduled = self._scheduled  # type: ignore[attr-defined]  # BaseEventLoop's timer heap
        if scheduled and scheduled[0]._when <= target + 1e-9:
            target = max(self._now, scheduled[0]._when)
        self._now = target
        self.jumps += 1

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        """Run ``func`` inline: zero virtual time, and the result order stays deterministic."""
        fut: asyncio.Future[T] = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting coroutine
            fut.set_exception(e)
        return fut


@dataclass(frozen=True)
class VirtualRun(Generic[T]):
    """What ``run_virtual`` hands back: ``main()``'s result and what the run cost."""

    result: T
    virtual_s: float  # simulated seconds that passed (the loop's clock at the end minus ``start``)
    cpu_s: float  # CPU seconds this process spent on the run (the simulator's own cost)


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]], *, start: float = 0.0) -> VirtualRun[T]:
    """Run ``main()`` to completion on virtual time; tasks still pending afterwards are cancelled.

    The one entry to virtual time, for the tests (scripted fakes: minutes of scheduling in
    milliseconds) and the bench (the simulator), which reads ``virtual_s`` and ``cpu_s``.
    """
    loop = VirtualEventLoop(start=start)
    cpu0 = time.process_time()
    try:
        asyncio.set_event_loop(loop)
        result = loop.run_until_complete(main())
        virtual = loop.time() - start
        _cancel_leftovers(loop)
        return VirtualRun(result, virtual, time.process_time() - cpu0)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _cancel_leftovers(loop: VirtualEventLoop) -> None:
    """Cancel tasks still pending after ``main`` returned (as ``asyncio.run`` does)."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
