"""A pool of worker processes: slots, each holding one process at a time, supervised and replaced.

    pool = WorkerPool(name, size, start=..., ready=..., on_exit=..., failure=..., capacity=..., eager=...)
    w = await pool.acquire()      a ready worker with room (the least loaded); w.handle is what you talk to
    ... your call on w.handle, with your own deadline ...
    pool.release(w)               the call (or session) is over
    pool.kill(w, "timeout")       a hung or broken worker: SIGKILL, counted (killed:<reason>), replaced
    await pool.aclose()           every worker killed and reaped; idempotent

Who uses it: the remote environment's workers (envs/remote.py: ZeroMQ, many sessions per worker,
replaced at once) and the process reward workers (flashrl/rewards.py: JSON lines on stdin/stdout,
one call per worker, replaced on the next call). The pool knows nothing of the transport: ``start``
spawns slot i's process and returns (process, handle); ``ready(handle)`` returns once it answers;
``on_exit(worker)`` releases what the handle holds once the process has exited (e.g. closes its
client, so every call waiting on it fails at once).

Invariants:
- a slot holds at most one process; its ``generation`` grows with every replacement, so a caller
  can tell that the worker it used is gone (``w.alive`` is False from the kill or the exit on).
- every process has a supervisor task: it waits for ``ready`` (within ``startup_timeout_s``) or
  the exit; a worker that does not become ready is killed and its waiters get
  ``failure("crash", ...)``; after the exit ``on_exit`` runs, ``exits`` is counted, and the slot is
  refilled now (``eager``: with a 1 s pause for a process that died within a second, so a crash
  loop does not spin; counted ``restarts``) or by the next ``acquire`` (lazy).
- ``acquire`` never hands out a dead worker, nor one with ``capacity`` calls already on it; it
  waits for room (a release, a replacement) or, when every slot is down in eager mode, raises
  ``failure("crash", ...)`` at once instead of waiting for the restarts (``wait_restarts``: waits for them).
- a supervisor that fails by itself (a bug) is logged with its traceback, never silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

H = TypeVar("H")

QUICK_DEATH_S = 1.0  # eager pools: a process that died sooner than this is replaced after this pause


class WorkerProc(Protocol):
    """The process of a worker: ``procs.Child`` and every launcher's ``Proc`` satisfy it."""

    def kill(self) -> None: ...  # SIGKILL the process (tree) now

    async def exited(self) -> int | None: ...  # waits until it has exited; its exit code


class PipedProc:
    """A ``WorkerProc`` for a child started in a session of its own with pipes to this process (process
    rewards, reward-model workers): ``kill`` SIGKILLs its whole process group and closes its stdin."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def start(cls, module: str, args: list[str], env: dict[str, str]) -> PipedProc:
        """``python -m module *args`` in a session of its own, stdin and stdout piped (lines up to 16 MiB)."""
        return cls(await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, start_new_session=True, limit=1 << 24))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):  # its loop may be gone (a pool used again from a new loop)
                self.proc.stdin.close()

    async def exited(self) -> int | None:
        return await self.proc.wait()


class Worker(Generic[H]):
    """One slot's current process, and what the owner talks to it with (``handle``)."""

    def __init__(self, slot: int, generation: int, proc: WorkerProc, handle: H) -> None:
        self.slot = slot
        self.generation = generation
        self.proc = proc
        self.handle = handle
        self.load = 0  # calls / sessions the owner holds on it (acquire .. release)
        self.alive = True  # False from its kill or its exit on: never handed out again
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.born = asyncio.get_running_loop().time()
        self.supervisor: asyncio.Task[None] | None = None

    @property
    def is_ready(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None


class WorkerPool(Generic[H]):
    """``size`` slots of worker processes; see the module docstring for the rules."""

    def __init__(
        self,
        name: str,
        size: int,
        *,
        start: Callable[[int, int], Awaitable[tuple[WorkerProc, H]]],
        ready: Callable[[H], Awaitable[object]],
        failure: Callable[[str, str], Exception],
        on_exit: Callable[[Worker[H]], Awaitable[None]] | None = None,
        capacity: int | None = None,
        eager: bool = True,
        startup_timeout_s: float = 60.0,
        wait_restarts: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError(f"{name}: a pool needs at least one worker, got {size}")
        self.name = name  # "env worker", "reward worker for 'math'": how errors and logs name a worker
        self.size = size
        self._start = start  # (slot, generation) -> (process, handle); the process is started, maybe not ready
        self._ready = ready
        self._failure = failure  # (reason "crash" | "timeout", detail) -> the owner's exception
        self._on_exit = on_exit
        self.capacity = capacity  # most calls at once on one worker; None: no limit (least loaded first)
        self.eager = eager  # True: every slot started up front and refilled at once; False: on demand
        self.startup_timeout_s = startup_timeout_s
        # True: when every slot is down (eager), acquire waits for a restart (the caller's deadline bounds it)
        # instead of failing at once: a caller that retries on failure (a rollout) would otherwise spin
        # through its retries in microseconds while the workers restart (envs/remote.py sets it).
        self.wait_restarts = wait_restarts
        self.counters: Counter[str] = Counter()  # spawned, exits, restarts, killed:<reason>
        self._slots: list[Worker[H] | None] = [None] * size
        self._filling: set[int] = set()  # slots whose process is being started
        self._generation = 0
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ what owners call
    def workers(self) -> list[Worker[H]]:
        """The live workers, in slot order."""
        return [w for w in self._slots if w is not None and w.alive]

    async def start(self) -> None:
        """Start a process in every empty slot (eager pools do this on their first acquire)."""
        self._bind_loop()
        for slot in range(self.size):
            if self._slots[slot] is None and slot not in self._filling and not self._closing:
                await self._fill(slot)

    async def acquire(self) -> Worker[H]:
        """A ready worker with room, the least loaded; waits for one that is starting, or for room."""
        self._bind_loop()
        assert self._changed is not None
        while True:
            if self._closing:
                raise self._failure("crash", f"the {self.name} pool is closed")
            if self.eager:
                await self.start()
            live = self.workers()
            roomy = [w for w in live if self.capacity is None or w.load < self.capacity]
            ready = [w for w in roomy if w.is_ready]
            if ready:
                w = min(ready, key=lambda x: x.load)
                w.load += 1
                return w
            if not self.eager:
                empty = next((s for s in range(self.size) if self._slots[s] is None and s not in self._filling), None)
                if empty is not None:
                    await self._fill(empty)
                    continue
            starting = [w for w in roomy if not w.ready.done()]
            if starting:
                w = min(starting, key=lambda x: x.load)
                w.load += 1
                try:
                    await asyncio.shield(w.ready)
                except BaseException:
                    w.load -= 1
                    self._wake()
                    raise
                return w
            if self.eager and not live and not self.wait_restarts:
                raise self._failure("crash", f"no {self.name} is alive (all are restarting)")
            self._changed.clear()
            await self._changed.wait()

    def release(self, w: Worker[H]) -> None:
        """The owner's call (or session) on ``w`` is over."""
        w.load = max(0, w.load - 1)
        self._wake()

    def kill(self, w: Worker[H], reason: str | None = None) -> None:
        """SIGKILL ``w`` (a call past its deadline, garbage on its channel); counted as killed:<reason> when
        a reason is given. Its supervisor runs ``on_exit`` and replaces it."""
        if w.alive:
            w.alive = False
            if reason is not None:
                self.counters[f"killed:{reason}"] += 1
            w.proc.kill()
            self._wake()

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` beside the callers (e.g. reading a cancelled call's late reply); cancelled by aclose.
        Its failure is logged: nothing it does may fail a caller."""
        t = asyncio.get_running_loop().create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._done_background)

    async def aclose(self) -> None:
        """Kill every worker, wait until each has exited and ``on_exit`` ran; idempotent."""
        self._closing = True
        self._wake()
        workers = [w for w in self._slots if w is not None]
        for w in workers:
            w.alive = False
            w.proc.kill()
        for w in workers:
            if w.supervisor is not None:
                with contextlib.suppress(BaseException):
                    await w.supervisor
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._slots = [None] * self.size

    # ------------------------------------------------------------------ inside
    def _bind_loop(self) -> None:
        """A pool lives on one event loop; used from a new one (tests: one loop each), it starts over
        (the old loop's workers are killed; their processes die with their group)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        for w in self._slots:
            if w is not None:
                w.alive = False
                w.proc.kill()
        self._loop, self._changed = loop, asyncio.Event()
        self._slots, self._filling, self._closing = [None] * self.size, set(), False

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _fill(self, slot: int) -> None:
        self._filling.add(slot)
        try:
            gen = self._generation
            self._generation += 1
            proc, handle = await self._start(slot, gen)
            w = Worker(slot, gen, proc, handle)
            self.counters["spawned"] += 1
            self._slots[slot] = w
            w.supervisor = asyncio.get_running_loop().create_task(self._supervise(w), name=f"{self.name} {slot}.{gen}")
            w.supervisor.add_done_callback(self._done_supervisor)
        finally:
            self._filling.discard(slot)
            self._wake()

    async def _supervise(self, w: Worker[H]) -> None:
        """Ready or not within the deadline; then the exit: on_exit, count, replace."""
        loop = asyncio.get_running_loop()
        exited = loop.create_task(w.proc.exited())
        ready = loop.create_task(self._ready_within(w.handle))
        try:
            await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            ready.cancel()
            exited.cancel()
            raise
        if ready.done() and not ready.cancelled() and ready.exception() is None:
            w.ready.set_result(None)
        else:
            ready.cancel()
            err = ready.exception() if ready.done() and not ready.cancelled() else None
            why = f"{type(err).__name__}: {err}" if err is not None else "it exited"
            w.ready.set_exception(self._failure("crash", f"{self.name} {w.slot} did not start ({why})"))
            w.ready.exception()  # retrieved: nobody may be waiting on this worker yet
            w.alive = False
            w.proc.kill()
        code = await exited
        w.alive = False
        if self._on_exit is not None:
            await self._on_exit(w)
        if self._closing:
            return
        self.counters["exits"] += 1
        log.warning("%s %d.%d exited with code %s; replacing it", self.name, w.slot, w.generation, code)
        if self._slots[w.slot] is not w:
            return
        self._slots[w.slot] = None
        if not self.eager:
            self._wake()  # the next acquire starts a new one here
            return
        self._filling.add(w.slot)  # reserved for the replacement below: acquire neither refills nor waits for it
        self._wake()
        try:
            if loop.time() - w.born < QUICK_DEATH_S:  # dying at start-up: do not spin
                await asyncio.sleep(QUICK_DEATH_S)
        finally:
            self._filling.discard(w.slot)
        if not self._closing and self._slots[w.slot] is None:
            await self._fill(w.slot)
            self.counters["restarts"] += 1

    async def _ready_within(self, handle: H) -> None:
        async with asyncio.timeout(self.startup_timeout_s):
            await self._ready(handle)

    def _done_supervisor(self, t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("%s: %s failed", self.name, t.get_name(), exc_info=t.exception())

    def _done_background(self, t: asyncio.Task[Any]) -> None:
        self._background.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("%s: a background task failed", self.name, exc_info=t.exception())
