"""envs/sandbox.py: each escape attempt ends with the right status, inside its limits."""

from __future__ import annotations

import asyncio
import os

import pytest

from envs.sandbox import _UID_BASE, SandboxLimits, run_sandboxed

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
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    t = asyncio.create_task(ticker())
    r = await run_sandboxed("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=0.5))
    t.cancel()
    assert r.status == "timeout" and 0.5 <= r.seconds < 3.0
    assert ticks >= 6  # the event loop kept running while the child slept


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
