"""The instant parts (flashrl/sim/instant.py) and the overhead bench built on them.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_sim_instant.py."""

from __future__ import annotations

import pytest

from flashrl.bench.overhead import (
    controller_rate,
    zmq_rate,
)


def test_controller_rate_end_to_end_over_zeromq() -> None:
    """The controller against instant-engine server processes over ZeroMQ: the overhead a real run pays."""
    r = controller_rate(8, 4, 3, 4, transport="zmq", servers=2)
    assert r["trained"] == 8 * 4 * 4 and r["trained"] <= r["generated"] <= r["trained"] + 2 * 32
    assert r["servers"] == 2
    assert r["generated_per_cpu_s"] == pytest.approx(r["generated"] / r["cpu_s"])
    assert r["controller_us_per_generated"] == r["cpu_us_per_generated"]  # end to end: nothing subtracted
    assert "server_cpu_us_per_generated" in r  # /proc ticks (10 ms): too coarse to bound in a run this short


def test_zmq_rate_sequential_and_concurrent_inline() -> None:
    seq = zmq_rate(40, concurrency=1, server="inline")
    many = zmq_rate(80, concurrency=8, server="inline")
    for r, n, conc in ((seq, 40, 1), (many, 80, 8)):
        assert r["requests"] == n and r["concurrency"] == conc
        assert r["requests_per_s"] == pytest.approx(n / r["wall_s"])  # the rate of the timed requests only
        # a round trip through msgspec, ZeroMQ and asyncio costs microseconds of client CPU, not nothing;
        # and no Python client does a million of them a second (a wrong count or clock would show here)
        assert r["client_cpu_us_per_request"] >= 1.0 and r["requests_per_s"] < 1e6
    with pytest.raises(ValueError, match="concurrency"):
        zmq_rate(4, concurrency=8, server="inline")
