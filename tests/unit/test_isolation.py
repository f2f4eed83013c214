"""The unit suite's own rule (tests/unit/conftest.py, tests/isolation.py): every way to start a process or
open a network socket is refused here with the message that says where the test belongs, and a refusal
the test swallows is still recorded (the conftest fails such a test after it ran)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tests.isolation import MESSAGE, UnitRuleError
from tests.unit import conftest


@pytest.fixture
def refusals() -> Iterator[list[str]]:
    """The refusals recorded during the test, cleared afterwards: here they are expected, not a failure."""
    yield conftest._refused
    conftest._refused.clear()


def _zmq_socket() -> None:
    import zmq

    ctx = zmq.Context()
    try:
        ctx.socket(zmq.PAIR)
    finally:
        ctx.term()


def _process_group() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29999", rank=0, world_size=1)


CASES: dict[str, Callable[[], object]] = {
    "subprocess": lambda: subprocess.run(["true"], check=True),
    "posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
    "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=int).start(),
    "tcp socket": lambda: socket.socket(),
    "tcp6 socket": lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM),
    "unix socket": lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM),
    "create_connection": lambda: socket.create_connection(("127.0.0.1", 9), timeout=1),
    "zmq socket": _zmq_socket,
    "torch.distributed group": _process_group,
}


@pytest.mark.parametrize("case", CASES)
def test_a_process_or_socket_is_refused_with_where_the_test_belongs(case: str, refusals: list[str]) -> None:
    with pytest.raises(UnitRuleError) as e:
        CASES[case]()
    assert str(e.value).startswith(MESSAGE) and "tests/integration" in str(e.value)
    assert len(refusals) == 1  # recorded even if the test had caught it


async def test_socketpairs_and_the_event_loop_still_work() -> None:
    a, b = socket.socketpair()  # what asyncio's loop builds for itself: no network, no new process
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    assert await asyncio.wait_for(asyncio.sleep(0, "ok"), 5) == "ok"
