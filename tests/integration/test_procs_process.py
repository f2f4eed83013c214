"""procs.py: the one child-process supervisor, with real processes (fast: plain python children)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashrl.procs import Child, exit_text, group_alive
from tests.helpers import first_json_line, process_gone

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))

# A supervised child: calls child_init, starts a grandchild (like vLLM's EngineCore), reports both pids.
CHILD = textwrap.dedent(
    """
    import json, signal, subprocess, sys, time
    from flashrl.procs import child_init
    child_init("test child")
    if sys.argv[1] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(json.dumps({"child": __import__("os").getpid(), "grand": grand.pid}), flush=True)
    time.sleep(600)
    """
)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = [p for p in pids if not process_gone(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if not process_gone(p)]


@pytest.mark.parametrize("mode", ["plain", "ignore-term"])
def test_stop_takes_the_whole_group_down(tmp_path: Path, mode: str) -> None:
    async def main() -> None:
        log = tmp_path / "child.log"
        child = Child.spawn("test child", [sys.executable, "-c", CHILD, mode], log, env=ENV)
        pids = await asyncio.to_thread(first_json_line, log, 20.0, "pids")
        assert os.getpgid(pids["grand"]) == child.pid  # the grandchild is in the child's group
        t0 = time.monotonic()
        code = await child.stop(grace_s=30.0, term_s=2.0, kill_s=5.0)
        took = time.monotonic() - t0
        assert not group_alive(child.pid)
        assert _wait_gone([pids["child"], pids["grand"]], 2.0) == []
        if mode == "plain":
            assert code == -signal.SIGTERM and took < 10.0  # no shutdown request: no grace, straight to SIGTERM
            assert "killed by SIGTERM" in child.describe()
        else:
            assert code == -signal.SIGKILL and 1.9 < took < 10.0  # SIGTERM ignored: SIGKILL after term_s
        assert str(log) in child.describe()

    asyncio.run(main())


def test_shutdown_request_gets_its_grace(tmp_path: Path) -> None:
    async def main() -> None:
        # Python's own SIGINT handler even when SIGINT reaches us ignored (a shell's background job, `cmd &`):
        # an ignored SIGINT is inherited, and Python then installs no KeyboardInterrupt handler.
        prog = ("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "print('up', flush=True); time.sleep(600)")
        child = Child.spawn("sleeper", [sys.executable, "-c", prog], tmp_path / "s.log")
        log = tmp_path / "s.log"
        for _ in range(200):  # Python is up (its SIGINT handler installed): a loaded machine starts it slowly
            if log.exists() and "up" in log.read_text():
                break
            await asyncio.sleep(0.05)
        asked: list[bool] = []

        async def shutdown() -> None:
            asked.append(True)
            os.kill(child.pid, signal.SIGINT)  # an orderly exit of its own (KeyboardInterrupt)

        code = await child.stop(grace_s=10.0, shutdown=shutdown)
        assert asked == [True] and code == -signal.SIGINT  # exited by itself within the grace: no TERM or KILL
        assert await child.stop() == -signal.SIGINT  # idempotent

    asyncio.run(main())


def test_exited_is_event_driven_and_describes_the_death(tmp_path: Path) -> None:
    async def main() -> None:
        child = Child.spawn("victim", [sys.executable, "-c", "print('hello from victim'); import time; time.sleep(600)"],
                            tmp_path / "v.log")
        waiter = asyncio.ensure_future(child.exited())
        log = tmp_path / "v.log"
        for _ in range(200):  # the child has started and printed (a loaded machine starts Python slowly)
            if log.exists() and "hello from victim" in log.read_text():
                break
            await asyncio.sleep(0.05)
        assert not waiter.done() and child.alive
        os.kill(child.pid, signal.SIGKILL)
        assert await asyncio.wait_for(waiter, 5.0) == -signal.SIGKILL
        text = child.describe()
        assert "victim" in text and "killed by SIGKILL" in text and "hello from victim" in text
        await child.stop()

    asyncio.run(main())
    assert exit_text(3) == "exited with code 3" and exit_text(None) == "is still running"


def test_dropped_child_is_killed_by_its_finalizer(tmp_path: Path) -> None:
    child = Child.spawn("dropped", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "d.log")
    proc = child.proc
    del child
    gc.collect()
    assert proc.wait(timeout=5) == -signal.SIGKILL


# A parent that supervises one CHILD, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import sys, time
    from flashrl.procs import Child
    c = Child.spawn("test child", [sys.executable, "-c", sys.argv[1], "plain"], sys.argv[2])
    print(c.pid, flush=True)
    time.sleep(600)
    """
)


def test_children_die_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """SIGKILL the parent: the child (parent-death signal + watchdog) and its grandchild exit on their own."""
    log = tmp_path / "child.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(log)], env=ENV, stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        pids = first_json_line(log, 20.0, "pids")
        parent.kill()
        parent.wait(timeout=5)
        t0 = time.monotonic()
        survivors = _wait_gone([pids["child"], pids["grand"]], 10.0)
        assert survivors == [], f"survived their parent: {survivors}"
        assert time.monotonic() - t0 < 5.0
        assert "parent process" in log.read_text() and "is gone" in log.read_text()
    finally:
        for pid in (parent.pid, *pids.values()) if "pids" in locals() else (parent.pid,):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_exit_now_flushes_logs_and_output_skips_the_teardown(tmp_path: Path) -> None:
    """A child ends with its code, its log and stdout complete, and no exit hook run (vLLM's engine
    shutdown is one: unfreeze + two full collections, seconds of the run's end)."""
    log, hook = tmp_path / "child.log", tmp_path / "hook"
    code = textwrap.dedent(f"""
        import atexit, logging, sys
        from pathlib import Path
        from flashrl.procs import exit_now
        logging.basicConfig(filename={str(log)!r}, level=logging.INFO)
        logging.info("last words")
        atexit.register(lambda: Path({str(hook)!r}).write_text("ran"))
        sys.stdout.write("unflushed")
        exit_now(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (3, "unflushed"), r.stderr
    assert "last words" in log.read_text()
    assert not hook.exists()
