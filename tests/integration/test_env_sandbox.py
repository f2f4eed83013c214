"""envs/sandbox.py: each escape attempt ends with the right status, inside its limits."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest

import envs.sandbox as sandbox
from envs.sandbox import _UID_BASE, SandboxLimits, SandboxUnavailable, run_sandboxed
from tests.helpers import ticking

FAST = SandboxLimits(wall_s=1.5, cpu_s=1, memory_mb=256, nproc=8)
ROOT = os.geteuid() == 0


def _sandbox_processes() -> list[int]:
    """Live (non-zombie) processes of any sandbox uid."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
        except (OSError, ValueError):
            continue
        if int(fields["Uid"].split()[0]) >= _UID_BASE and not fields["State"].strip().startswith("Z"):
            pids.append(int(pid))
    return pids


async def test_ok_program_reads_stdin_in_a_clean_private_dir() -> None:
    code = "import os, math\nprint(input().upper(), math.isqrt(49))\nprint(os.getcwd())\nprint(sorted(os.environ))"
    r = await run_sandboxed(code, stdin="hello\n", limits=FAST)
    assert r.status == "ok" and r.exit_code == 0, r.stderr
    first, cwd, env = r.stdout.splitlines()
    assert first == "HELLO 7"
    assert "flashrl-sandbox-" in cwd and not await asyncio.to_thread(os.path.exists, cwd)  # removed afterwards
    assert env == "['HOME', 'LANG', 'PATH', 'TMPDIR']"


async def test_exception_is_error_with_traceback() -> None:
    r = await run_sandboxed("1/0", limits=FAST)
    assert r.status == "error" and r.exit_code == 1 and "ZeroDivisionError" in r.stderr


async def test_infinite_loop_hits_the_cpu_limit() -> None:
    r = await run_sandboxed("while True: pass", limits=FAST)
    assert r.status == "timeout" and r.seconds < FAST.wall_s + 1.0


async def test_sleeping_forever_hits_the_wall_clock_and_does_not_block_the_loop() -> None:
    async with ticking(0.05) as ticks:
        r = await run_sandboxed("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=0.5))
    assert r.status == "timeout" and 0.5 <= r.seconds < 3.0
    assert ticks.count >= 6  # the event loop kept running while the child slept


async def test_memory_bomb_is_memory() -> None:
    # Generous time limits: only the memory limit may end these (the machine is shared and busy).
    lim = SandboxLimits(wall_s=10.0, cpu_s=5, memory_mb=256)
    for code in ("x = bytearray(1 << 30)", "x = []\nwhile True: x.append(bytearray(5 * 10**7))"):
        r = await run_sandboxed(code, limits=lim)
        assert r.status == "memory" and "MemoryError" in r.stderr, (r.status, r.stderr[-300:])


@pytest.mark.parametrize(
    ("code", "statuses"),
    [
        ("import os\nwhile True: os.fork()", {"error"}),  # fork fails with EAGAIN: the bomb dies
        ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", {"timeout"}),  # it spins: killed
    ],
)
async def test_fork_bomb_is_contained(code: str, statuses: set[str]) -> None:
    r = await run_sandboxed(code, limits=FAST)
    assert r.status in statuses and r.seconds < FAST.wall_s + 2.0, (r.status, r.stderr[-300:])
    if ROOT:  # every process of the sandbox uid is gone
        assert "Resource temporarily unavailable" in r.stderr or r.status == "timeout"
        assert _sandbox_processes() == []


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\nexcept BaseException:\n    print('caught')",
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))",
    ],
)
async def test_network_attempt_is_blocked(code: str) -> None:
    r = await run_sandboxed(code, limits=FAST)
    assert r.status == "network_blocked" and r.exit_code == 86, r.stderr
    assert "caught" not in r.stdout  # the program cannot swallow the block


@pytest.mark.skipif(not ROOT, reason="network namespaces and uid changes need root")
async def test_root_isolation_namespace_and_uid() -> None:
    code = "import os\nprint(os.getuid())\nprint(open('/proc/net/dev').read())\nopen('/root/x', 'w')"
    r = await run_sandboxed(code, limits=FAST)
    assert r.status == "error" and "PermissionError" in r.stderr
    lines = r.stdout.splitlines()
    assert int(lines[0]) >= _UID_BASE
    interfaces = [ln.split(":")[0].strip() for ln in lines[3:] if ":" in ln]
    assert interfaces == ["lo"]  # the child's own network namespace


async def test_output_is_capped_and_file_size_limited() -> None:
    lim = SandboxLimits(wall_s=2.0, max_output_chars=1000, fsize_mb=1)
    r = await run_sandboxed("print('x' * 10**6)\nopen('f', 'w').write('y' * (2 << 20))", limits=lim)
    assert len(r.stdout) == 1000 and r.status == "error" and "File too large" in r.stderr


async def test_concurrent_runs() -> None:
    rs = await asyncio.gather(*[run_sandboxed(f"print({i} * 2)", limits=FAST) for i in range(6)])
    assert [r.stdout for r in rs] == [f"{i * 2}\n" for i in range(6)]


async def test_a_program_cannot_fake_a_setup_failure() -> None:
    code = "import os\nos.write(2, b'sandbox setup failed: landlock: x')\nos._exit(88)"
    r = await run_sandboxed(code, limits=FAST)  # no SandboxError: the bootstrap had reported ready
    assert r.status == "error" and r.exit_code == 88


async def test_no_isolation_is_refused_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    from envs import make_suite

    monkeypatch.setattr(sandbox, "kernel_support", lambda: (0, None))  # a kernel without Landlock/seccomp
    lim = SandboxLimits(wall_s=5.0, drop_privileges=False)  # and no root uid drop
    assert sandbox.isolation(lim) is None
    with pytest.raises(SandboxUnavailable, match="allow_unisolated = true"):
        await run_sandboxed("print(1)", limits=lim)
    with pytest.raises(ValueError, match=r"^env\.params\.limits\.allow_unisolated: no sandbox isolation"):
        make_suite("code", {"limits": {"drop_privileges": False}}, 0, 4)
    r = await run_sandboxed("print(1)", limits=msgspec.structs.replace(lim, allow_unisolated=True))
    assert r.status == "ok" and r.stdout == "1\n"


# The non-root path, run as `nobody` in a child process (CI runs as root): a correct answer earns
# reward 1, and a socket (through Python, ctypes or a child process), a world-readable file outside
# the temp dir, a grandchild process and a signal to another process are all refused.
NOBODY_SCRIPT = r"""
import asyncio, json, os, sys
from envs.code import CodeSuite, CodeParams
from envs.sandbox import SandboxLimits, isolation, run_sandboxed
from flashrl.env import Task
secret = sys.argv[1]
LIM = SandboxLimits(wall_s=10.0, cpu_s=5)
PROGRAMS = {
    "bind": "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\nprint('bound')",
    "ctypes_socket": "import ctypes\nprint(ctypes.CDLL(None).socket(2, 1, 0))",
    "read_outside": f"print(open({secret!r}).read())",
    "grandchild": "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\nprint('spawned')",
    "fork": "import os\nprint('forked', os.fork())",
    "signal": "import os\nos.kill(os.getppid(), 0)\nprint('signalled')",
    "threads_and_tmp": "import threading\nopen('x', 'w').write('y')\nt = threading.Thread(target=print, args=(open('x').read(),))\nt.start(); t.join()",
}
async def main():
    out = {"uid": os.geteuid(), "mode": isolation(LIM), "control": open(secret).read()}
    for name, code in PROGRAMS.items():
        r = await run_sandboxed(code, limits=LIM)
        out[name] = {"status": r.status, "stdout": r.stdout, "stderr": r.stderr[-300:]}
    suite = CodeSuite(CodeParams(tests=3, train_size=1, limits=LIM), eval_size=1)
    task = Task(id="t", prompt="Write f.\n", meta={"family": "add", "inputs": [[1], [2], [-5]], "expected": [4, 5, -2]})
    rewards = []
    for answer in ("def f(x):\n    return x + 3", "def f(x):\n    return x"):
        env = suite.make_env()
        await env.reset(task)
        rewards.append((await env.step(answer)).reward)
    out["rewards"] = rewards
    print(json.dumps(out))
asyncio.run(main())
"""


def _as_nobody() -> tuple[list[str], dict[str, str]] | None:
    """A command prefix running Python as `nobody` that can import envs and msgspec; None if impossible.

    The venv's interpreter may live where nobody cannot go (here /root/.pyenv): then the system Python
    of the same version runs the parent side, with this checkout and the venv's packages on its path."""
    if shutil.which("setpriv") is None:
        return None
    root = str(Path(__file__).resolve().parents[2])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{root}:{Path(msgspec.__file__).parents[1]}", "LANG": "C.UTF-8"}
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = "import subprocess, sys, envs.sandbox; subprocess.run([sys.executable, '-c', ''], check=True)"
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        if os.path.exists(exe):
            r = subprocess.run([*drop, exe, "-c", probe], env=env, cwd="/", capture_output=True, timeout=60)
            if r.returncode == 0:
                return [*drop, exe], env
    return None


def test_non_root_sandbox_isolates_and_rewards_correct_code() -> None:
    abi, seccomp = sandbox.kernel_support()
    if not abi or seccomp is None:  # then a non-root sandbox refuses to run (the test above)
        pytest.skip(f"this kernel lacks Landlock (ABI {abi}) or seccomp ({seccomp})")
    secret_dir = tempfile.mkdtemp(prefix="flashrl-secret-", dir="/tmp")
    try:
        os.chmod(secret_dir, 0o755)
        secret = os.path.join(secret_dir, "secret.txt")
        Path(secret).write_text("top secret")
        os.chmod(secret, 0o644)  # readable by any user: only the sandbox may keep the code from it
        if ROOT:
            cmd = _as_nobody()
            if cmd is None:
                pytest.skip("no Python interpreter that the user nobody can run here (setpriv missing?)")
            prefix, env = cmd
        else:
            prefix, env = [sys.executable], dict(os.environ)
        r = subprocess.run([*prefix, "-c", NOBODY_SCRIPT, secret], env=env, cwd="/", capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)
    assert out["uid"] != 0 and out["mode"] == "landlock"
    assert out["rewards"] == [1.0, 0.0]  # a correct answer earns its reward as non-root
    assert out["control"] == "top secret"  # nobody itself may read the file ...
    read = out["read_outside"]
    assert read["status"] == "error" and "PermissionError" in read["stderr"] and "secret" not in read["stdout"]
    assert out["bind"]["status"] == "network_blocked" and "bound" not in out["bind"]["stdout"]
    assert out["ctypes_socket"] == {"status": "ok", "stdout": "-1\n", "stderr": ""}  # past the audit hook: EPERM
    for name in ("grandchild", "fork", "signal"):
        res = out[name]
        assert res["status"] == "error" and "Operation not permitted" in res["stderr"], (name, res)
        assert res["stdout"] == "", (name, res)
    assert out["threads_and_tmp"] == {"status": "ok", "stdout": "y\n", "stderr": ""}


async def test_an_io_task_that_fails_ends_the_run_at_once_with_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O task's crash (here the stdout reader's) is not swallowed: the program is killed at once (not
    at its wall-clock limit, with a pipe nobody reads taken for its timeout) and run_sandboxed raises
    SandboxError naming the stream, caused by the task's error; nothing of the sandbox is left."""
    real = sandbox._drain
    calls: list[object] = []

    async def broken(stream: asyncio.StreamReader | None, keep: int, out: list[bytes]) -> None:
        calls.append(stream)
        if len(calls) == 1 and stream is not None:  # the first reader run_sandboxed starts: stdout's
            await stream.read(1)
            raise ValueError("reader bug")
        await real(stream, keep, out)

    monkeypatch.setattr(sandbox, "_drain", broken)
    lim = SandboxLimits(wall_s=30, cpu_s=30, memory_mb=256, nproc=8)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(sandbox.SandboxError, match=r"sandbox I/O failed: the program's stdout task raised "
                                                    r"ValueError: reader bug") as e:
        await run_sandboxed("import time\nprint('x', flush=True)\ntime.sleep(25)", limits=lim)
    assert asyncio.get_running_loop().time() - t0 < 10 and isinstance(e.value.__cause__, ValueError)
    assert not _sandbox_processes()
