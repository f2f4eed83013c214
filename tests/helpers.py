"""Helpers several test modules share (process checks, an event-loop liveness probe, the trainer tests'
config and weights).

Fixtures live in conftest.py (the tiny model, a world-1 gloo group); plain functions here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

from flashrl.config import Config, from_dict


def first_json_line(path: Path, timeout: float, what: str = "report") -> dict[str, Any]:
    """The first line of ``path`` that starts with ``{``, parsed; waits for it up to ``timeout`` seconds
    (a child process writes its pids there once it runs)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("{"):
                return dict(json.loads(line))
        time.sleep(0.05)
    raise AssertionError(f"no {what} in {path}: {path.read_text() if path.exists() else '(missing)'}")


@contextlib.contextmanager
def killed_on_exit(proc: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """``proc`` (started with start_new_session=True); on the way out, if it still runs, its whole process group is
    SIGKILLed and reaped: a test that fails midway leaves nothing behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def process_gone(pid: int) -> bool:
    """Has process ``pid`` exited (a zombie counts as gone: it runs nothing)?"""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


class Ticks:
    """How many sleeps of one interval a task on the event loop completed (``ticking``)."""

    def __init__(self) -> None:
        self.count = 0


@contextlib.asynccontextmanager
async def ticking(interval_s: float) -> AsyncIterator[Ticks]:
    """``async with ticking(0.05) as ticks:`` counts, in ``ticks.count``, the ``interval_s`` sleeps a task on
    the running loop completes inside the block: work that blocks the event loop keeps the count low."""
    ticks = Ticks()

    async def tick() -> None:
        while True:
            await asyncio.sleep(interval_s)
            ticks.count += 1

    task = asyncio.create_task(tick())
    try:
        yield ticks
    finally:
        task.cancel()


def trainer_config(tmp: Path, algorithm: dict[str, object] | None = None, **trainer: object) -> Config:
    """A gloo trainer's config for the in-process and rank-process trainer tests (output under ``tmp``): a
    constant lr from the first step (no warm-up, no decay, unlike the defaults) unless a test sets them."""
    return from_dict({
        "run": {"output_dir": str(tmp), "name": "t"},
        "trainer": {"backend": "gloo", "lr": 1e-3, "threads": 1, "warmup_steps": 0, "lr_decay": "none", **trainer},
        "algorithm": {"loss": "ppo", **(algorithm or {})},
    })


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """A copy of a trainer's full state dict (``Trainer.full_state_dict``)."""
    return {k: v.clone() for k, v in trainer.full_state_dict().items()}


def agent_port(nodes: int = 2) -> int:
    """A base port for SLURM node agents (node N's agent listens on base + N): free, with the next ``nodes`` - 1
    ports free too, and within cluster.slurm.port's bound (65000; free_port may pick above the kernel's
    ephemeral range, up to 65535)."""
    import socket

    from flashrl.wire.transport import free_port

    for _ in range(100):
        base = free_port()
        if base > 65000:
            continue
        try:
            for n in range(1, nodes):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", base + n))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {nodes} adjacent free ports at or below 65000")


def wait_while_running(what: str, cond: Any, proc: subprocess.Popen[Any], deadline_s: float) -> Any:
    """Poll ``cond()`` until it returns something true (returned), failing the test when ``proc`` ends first or
    ``deadline_s`` passes."""
    import pytest

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"no {what} within {deadline_s} s")


def engine_processes(pid: int, name: str) -> list[psutil.Process]:
    """The engine server processes under ``pid`` whose EngineSpec is named ``name`` (judge0, teacher-exact-0)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "flashrl.engine.server" in " ".join(k.cmdline()) and f'"name":"{name}"' in k.environ().get("FLASHRL_SPEC", ""):
                out.append(k)
        except psutil.Error:
            pass
    return out


@contextlib.contextmanager
def running_engine(log_dir: Path, model: Path, name: str, **spec: Any) -> Iterator[Any]:
    """A real engine process serving ``model`` (an EngineSpec with ``spec``) on a free port, ready; terminated when
    the block ends. Its log: ``log_dir/engine.log``."""
    from flashrl.engine.client import spawn_engine
    from flashrl.engine.server import EngineSpec
    from flashrl.wire.transport import free_port

    opts = EngineSpec(address=f"tcp://127.0.0.1:{free_port()}", model=str(model), name=name, **spec)
    ep = spawn_engine(opts, log_dir / "engine.log")
    try:
        asyncio.run(ep.wait_ready(600))
        yield ep
    finally:
        asyncio.run(ep.terminate(timeout=20))
