"""ZeroMQ channels, the parts that need no socket: off loopback a channel needs CURVE.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_transport_process.py."""

from __future__ import annotations

import pytest

from flashrl.wire.transport import (
    TransportError,
    check_address,
)


def test_non_loopback_needs_curve() -> None:
    check_address("tcp://127.0.0.1:5555", curve_keys=False)
    check_address("ipc:///tmp/x", curve_keys=False)
    with pytest.raises(TransportError, match="not loopback: set transport CURVE keys"):
        check_address("tcp://10.1.2.3:5555", curve_keys=False)
    check_address("tcp://10.1.2.3:5555", curve_keys=True)
