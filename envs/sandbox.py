"""Run untrusted Python in a separate, isolated process without blocking the event loop.

    run_sandboxed(code, stdin, limits)                               (asyncio; many may run at once)
      plan = isolation(limits): "uid" (root), "landlock" (any user), or refused (SandboxUnavailable)
      temp dir (0700, owned by the sandbox uid) <- main.py
      spawn: python -I -S sandbox_boot.py PLAN   cwd = temp dir, clean environment, own process group
        child, envs/sandbox_boot.py (trusted, runs before any untrusted byte; see its docstring):
          netns (root) -> rlimits -> preload + fresh uid (root) -> Landlock -> seccomp -> audit hook
          -> "ready" on a private pipe -> exec main.py (MemoryError -> exit 87, "memory")
      parent: feed stdin, drain stdout/stderr (capped), wait up to wall_s; an I/O task that fails ends
              the run at once (the program killed) with SandboxError naming the stream, never a
              silently truncated output or a blocked pipe taken for the program's timeout
      always: SIGKILL the process group, then (uid mode) every process of the sandbox uid
      remove the temp dir; no "ready" -> SandboxError (setup failed); else status -> SandboxResult

Isolation modes (``isolation``):
- "uid" (root with drop_privileges): a fresh uid that owns nothing (RLIMIT_NPROC bites; every
  process of that uid is killed afterwards, however it detached), a private network namespace
  (required unless seccomp is available), plus Landlock and seccomp when the kernel has them.
- "landlock" (not root, or root without drop_privileges): Landlock confines files to the Python
  runtime, system libraries and the temp dir, denies TCP and (ABI >= 6) signals to processes outside
  the sandbox; seccomp makes socket(), io_uring and the creation of processes fail (threads work).
  Both are inherited and irreversible, and with no child process nothing outlives the run.
  Needs Linux >= 5.13 with Landlock enabled and seccomp (x86_64 or aarch64).
- neither available: ``run_sandboxed`` refuses (SandboxUnavailable) unless ``allow_unisolated``;
  then only rlimits, the layers that do exist, and the audit hook (which a child process or ctypes
  bypasses) stand between the code and this user's files and network.

Why a bootstrap instead of ``preexec_fn``: ``preexec_fn`` runs between fork and exec in a copy of a
multi-threaded parent (ZeroMQ's I/O threads), which Python documents as deadlock-prone; the
bootstrap sets the same limits in the child before untrusted code runs, without that hazard.

Checked on the development machine (Linux 6.18, Landlock ABI 7, Python 3.11; tests/integration/test_env_sandbox.py
runs both modes, the non-root one as ``nobody``). Limits: the code can read the Python runtime and
system libraries; on Landlock ABI < 6 a non-root sandbox can still signal this user's processes.
Use a container or VM for untrusted code at scale.

Status table: ok (exit 0) | error (non-zero exit, e.g. an exception; a fork bomb whose fork fails
with EAGAIN/EPERM) | timeout (wall-clock limit, or CPU limit -> SIGXCPU) | memory (MemoryError under
RLIMIT_AS) | network_blocked (the audit hook stopped a network call) | killed (any other signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from envs.sandbox_boot import ARCHES, MEM_EXIT, NET_EXIT, landlock_abi

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
_UID_BASE = 1_000_000  # sandbox uids: _UID_BASE + pid * 64 + n, never a real account
_counter = itertools.count()

Status = Literal["ok", "timeout", "memory", "killed", "error", "network_blocked"]

# Imported before the uid drop: the interpreter may live under a directory the sandbox uid cannot
# read (here /root/.pyenv), so lazy imports of these would fail afterwards.
PRELOAD = (
    "math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "re", "string",
    "json", "random", "fractions", "decimal", "statistics", "operator", "typing", "dataclasses",
    "traceback", "linecache", "copy", "io", "array", "enum", "socket", "encodings.idna", "threading",
)  # fmt: skip
# Readable (not writable) inside the sandbox besides its temp dir: the runtime and shared libraries.
SYSTEM_READ_ONLY = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache", "/proc/self")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class SandboxUnavailable(RuntimeError):
    """No isolation is available here and the limits do not allow running without it."""


class SandboxError(OSError):
    """The sandbox itself could not start, set up an isolation layer or move the program's I/O (not the
    code's fault)."""


IO_NAMES = ("stdin", "stdout", "stderr")  # run_sandboxed's I/O tasks, in their order


def _io_failure(io: Sequence[asyncio.Future[None]]) -> SandboxError | None:
    """The first I/O task that raised (a cancel is not a failure: a descendant held a pipe), as the error
    run_sandboxed raises for it."""
    for name, t in zip(IO_NAMES, io, strict=True):
        if t.done() and not t.cancelled() and (e := t.exception()) is not None:
            err = SandboxError(f"sandbox I/O failed: the program's {name} task raised {type(e).__name__}: {e}")
            err.__cause__ = e
            return err
    return None


async def _wait_exit(proc: asyncio.subprocess.Process, io: Sequence[asyncio.Future[None]], wall_s: float) -> bool:
    """Wait for the program to exit, at most ``wall_s`` (True: timed out); an I/O task that fails first
    raises its SandboxError at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wall_s
    exited = asyncio.ensure_future(proc.wait())
    try:
        pending: set[asyncio.Future[Any]] = {exited, *io}
        while not exited.done():
            left = deadline - loop.time()
            if left <= 0:
                return True
            _, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if (err := _io_failure(io)) is not None:
                raise err
        return False
    finally:
        if not exited.done():
            exited.cancel()
            await asyncio.gather(exited, return_exceptions=True)


class SandboxLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Limits of one sandboxed run."""

    wall_s: Annotated[float, Meta(gt=0, le=3600, description="wall-clock limit; past it the process group is killed")] = 5.0
    cpu_s: Annotated[int, Meta(ge=1, le=3600, description="CPU seconds (RLIMIT_CPU)")] = 2
    memory_mb: Annotated[int, Meta(ge=32, le=65536, description="address space in MiB (RLIMIT_AS)")] = 256
    nproc: Annotated[int, Meta(ge=1, le=4096, description="processes of the sandbox uid (RLIMIT_NPROC)")] = 8
    fsize_mb: Annotated[int, Meta(ge=0, le=4096, description="largest file the code may write, MiB (RLIMIT_FSIZE)")] = 8
    nofile: Annotated[int, Meta(ge=8, le=4096, description="open file descriptors (RLIMIT_NOFILE)")] = 64
    max_output_chars: Annotated[int, Meta(ge=0, description="stdout/stderr kept (the rest is read and dropped)")] = 65536
    unshare_net: Annotated[bool, Meta(description="root: a private network namespace (required when seccomp is unavailable)")] = True
    drop_privileges: Annotated[bool, Meta(description="as root, run the code under a fresh unprivileged uid")] = True
    allow_unisolated: Annotated[bool, Meta(description="run even where no isolation is available (the code gets this user's files and network); false: refuse")] = False


class SandboxResult(msgspec.Struct, kw_only=True, frozen=True):
    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float


def _sandbox_uid() -> int:
    return _UID_BASE + os.getpid() * 64 + next(_counter) % 64


@functools.cache
def kernel_support() -> tuple[int, str | None]:
    """(Landlock ABI version or 0, the seccomp architecture name or None) of this machine."""
    arch = platform.machine()
    libc = ctypes.CDLL(None, use_errno=True)
    seccomp = arch if arch in ARCHES and libc.prctl(21, 0, 0, 0, 0) >= 0 else None  # PR_GET_SECCOMP
    return landlock_abi(), seccomp


def _read_only_paths() -> list[str]:
    lib = {os.path.join(sys.base_prefix, "lib"), os.path.join(sys.base_exec_prefix, "lib")}
    return sorted(lib) + list(SYSTEM_READ_ONLY)


def isolation(lim: SandboxLimits) -> str | None:
    """How ``run_sandboxed`` isolates code under ``lim`` on this machine: "uid", "landlock" or None."""
    abi, seccomp = kernel_support()
    if os.geteuid() == 0 and lim.drop_privileges:
        return "uid" if (lim.unshare_net or seccomp) else None
    return "landlock" if abi >= 1 and seccomp else None


def unavailable_message(lim: SandboxLimits, key: str = "allow_unisolated") -> str:
    abi, seccomp = kernel_support()
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()} (not root)"
    return (f"{key}: no sandbox isolation here: running as {who}, Landlock ABI {abi or 'unavailable'}, seccomp "
            f"{seccomp or 'unavailable'} (drop_privileges={lim.drop_privileges}, unshare_net={lim.unshare_net}); "
            "untrusted code would run with this user's files, processes and network. Run as root, or on Linux "
            f">= 5.13 with Landlock and seccomp, or set {key} = true to accept that risk")


def plan(lim: SandboxLimits) -> dict[str, Any]:
    """The bootstrap's settings (envs/sandbox_boot.py) for one run; raises SandboxUnavailable."""
    mode = isolation(lim)
    if mode is None and not lim.allow_unisolated:
        raise SandboxUnavailable(unavailable_message(lim))
    abi, seccomp = kernel_support()
    root = os.geteuid() == 0
    uid = _sandbox_uid() if mode == "uid" else None
    netns = None
    if root and lim.unshare_net:
        netns = "required" if (mode == "uid" and not seccomp) else "optional"
    return {
        "mode": mode, "cpu": lim.cpu_s, "mem": lim.memory_mb << 20, "fsize": lim.fsize_mb << 20,
        "nofile": lim.nofile, "uid": uid, "netns": netns, "landlock": abi, "seccomp": seccomp,
        # A fresh uid makes RLIMIT_NPROC a per-sandbox bound; for a shared uid it would count every
        # process of this user, so without one no process may be created at all (seccomp).
        "nproc": lim.nproc if uid is not None else None, "no_procs": uid is None,
        "preload": list(PRELOAD) if uid is not None else [],
        "read_only": _read_only_paths(), "devices": list(DEVICES),
    }  # fmt: skip


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left but zombies (a fork bomb races the scan)."""
    for _ in range(200):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
            except (OSError, ValueError):
                continue
            if str(uid) in fields.get("Uid", "").split() and not fields.get("State", "").strip().startswith("Z"):
                found = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.005)  # killed processes take a moment to exit


def _prepare_dir(code: str, uid: int | None) -> str:
    """A fresh 0700 temp dir holding main.py, owned by the sandbox uid (when there is one)."""
    tmp = tempfile.mkdtemp(prefix="flashrl-sandbox-")
    with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    if uid is not None:
        os.chown(tmp, uid, uid)
        os.chown(os.path.join(tmp, "main.py"), uid, uid)
    return tmp


async def _drain(stream: asyncio.StreamReader | None, keep: int, out: list[bytes]) -> None:
    """Read ``stream`` to EOF, keeping the first ``keep`` bytes (draining the rest unblocks the writer)."""
    if stream is None:
        return
    kept = 0
    while chunk := await stream.read(65536):
        if kept < keep:
            out.append(chunk[: keep - kept])
            kept += len(out[-1])


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes) -> None:
    if stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stdin.write(data)
        await stdin.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stdin.close()


def _status(code: int | None, timed_out: bool, stderr: str) -> Status:
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if code == 0:
        return "ok"
    if code == NET_EXIT and "sandbox: network access blocked" in stderr:
        return "network_blocked"
    if code == MEM_EXIT or (code == 1 and stderr.rstrip().endswith("MemoryError")):
        return "memory"
    if code is not None and code < 0:
        return "killed"
    return "error"


async def run_sandboxed(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a Python program under ``limits``; never raises for anything the code does.

    Raises SandboxUnavailable when this machine offers no isolation and ``limits.allow_unisolated`` is
    false, and SandboxError (an OSError) when the sandbox itself cannot start or set up a layer.
    """
    lim = limits or SandboxLimits()
    loop = asyncio.get_running_loop()
    cfg = plan(lim)
    uid = cfg["uid"]
    tmp = await asyncio.to_thread(_prepare_dir, code, uid)
    ready_r, ready_w = os.pipe()
    try:
        cfg["ready_fd"] = ready_w
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        start = loop.time()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", BOOT, json.dumps(cfg),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=tmp, env=env, start_new_session=True, pass_fds=(ready_w,),
            )  # fmt: skip
        finally:
            os.close(ready_w)
        out: list[bytes] = []
        err: list[bytes] = []
        io = [
            asyncio.ensure_future(_feed(proc.stdin, stdin.encode())),
            asyncio.ensure_future(_drain(proc.stdout, lim.max_output_chars, out)),
            asyncio.ensure_future(_drain(proc.stderr, lim.max_output_chars, err)),
        ]
        try:
            timed_out = await _wait_exit(proc, io, lim.wall_s)
        finally:
            # Descendants may still run (and hold the pipes) after the main process exits.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if uid is not None:
                await asyncio.to_thread(_kill_uid, uid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            _, pending = await asyncio.wait(io, timeout=1.0)
            for t in pending:  # a descendant outside our reach still holds a pipe (allow_unisolated)
                t.cancel()
            await asyncio.gather(*io, return_exceptions=True)  # each one's error is read just below
        if (io_err := _io_failure(io)) is not None:  # one that failed after the program's exit
            raise io_err
        seconds = loop.time() - start
        # The bootstrap closes its end before the code runs, so the child's death means EOF here.
        os.set_blocking(ready_r, False)
        with contextlib.suppress(BlockingIOError):
            ready = os.read(ready_r, 16)
    finally:
        os.close(ready_r)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    stdout = b"".join(out).decode("utf-8", "replace")
    stderr = b"".join(err).decode("utf-8", "replace")
    if ready != b"ready":
        # Checked through a pipe the code never sees: a program cannot fake a setup failure.
        raise SandboxError(f"sandbox did not start ({cfg['mode'] or 'unisolated'} mode, exit {proc.returncode}"
                           f"{', wall-clock limit' if timed_out else ''}): {stderr.strip()[-500:]}")
    return SandboxResult(
        status=_status(proc.returncode, timed_out, stderr),
        stdout=stdout,
        stderr=stderr,
        exit_code=proc.returncode,
        seconds=seconds,
    )
