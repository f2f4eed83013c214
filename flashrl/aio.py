"""The small asyncio toolkit of the controller's hot path: plain asyncio, a few microseconds a sample.

    Permits                counting semaphore; a free permit costs one comparison (engine slots)
    first_step(coro)       run a coroutine to its first suspension: (True, result) or (False, yielded)
    Resumed(coro, yielded) awaitable that goes on with such a coroutine exactly as ``await`` would
    as_coroutine(aw)       any awaitable as a coroutine that can be stepped by hand
    timeout(seconds)       ``asyncio.timeout`` where math.inf (or None) means no deadline
    Deadlines(seconds)     many deadlines of one length on one loop timer: ``with d.scope(task):``
                           behaves as ``async with asyncio.timeout(seconds):`` at a third of its cost
    shielded(coro, s)      cleanup that runs to its end even if the caller is cancelled, bounded
    TaskCancel(task)       a cancel of a task that can tell itself apart from every other cancel
    cancel_and_wait(tasks) cancel tasks and wait until every one has ended; a cancel of the waiter
                           is raised only after that
    supervised()           ``asyncio.TaskGroup`` that raises a lone failure as itself, not as a group
    until_stopped(stop, t) wait for ``stop``; a task of ``t`` that ends first raises TaskDied at once
    BusyTime(n)            requests in flight per server and the servers' summed busy time (the judge's engines)

Why these exist: the controller runs one task per rollout and nothing else (no per-sample helper
tasks, streams or cancel scopes), and most env calls and cleanups finish without ever suspending.
``first_step`` runs such a call inline: one that completes at once costs no timer and no task; one
that suspends gets its deadline (``Resumed`` under ``timeout``) or its shielded, bounded wait only
then. Cancellation is asyncio's own: ``Task.cancel`` / ``uncancel`` counting, as ``asyncio.timeout``
does, so several causes (a deadline, a ``TaskCancel``, the caller's cancel) stay apart.

Everything here is generic (no flashrl types) and covered by tests/unit/test_aio.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import math
import types
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any

__all__ = [
    "BusyTime",
    "Deadline",
    "Deadlines",
    "Permits",
    "Resumed",
    "TaskCancel",
    "TaskDied",
    "as_coroutine",
    "cancel_and_wait",
    "first_step",
    "shielded",
    "supervised",
    "timeout",
    "until_stopped",
]


class Permits:
    """A counting semaphore whose free permit costs one comparison (no await, no loop round trip).

    ``try_acquire()`` takes a free permit at once; ``await acquire()`` waits in FIFO order; a
    release hands the permit straight to the first waiter (so nobody overtakes a waiter). ``async
    with permits:`` works too. A waiter cancelled just after it was handed a permit passes it on.
    """

    __slots__ = ("value", "_waiters")

    def __init__(self, n: int) -> None:
        self.value = n  # free permits
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def try_acquire(self) -> bool:
        if self.value > 0 and not self._waiters:
            self.value -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a permit while being cancelled: it goes to the next one
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.value += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------- stepping by hand
class BusyTime:
    """Requests in flight per server, and the servers' busy time summed: a server is busy while at least one
    request is in flight on it (the judge's engines, real and simulated), on the running loop's clock.

        with busy.request(i):   # counts the request on server i for as long as the block runs
            ...
    """

    def __init__(self, servers: int) -> None:
        self.inflight = [0] * servers
        self.busy_s = 0.0
        self._since: list[float | None] = [None] * servers

    def least_loaded(self, candidates: Iterable[int]) -> int:
        """The candidate with the fewest requests in flight (the lowest index among equals)."""
        return min(candidates, key=lambda k: (self.inflight[k], k))

    @contextlib.contextmanager
    def request(self, i: int) -> Iterator[None]:
        clock = asyncio.get_running_loop().time
        self.inflight[i] += 1
        if self.inflight[i] == 1:
            self._since[i] = clock()
        try:
            yield
        finally:
            self.inflight[i] -= 1
            since = self._since[i]
            if self.inflight[i] == 0 and since is not None:
                self.busy_s += clock() - since
                self._since[i] = None


async def _drive(aw: Awaitable[Any]) -> Any:
    return await aw


def as_coroutine(aw: Awaitable[Any]) -> Coroutine[Any, Any, Any]:
    """``aw`` as a coroutine that can be stepped by hand (a method may return any awaitable)."""
    return aw if type(aw) is types.CoroutineType else _drive(aw)


def first_step(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``coro`` to its first suspension: (True, its result) or (False, what it yielded there).

    A coroutine that completes here took no loop time. One that suspended must be finished with
    ``await Resumed(coro, yielded)`` (or closed). Its exception, if it raised at once, is raised.
    """
    try:
        return False, coro.send(None)
    except StopIteration as stop:
        return True, stop.value


class Resumed:
    """Awaitable that goes on with a coroutine already run to its first suspension (``first_step``).

    ``yielded`` is what the coroutine yielded there (the future it waits on). Exactly what ``await
    coro`` does after its first step: values sent and exceptions thrown (a cancel) go on into the
    coroutine; closing this closes it.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro = coro
        self._first = yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, y = self._coro, self._first
        while True:
            try:
                sent = yield y
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - delivered into the coroutine, as ``await`` does
                try:
                    y = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    y = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


# --------------------------------------------------------------------------- deadlines and cancels
def timeout(seconds: float | None) -> asyncio.Timeout:
    """``asyncio.timeout(seconds)``; ``None`` or ``math.inf`` (a config's "no limit") arms no timer."""
    return asyncio.timeout(None if seconds is None or math.isinf(seconds) else seconds)


class Deadline:
    """One deadline of a ``Deadlines`` queue; a (synchronous) context manager, as ``asyncio.timeout``:
    on exit, a ``CancelledError`` that its expiry caused, with no other cancel pending, becomes
    ``TimeoutError``. Enter it at once: the deadline counts from ``Deadlines.scope()``."""

    __slots__ = ("task", "when", "expired", "over")

    def __init__(self, task: asyncio.Task[Any], when: float) -> None:
        self.task: asyncio.Task[Any] | None = task
        self.when = when
        self.expired = False  # the deadline passed and the task was cancelled for it
        self.over = False  # the scope was left: nothing to cancel any more

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.over = True
        task, self.task = self.task, None  # a finished scope queued behind a long one holds nothing
        if self.expired and exc_type is asyncio.CancelledError and task is not None and task.uncancel() == 0:
            raise TimeoutError from exc


class _NoDeadline:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_DEADLINE = _NoDeadline()


class Deadlines:
    """Deadlines all ``seconds`` long: they expire in the order they began, so one loop timer, armed
    for the earliest pending one, serves them all (``asyncio.timeout`` costs a timer handle, a heap
    push and a cancel each, about 4 us: too much once per rollout attempt).

        deadlines = Deadlines(600.0)
        with deadlines.scope(task):        # task: the current task
            await attempt()                # TimeoutError after 600 s, as asyncio.timeout raises

    A scope that ended is skipped when its turn comes; ended ones at the front are also dropped
    whenever a new one begins, so the queue holds about the scopes in flight. ``seconds`` = inf:
    no deadline at all (``scope`` returns a context that does nothing). One queue follows one loop
    at a time: used from another loop, the old loop's scopes are forgotten.
    """

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"Deadlines: seconds must be > 0, got {seconds!r}")
        self.seconds = seconds
        self._never = math.isinf(seconds)
        self._q: collections.deque[Deadline] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Scopes queued (in flight, or ended and not yet dropped)."""
        return len(self._q)

    def scope(self, task: asyncio.Task[Any]) -> Deadline | _NoDeadline:
        if self._never:
            return _NO_DEADLINE
        loop = task.get_loop()
        if loop is not self._loop:
            self._q.clear()
            self._timer = None
            self._loop = loop
        d = Deadline(task, loop.time() + self.seconds)
        q = self._q
        while q and q[0].over:
            q.popleft()
        q.append(d)
        if self._timer is None:
            self._timer = loop.call_at(d.when, self._fire)
        return d

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        q = self._q
        while q:
            d = q[0]
            if d.over:
                q.popleft()
            elif d.when > now:
                self._timer = loop.call_at(d.when, self._fire)
                return
            else:
                q.popleft()
                d.expired = True
                assert d.task is not None
                d.task.cancel()


async def shielded(coro: Awaitable[Any], seconds: float) -> bool:
    """Run cleanup ``coro`` to its end, even if this task is cancelled meanwhile, for at most ``seconds``.

    Returns False when it was given up on (timed out: it is cancelled). A cancel of this task that
    came meanwhile is raised once the cleanup is over; the cleanup's own error is raised. A cleanup
    that finishes without suspending costs no task and no timer.
    """
    c = as_coroutine(coro)
    try:
        y = c.send(None)
    except StopIteration:
        return True  # finished at once: no task, no timer
    loop = asyncio.get_running_loop()
    task = loop.create_task(_drive(Resumed(c, y)))
    deadline = loop.time() + seconds
    cancelled = False
    gave_up = False
    while not task.done():
        left = deadline - loop.time()
        if left <= 0 and not gave_up:
            gave_up = True
            task.cancel()
        try:
            await asyncio.wait((task,), timeout=None if gave_up else left)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    if not task.cancelled():
        err = task.exception()
        if err is not None:
            raise err
    return not gave_up


class TaskCancel:
    """A cancel of ``task`` that knows whether a ``CancelledError`` is its own (as ``asyncio.timeout`` does).

        tc = TaskCancel(task)           # someone else may later call tc.cancel()
        try:
            await work()
        except asyncio.CancelledError:
            if not tc.claim():
                raise                   # a deadline's or the caller's cancel: it goes on up
            ...                         # ours alone: handle it, the task goes on
    """

    __slots__ = ("task", "cancel_called")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.cancel_called = False

    def cancel(self) -> None:
        """Cancel the task, once (later calls do nothing)."""
        if not self.cancel_called:
            self.cancel_called = True
            self.task.cancel()

    def claim(self) -> bool:
        """In an ``except CancelledError`` of the task: True iff this cancel was called and no other
        cancel is pending (it is then uncounted); False: the error must be re-raised."""
        return self.cancel_called and self.task.uncancel() == 0


async def cancel_and_wait(tasks: Sequence[asyncio.Task[Any]],
                          never_started: Callable[[int], object] | None = None) -> None:
    """Cancel every unfinished task of ``tasks`` and wait until each has ended.

    ``never_started(k)`` is called for each ``tasks[k]`` cancelled before it ever ran: its coroutine
    never starts, so its ``finally`` blocks never run; the caller releases what they would have. A
    cancel of the waiting task itself is raised only after the wait: nothing is left running.
    """
    pending = [t for t in tasks if not t.done()]
    if not pending:
        return
    for k, t in enumerate(tasks):
        if t.done():
            continue
        if never_started is not None and inspect.getcoroutinestate(t.get_coro()) == inspect.CORO_CREATED:  # type: ignore[arg-type]
            never_started(k)
        t.cancel()
    cancelled = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [t for t in pending if not t.done()]
    if cancelled:
        raise asyncio.CancelledError


@contextlib.asynccontextmanager
async def supervised() -> AsyncIterator[asyncio.TaskGroup]:
    """``async with supervised() as tg:`` is ``async with asyncio.TaskGroup() as tg:`` (a task that fails
    cancels the body and every other task; the block ends only when every task has ended) whose
    failure is raised as the error itself when there is one (or one seen by several tasks), so the
    caller's ``except SomeError`` still matches; several different errors stay a BaseExceptionGroup.
    The error keeps its own cause (``raise ... from``) and traceback.
    """
    lone: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            yield tg
    except BaseExceptionGroup as eg:
        errors = [e for e in _leaves(eg) if not isinstance(e, asyncio.CancelledError)]
        if not errors or len({(type(e), str(e)) for e in errors}) > 1:
            raise
        lone = errors[0]
    if lone is not None:
        raise lone  # outside the except: its own __cause__ and __context__ stay (the group was only a wrapper)


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


class TaskDied(RuntimeError):
    """A task meant to run until its owner stops ended first: its error is the ``__cause__`` (none: it
    returned). The message names the task."""


async def until_stopped(stop: asyncio.Event, tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Wait until ``stop`` is set, watching ``tasks`` (each meant to run until then) meanwhile: one that
    ends first, by an error, a return or a cancel from elsewhere, raises TaskDied naming it (its
    ``get_name()``) at once, not when the owner gets around to awaiting it. The tasks are left as they
    are (the caller cancels the others on its way out). The loud counterpart of ``await stop.wait()``
    beside background tasks nobody awaits until shutdown."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({stopping, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if stop.is_set():
        return
    t = next(t for t in tasks if t.done())
    if t.cancelled():
        raise TaskDied(f"task {t.get_name()!r} was cancelled before its owner stopped")
    e = t.exception()
    if e is None:
        raise TaskDied(f"task {t.get_name()!r} returned before its owner stopped")
    raise TaskDied(f"task {t.get_name()!r} died: {type(e).__name__}: {e}") from e
