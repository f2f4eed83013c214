"""flashrl/wire/rendezvous.py, the parts that need no socket: which addresses are loopback.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_rendezvous_process.py."""

from __future__ import annotations

from flashrl.wire.rendezvous import is_loopback


def test_is_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.1.2.3", "node7", "::"]))
