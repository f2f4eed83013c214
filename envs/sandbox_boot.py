"""The sandbox's trusted bootstrap: run as ``python -I -S sandbox_boot.py CFG_JSON`` by envs/sandbox.py.

It runs in the child before any untrusted byte, with the standard library only, and either sets up
every layer the parent asked for or exits with SETUP_EXIT (88) and a message on stderr; the parent
turns that into an error, never a run without the isolation it promised. Layers, in order:

    unshare(CLONE_NEWNET)  private network namespace with a downed loopback   (root; "netns")
    setrlimit              CPU, AS, FSIZE, NOFILE, CORE=0; NPROC with a fresh uid only
    preload + setuid       import common stdlib modules, then drop to a fresh uid, no groups (root)
    no_new_privs           prctl(PR_SET_NO_NEW_PRIVS): required by both kernel filters below
    landlock               files: read-only under the Python runtime and system libraries, read-write
                           in the temp dir, nothing else (no /home, /etc, /work, /proc ...); TCP bind and
                           connect denied (ABI >= 4); signals and abstract UNIX sockets scoped to the
                           sandbox (ABI >= 6). Inherited by every descendant; cannot be undone.
    seccomp                socket() and io_uring -> EPERM; with "no_procs" also fork/vfork/clone of a
                           process (threads still work) -> EPERM, so no descendant can outlive the run
    audit hook             Python-level network calls exit 86 with a message (a clear status)
    "ready"                written on a pipe only the parent reads, then closed; then main.py runs

Landlock and seccomp need no privilege, which is what isolates a non-root sandbox: the audit hook
alone is not isolation (a child process or ctypes bypasses it).
"""

import ctypes
import json
import os
import resource
import sys
from typing import Any

SETUP_EXIT = 88
NET_EXIT = 86
MEM_EXIT = 87

# Linux syscall numbers per architecture, and the seccomp audit arch tag.
ARCHES: dict[str, dict[str, Any]] = {
    "x86_64": {"audit": 0xC000003E, "socket": 41, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
               "io_uring": (425, 426, 427)},
    "aarch64": {"audit": 0xC00000B7, "socket": 198, "fork": None, "vfork": None, "clone": 220, "clone3": 435,
                "io_uring": (425, 426, 427)},
}  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def fail(layer: str, detail: str) -> None:
    os.write(2, f"\nsandbox setup failed: {layer}: {detail}\n".encode())
    os._exit(SETUP_EXIT)


def errno_text() -> str:
    e = ctypes.get_errno()
    return f"{os.strerror(e)} (errno {e})"


# ----------------------------------------------------------------------------- landlock
_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446  # the same numbers on x86_64 and aarch64
_FS_EXECUTE, _FS_WRITE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    v = _libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(v), 0)


def landlock(abi: int, read_only: list[str], read_write: list[str], devices: list[str]) -> None:
    fs_all = (1 << 13) - 1  # ABI 1: execute .. make_sym
    file_rights = _FS_EXECUTE | _FS_WRITE | _FS_READ_FILE  # the rights a rule on a file (not a dir) may hold
    if abi >= 2:
        fs_all |= _FS_REFER
    if abi >= 3:
        fs_all |= _FS_TRUNCATE
        file_rights |= _FS_TRUNCATE
    if abi >= 5:
        fs_all |= _FS_IOCTL_DEV
        file_rights |= _FS_IOCTL_DEV
    attr = _RulesetAttr(fs=fs_all, net=0b11 if abi >= 4 else 0, scoped=0b11 if abi >= 6 else 0)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    fd = _libc.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        fail("landlock", f"landlock_create_ruleset: {errno_text()}")
    rules = [(p, _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR) for p in read_only]
    rules += [(p, fs_all) for p in read_write]
    rules += [(p, _FS_READ_FILE | _FS_WRITE) for p in devices]
    for path, allowed in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this machine does not have
        if not os.path.isdir(path):
            allowed &= file_rights
        rule = _PathBeneath(allowed=allowed, fd=pfd)
        if _libc.syscall(_LL_ADD, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            fail("landlock", f"landlock_add_rule({path}): {errno_text()}")
        os.close(pfd)
    if _libc.syscall(_LL_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        fail("landlock", f"landlock_restrict_self: {errno_text()}")
    os.close(fd)


# ----------------------------------------------------------------------------- seccomp
class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
_ALLOW, _KILL = 0x7FFF0000, 0x80000000
_EPERM, _ENOSYS = 0x00050000 | 1, 0x00050000 | 38
_CLONE_THREAD = 0x00010000


def seccomp_program(arch: dict, no_procs: bool) -> list[tuple[int, int, int, int]]:
    """BPF: other architectures (and x32) are killed; sockets and io_uring fail; with ``no_procs`` new
    processes fail too (clone without CLONE_THREAD; clone3 answers ENOSYS so libc falls back to clone)."""
    prog = [(_LD, 0, 0, 4), (_JEQ, 1, 0, arch["audit"]), (_RET, 0, 0, _KILL), (_LD, 0, 0, 0)]
    if arch["audit"] == ARCHES["x86_64"]["audit"]:
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _KILL)]  # x32 syscall numbers
    denied = [arch["socket"], *arch["io_uring"]]
    if no_procs:
        denied += [n for n in (arch["fork"], arch["vfork"]) if n is not None]
    for nr in denied:
        prog += [(_JEQ, 0, 1, nr), (_RET, 0, 0, _EPERM)]
    if no_procs:
        prog += [(_JEQ, 0, 1, arch["clone3"]), (_RET, 0, 0, _ENOSYS)]
        prog += [(_JEQ, 0, 3, arch["clone"]), (_LD, 0, 0, 16), (_JSET, 1, 0, _CLONE_THREAD), (_RET, 0, 0, _EPERM)]
    prog.append((_RET, 0, 0, _ALLOW))
    return prog


def seccomp(arch: dict, no_procs: bool) -> None:
    prog = seccomp_program(arch, no_procs)
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    if _libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        fail("seccomp", errno_text())


# ----------------------------------------------------------------------------- the run
NET_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
              "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}


def setup(cfg: dict) -> None:
    if cfg["netns"]:
        if _libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            if cfg["netns"] == "required":
                fail("netns", f"unshare(CLONE_NEWNET): {errno_text()}")
    r = resource
    r.setrlimit(r.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    limits = [(r.RLIMIT_AS, cfg["mem"]), (r.RLIMIT_FSIZE, cfg["fsize"]), (r.RLIMIT_NOFILE, cfg["nofile"]),
              (r.RLIMIT_CORE, 0)]
    if cfg["nproc"] is not None:
        limits.append((r.RLIMIT_NPROC, cfg["nproc"]))
    for res, v in limits:
        r.setrlimit(res, (v, v))
    for name in cfg["preload"]:
        try:
            __import__(name)
        except ImportError:
            pass
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    if cfg["landlock"] or cfg["seccomp"]:
        if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            fail("no_new_privs", errno_text())
    if cfg["landlock"]:
        landlock(cfg["landlock"], cfg["read_only"], [os.getcwd()], cfg["devices"])
    if cfg["seccomp"]:
        seccomp(ARCHES[cfg["seccomp"]], cfg["no_procs"])

    def hook(event: str, args: tuple, _w=os.write, _x=os._exit) -> None:
        if event in NET_EVENTS:
            _w(2, ("\nsandbox: network access blocked (" + event + ")\n").encode())
            _x(NET_EXIT)

    sys.addaudithook(hook)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    setup(cfg)
    os.write(cfg["ready_fd"], b"ready")  # every layer is in place; the parent checks this
    os.close(cfg["ready_fd"])
    del cfg
    src = open("main.py", encoding="utf-8").read()
    try:
        exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        os.write(2, b"\nMemoryError\n")
        os._exit(MEM_EXIT)


if __name__ == "__main__":
    main()
