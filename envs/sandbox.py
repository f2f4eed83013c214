"""Run untrusted Python in a separate, limited process without blocking the event loop.

    run_sandboxed(code, stdin, limits)                               (asyncio; many may run at once)
      temp dir (0700, owned by the sandbox uid) <- main.py
      spawn: python -I -S -c BOOTSTRAP   cwd = temp dir, clean environment, own session/process group
        child, BOOTSTRAP (trusted, runs before any untrusted byte):
          1. unshare(CLONE_NEWNET)  -> a network namespace with only a downed loopback (root only)
          2. setrlimit CPU, AS, NPROC, FSIZE, NOFILE, CORE=0
          3. root: pre-import common stdlib modules, then drop to a fresh uid (no groups)
          4. sys.addaudithook: connect/bind/sendto/DNS -> exit code 86 ("network_blocked")
          5. exec main.py (a MemoryError escaping it -> exit code 87, "memory")
      parent: feed stdin, drain stdout/stderr (capped), wait up to wall_s
      always: SIGKILL the process group, then (uid mode) every process of the sandbox uid
      remove the temp dir; status from the exit code -> SandboxResult

Why a bootstrap instead of ``preexec_fn``: ``preexec_fn`` runs between fork and exec in a copy of a
multi-threaded parent (ZeroMQ's I/O threads), which Python documents as deadlock-prone; the
bootstrap sets the same limits in the child before untrusted code runs, without that hazard.

What was checked on the development machine (root in a container, Python 3.11; see
tests/test_env_sandbox.py): ``unshare(CLONE_NEWNET)`` through libc works as root (Python 3.11 has no
``os.unshare``), and the child then sees only ``lo``; setuid to an unused uid works, which is what
makes RLIMIT_NPROC bite (root ignores it) and keeps the code out of root's files. Not root: no
namespace and no uid change; the audit hook still blocks Python-level network calls (a program
using ctypes could bypass it), RLIMIT_NPROC counts all of the user's processes, and a descendant
that leaves the process group survives. Use a container for untrusted code at scale.

Status table: ok (exit 0) | error (non-zero exit, e.g. an exception; a fork bomb whose fork fails
with EAGAIN) | timeout (wall-clock limit, or CPU limit -> SIGXCPU) | memory (MemoryError under
RLIMIT_AS) | network_blocked (the audit hook stopped a network call) | killed (any other signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

NET_EXIT = 86
MEM_EXIT = 87
_UID_BASE = 1_000_000  # sandbox uids: _UID_BASE + pid * 64 + n, never a real account
_counter = itertools.count()

Status = Literal["ok", "timeout", "memory", "killed", "error", "network_blocked"]

# Imported before the uid drop: the interpreter may live under a directory the sandbox uid cannot
# read (here /root/.pyenv), so lazy imports of these would fail afterwards.
PRELOAD = (
    "math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "re", "string",
    "json", "random", "fractions", "decimal", "statistics", "operator", "typing", "dataclasses",
    "traceback", "linecache", "copy", "io", "array", "enum", "socket", "encodings.idna",
)  # fmt: skip

_BOOTSTRAP = r"""
import os, sys, resource, json
cfg = json.loads(sys.argv[1])
if cfg["unshare_net"]:
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
            pass
    except Exception:
        pass
for m in cfg["preload"]:
    try:
        __import__(m)
    except ImportError:
        pass
R = resource
R.setrlimit(R.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
for r, v in ((R.RLIMIT_AS, cfg["mem"]), (R.RLIMIT_FSIZE, cfg["fsize"]), (R.RLIMIT_NOFILE, cfg["nofile"]),
             (R.RLIMIT_NPROC, cfg["nproc"]), (R.RLIMIT_CORE, 0)):
    R.setrlimit(r, (v, v))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
NET = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
       "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
def _hook(event, args, _w=os.write, _x=os._exit):
    if event in NET:
        _w(2, ("\nsandbox: network access blocked (" + event + ")\n").encode())
        _x(86)
sys.addaudithook(_hook)
del cfg, R, m
src = open("main.py", encoding="utf-8").read()
try:
    exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except MemoryError:
    os.write(2, b"\nMemoryError\n")
    os._exit(87)
"""


class SandboxLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Limits of one sandboxed run."""

    wall_s: Annotated[float, Meta(gt=0, le=3600, description="wall-clock limit; past it the process group is killed")] = 5.0
    cpu_s: Annotated[int, Meta(ge=1, le=3600, description="CPU seconds (RLIMIT_CPU)")] = 2
    memory_mb: Annotated[int, Meta(ge=32, le=65536, description="address space in MiB (RLIMIT_AS)")] = 256
    nproc: Annotated[int, Meta(ge=1, le=4096, description="processes of the sandbox uid (RLIMIT_NPROC)")] = 8
    fsize_mb: Annotated[int, Meta(ge=0, le=4096, description="largest file the code may write, MiB (RLIMIT_FSIZE)")] = 8
    nofile: Annotated[int, Meta(ge=8, le=4096, description="open file descriptors (RLIMIT_NOFILE)")] = 64
    max_output_chars: Annotated[int, Meta(ge=0, description="stdout/stderr kept (the rest is read and dropped)")] = 65536
    unshare_net: Annotated[bool, Meta(description="try a private network namespace (needs root)")] = True
    drop_privileges: Annotated[bool, Meta(description="as root, run the code under a fresh unprivileged uid")] = True


class SandboxResult(msgspec.Struct, kw_only=True, frozen=True):
    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float


def _sandbox_uid() -> int | None:
    return _UID_BASE + os.getpid() * 64 + next(_counter) % 64 if os.geteuid() == 0 else None


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

    Raises OSError only when the sandbox itself cannot start (no temp dir, no interpreter).
    """
    lim = limits or SandboxLimits()
    loop = asyncio.get_running_loop()
    uid = _sandbox_uid() if lim.drop_privileges else None
    tmp = await asyncio.to_thread(_prepare_dir, code, uid)
    try:
        cfg = {
            "cpu": lim.cpu_s, "mem": lim.memory_mb << 20, "fsize": lim.fsize_mb << 20, "nofile": lim.nofile,
            "nproc": lim.nproc, "uid": uid, "unshare_net": lim.unshare_net, "preload": PRELOAD if uid is not None else [],
        }  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        start = loop.time()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=tmp, env=env, start_new_session=True,
        )  # fmt: skip
        out: list[bytes] = []
        err: list[bytes] = []
        io = [
            asyncio.ensure_future(_feed(proc.stdin, stdin.encode())),
            asyncio.ensure_future(_drain(proc.stdout, lim.max_output_chars, out)),
            asyncio.ensure_future(_drain(proc.stderr, lim.max_output_chars, err)),
        ]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), lim.wall_s)
        except (TimeoutError, asyncio.TimeoutError):
            timed_out = True
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
            for t in pending:  # a descendant outside our reach still holds a pipe (not root)
                t.cancel()
            await asyncio.gather(*io, return_exceptions=True)
        seconds = loop.time() - start
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    stdout = b"".join(out).decode("utf-8", "replace")
    stderr = b"".join(err).decode("utf-8", "replace")
    return SandboxResult(
        status=_status(proc.returncode, timed_out, stderr),
        stdout=stdout,
        stderr=stderr,
        exit_code=proc.returncode,
        seconds=seconds,
    )
