"""The child-process supervisor: every process a run starts is a ``Child``, but the reward workers
(flashrl/rewards.py starts them with stdin/stdout pipes; they run ``child_init`` all the same).

    parent (controller)                                      child (engine, trainer rank, env worker)
      Child.spawn(name, cmd, log)                              main(): procs.child_init(name) first
        Popen(start_new_session=True)  -> own process group      PR_SET_PDEATHSIG = SIGUSR2, whose
        env FLASHRL_PARENT_PID = parent pid                        handler SIGKILLs the whole group
        stdout + stderr -> log file (append)                    watchdog thread: getppid() changed
        finalizer: SIGKILL the group if dropped unstopped          -> SIGKILL the whole group too
      await child.exited()   (pidfd: no polling thread)
      await child.stop(grace, shutdown=...)                    vLLM's EngineCore / workers, sandboxed
        shutdown() (e.g. a Shutdown message) -> wait grace       code ... are started inside the child:
        -> SIGTERM the group -> wait -> SIGKILL the group        they share its process group, so both
        -> wait until the group is empty (grandchildren too)     the parent's stop() and the child's
      child.kill(): SIGKILL the group now                        watchdog take them down with it

The ladder exists once, ``stop_ladder``: the orderly ``shutdown()`` and its grace, then ``escalate()``,
which is how the process is reached: ``Child`` signals its group here (SIGTERM, wait, SIGKILL, wait);
a process on a Ray node (launch/ray_proc.py) or a SLURM node (launch/slurm.py) asks the ``Child``
that holds it there to do the same.

Why both a parent-death signal and a watchdog: PR_SET_PDEATHSIG reaches only the child itself (not
its own children), and a default action (SIGKILL, SIGTERM) would end the child before it can take
its group along; so the signal is SIGUSR2 with a handler that SIGKILLs the group. A Python handler
runs only when the main thread gets to run bytecode; the watchdog thread runs while the main thread
sits in C code (a vLLM or torch call), and SIGKILLs the group within ``WATCHDOG_S``. The watchdog
compares ``getppid()`` with the pid the parent wrote into the environment, which also
catches a parent that died before the child got to run (and works inside containers, where an
orphan is re-parented to the container's init or a subreaper, never to its old parent).

Caveat (Linux): the parent-death signal fires when the *thread* that forked the child exits.
Spawn from the event loop's thread (as every caller here does), never from ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol

log = logging.getLogger(__name__)

PARENT_ENV = "FLASHRL_PARENT_PID"
WATCHDOG_S = 0.5  # how often a child checks that its parent is still there
_PR_SET_PDEATHSIG = 1
_PDEATHSIG = signal.SIGUSR2  # handled by child_init (SIGKILL or SIGTERM would end the child alone)


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is already empty."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a reused id of someone else's group: not ours to signal
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Does any process (zombies included) remain in group ``pgid``?"""
    return signal_group(pgid, 0)


def session_pids(sid: int) -> list[int]:
    """Every live process (not zombies) of session ``sid`` (Linux /proc), also those that moved into a
    process group of their own with setpgid (``ray start --block`` does): only setsid leaves a session."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != b"Z":
            pids.append(int(entry))
    return pids


def kill_session(sid: int, sig: int = signal.SIGKILL, spare: int | None = None) -> int:
    """Send ``sig`` to every process of session ``sid`` except ``spare``; how many were signalled."""
    n = 0
    for pid in session_pids(sid):
        if pid == spare:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            n += 1
    return n


def tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (a note instead when there is none)."""
    if path is None:
        return "(no log file: output went to the parent's stderr)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log at {path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def exit_text(code: int | None) -> str:
    """``-9`` -> "was killed by SIGKILL"; ``1`` -> "exited with code 1"."""
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Exiting(Protocol):
    """What the ladder needs of a process, wherever it runs: its name, whether it runs, its exit."""

    name: str

    @property
    def alive(self) -> bool: ...

    async def exited(self) -> int: ...


async def exited_within(proc: Exiting, timeout: float) -> bool:
    """True if ``proc`` exited within ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            await proc.exited()
    except TimeoutError:
        return False
    return True


async def stop_ladder(
    proc: Exiting,
    grace_s: float,
    shutdown: Callable[[], Awaitable[Any]] | None,
    escalate: Callable[[], Awaitable[Any]],
) -> None:
    """Shutdown -> SIGTERM -> SIGKILL: the orderly ``shutdown()`` (e.g. send a Shutdown message) within
    ``grace_s``, then ``grace_s`` to exit; a process still running then (or never asked) gets ``escalate()``,
    SIGTERM and SIGKILL of its group with their own deadlines, however the process is reached.

    ``shutdown`` None: straight to ``escalate``. Errors of ``shutdown`` are ignored (the ladder goes on).
    """
    asked = False
    if proc.alive and shutdown is not None:
        try:
            async with asyncio.timeout(grace_s):
                await shutdown()
            asked = True
        except Exception as e:  # noqa: BLE001 - a failed orderly stop just moves down the ladder
            log.debug("%s: shutdown request failed: %s", proc.name, e)
    if asked and await exited_within(proc, grace_s):
        return
    if proc.alive:
        await escalate()


class Child:
    """One supervised child process, leader of its own process group. Build with ``spawn``."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log_path: Path | None) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.spawned_at = time.monotonic()
        self._stopped = False
        # Dropped without stop() (a half-built cluster, a crash between spawn and registration): no orphans.
        self._finalizer = weakref.finalize(self, signal_group, proc.pid, signal.SIGKILL)

    @classmethod
    def spawn(
        cls,
        name: str,
        cmd: Sequence[str],
        log_path: str | Path | None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> Child:
        """Start ``cmd`` in its own process group with its output appended to ``log_path``.

        ``log_path`` None: the child writes to this process's stdout/stderr. ``env`` defaults to
        this process's environment; the parent pid for the child's watchdog is added either way.
        """
        full_env = dict(os.environ if env is None else env)
        full_env[PARENT_ENV] = str(os.getpid())
        out: IO[bytes] | None = None
        path = Path(log_path) if log_path is not None else None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab")  # noqa: SIM115 - the child holds its own copy after the fork
        try:
            proc = subprocess.Popen(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()
        log.info("spawned %s (pid %d)%s", name, proc.pid, f"; log {path}" if path else "")
        return cls(name, proc, path)

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def describe(self, lines: int = 30) -> str:
        """"<name> was killed by SIGKILL (pid N); last lines of <log>: ..." for error messages."""
        where = f"last lines of {self.log_path}" if self.log_path else "its output went to stderr"
        return f"{self.name} {exit_text(self.returncode)} (pid {self.pid}); {where}:\n{self.log_tail(lines)}"

    # ------------------------------------------------------------------ waiting
    async def exited(self) -> int:
        """Wait until the process exits (event-driven through a pidfd); its return code."""
        code = self.proc.poll()
        if code is not None:
            return code
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): poll
            return await asyncio.to_thread(self.proc.wait)
        done = loop.create_future()
        loop.add_reader(fd, lambda: None if done.done() else done.set_result(None))
        try:
            if self.proc.poll() is None:
                await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return self.proc.wait()

    async def wait(self, timeout: float) -> bool:
        """True if the process exited within ``timeout`` seconds."""
        return await exited_within(self, timeout)

    # ------------------------------------------------------------------ stopping
    def kill(self) -> None:
        """SIGKILL the whole group now (the child and everything it started)."""
        signal_group(self.pid, signal.SIGKILL)

    async def stop(
        self,
        grace_s: float = 10.0,
        shutdown: Callable[[], Awaitable[Any]] | None = None,
        term_s: float = 5.0,
        kill_s: float = 5.0,
    ) -> int | None:
        """Shutdown -> SIGTERM -> SIGKILL (``stop_ladder``), each with its deadline; returns once the
        group is empty.

        ``shutdown`` is the orderly request (e.g. send a Shutdown message); its errors are ignored
        (the ladder goes on). Idempotent; shielded by callers that must not be interrupted.
        """
        asked_before, self._stopped = self._stopped, True
        await stop_ladder(self, grace_s, None if asked_before else shutdown, lambda: self._signal(term_s, kill_s))
        await self.reap_group()
        self._finalizer.detach()
        return self.returncode

    async def _signal(self, term_s: float, kill_s: float) -> None:
        """SIGTERM the group, wait ``term_s``; SIGKILL it, wait ``kill_s``."""
        for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
            if not self.alive:
                break
            log.warning("%s (pid %d) still running; sending %s to its group", self.name, self.pid, sig.name)
            signal_group(self.pid, sig)
            if await self.wait(wait_s):
                break

    async def reap_group(self, timeout: float = 5.0) -> bool:
        """SIGKILL whatever is left in the group (the leader may be gone while a grandchild lingers)
        and wait until the group is empty; False (and a warning) if something survives ``timeout``."""
        self.proc.poll()  # reap the leader first: a zombie keeps the group non-empty
        signal_group(self.pid, signal.SIGKILL)
        end = time.monotonic() + timeout
        while group_alive(self.pid):
            if time.monotonic() > end:
                log.warning("%s: processes of group %d survived SIGKILL", self.name, self.pid)
                return False
            await asyncio.sleep(0.05)
            self.proc.poll()
        return True


# ---------------------------------------------------------------------- child side
def child_init(name: str, whole_session: bool = False) -> None:
    """First thing in a supervised child's main: die with the parent, and take the whole group along.

    ``whole_session``: take every process of this child's session along (Child.spawn makes the child a
    session leader), for children whose own children move into process groups of their own.
    A no-op when the process was not started by ``Child.spawn`` (e.g. by hand or under torchrun).
    """
    parent = int(os.environ.pop(PARENT_ENV, "0") or 0)
    if parent <= 0:
        return
    # The parent-death signal gets a handler that kills the group: its default action would end this
    # process alone and orphan its own children.
    signal.signal(_PDEATHSIG, lambda signum, frame: _orphaned(name, parent, whole_session))
    with contextlib.suppress(Exception):  # Linux only; elsewhere the watchdog alone does it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(_PDEATHSIG), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before we got here
        _orphaned(name, parent, whole_session)
    threading.Thread(target=_watch_parent, args=(name, parent, whole_session), name="flashrl-parent-watchdog",
                     daemon=True).start()


def _watch_parent(name: str, parent: int, whole_session: bool = False) -> None:
    while os.getppid() == parent:
        time.sleep(WATCHDOG_S)
    _orphaned(name, parent, whole_session)


def _orphaned(name: str, parent: int, whole_session: bool = False) -> None:
    """The parent is gone: nobody will read our results. SIGKILL our whole group (ourselves last)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{name}: parent process {parent} is gone; killing process group {os.getpgrp()}\n")
        sys.stderr.flush()
    if whole_session and os.getsid(0) == os.getpid():  # every process of our session but us, then us
        for _ in range(3):  # a daemon may fork while the first pass runs
            kill_session(os.getpid(), spare=os.getpid())
    if os.getpgrp() == os.getpid():  # we lead our group (Child.spawn): everything we started goes too
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def backoff(restart: int, first: float, cap: float) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): first, 2 x first, ... capped at ``cap`` (a
    crash loop does not spin): the controller's supervisor, the engines' and the judge engines' restarts."""
    return min(cap, first * 2 ** max(0, restart - 1))


def exit_now(code: int | None) -> NoReturn:
    """End a child process (engine, trainer rank) after its clean shutdown, without the interpreter's teardown.

    A process that imported vLLM or torch spent ~2-4 s after ``main`` returned: the modules' and millions of
    objects' teardown, and the exit hooks vLLM registers (its engine's shutdown unfreezes every object and
    runs two full collections, to free memory for an engine built again in the same process). The run
    waited for that before it could report and exit (bench/results/startup/exit). As Python's
    multiprocessing ends its child processes: logging is flushed and closed, stdio flushed, then
    ``os._exit``; no exit hook runs. What the process owns outside itself (sockets, files, the run's
    records) was closed by its shutdown; the kernel reclaims the rest.
    """
    try:
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 0)


@contextlib.contextmanager
def paused_gc() -> Any:
    """Pause Python's cyclic garbage collector while a process imports and builds its large libraries
    (vLLM, transformers, torch), then move what they made into the permanent generation (``gc.freeze``).

    Importing vLLM creates millions of objects that live as long as the process; every collection
    during the import scans them all again (2 s of the engine's 6 s import on this machine), and
    every later full collection (vLLM runs several while it builds its engine) scans them once
    more (another 1 s). Frozen, they are never scanned again (bench/results/startup). At exit they
    are unfrozen, so the interpreter's last collection still finalizes them (native bindings such as
    triton's report every object they never saw freed).
    """
    import atexit
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once, however often paused
        atexit.register(gc.unfreeze)
        if was_enabled:
            gc.enable()
