"""What CURVE costs on flashrl's ZeroMQ channels: ipc:// (loopback default) vs plain TCP on 127.0.0.1 vs
TCP + CURVE + ZAP on this machine's non-loopback address (what cluster.interface = IP uses).

One process, server and client on one event loop (the real ones are two processes: this measures the
per-message cost of each transport, not a network). Variants are interleaved over rounds and the median
of the rounds is reported, with each variant's ratio to ipc:// measured in the same run.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/transport_curve.py --rounds 5
    -> bench/results/transport/curve.json and curve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

from flashrl.launch.base import primary_address
from flashrl.wire import protocol as P
from flashrl.wire.keys import CurveKeys
from flashrl.wire.transport import RpcClient, RpcServer, free_port, local_address

OUT = Path(__file__).resolve().parent / "results" / "transport"


async def _echo(msg: P.Msg) -> P.Msg | None:
    if isinstance(msg, P.Ping):
        return P.Pong(version=1)
    assert isinstance(msg, P.Generate)
    return P.Generated(request_id=msg.request_id, token_ids=msg.prompt_ids)


async def one(address: str, curve: CurveKeys | None, pings: int, burst: int, tokens: int) -> tuple[float, float]:
    """(sequential Ping round trip in us, per-request time of ``burst`` concurrent ``tokens``-token echoes in us)."""
    server = RpcServer(address, P.ENGINE_REQUESTS, _echo, name="bench", curve=curve.server() if curve else None)
    task = asyncio.create_task(server.serve())
    client = RpcClient(address, P.ENGINE_REPLIES, name="bench", curve=curve.client() if curve else None)
    try:
        await client.request(P.Ping(), timeout=30)
        t0 = time.perf_counter()
        for _ in range(pings):
            await client.request(P.Ping(), timeout=30)
        rtt = (time.perf_counter() - t0) / pings * 1e6
        prompt = list(range(tokens))
        t0 = time.perf_counter()
        await asyncio.gather(*(client.request(P.Generate(request_id=str(i), prompt_ids=prompt), timeout=60)
                               for i in range(burst)))
        per = (time.perf_counter() - t0) / burst * 1e6
        return rtt, per
    finally:
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def main(rounds: int, pings: int, burst: int, tokens: int) -> dict[str, object]:
    ip = primary_address()
    keys = CurveKeys.new()
    variants = {
        "ipc": lambda: (local_address("bench"), None),
        "tcp 127.0.0.1": lambda: (f"tcp://127.0.0.1:{free_port()}", None),
        "tcp IP + CURVE": lambda: (f"tcp://{ip}:{free_port(ip)}", keys),
    }
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            addr, curve = make()
            got[name].append(await one(addr, curve, pings, burst, tokens))
    rows = {}
    base_rtt = statistics.median(r for r, _ in got["ipc"])
    base_per = statistics.median(p for _, p in got["ipc"])
    for name, xs in got.items():
        rtt, per = statistics.median(r for r, _ in xs), statistics.median(p for _, p in xs)
        rows[name] = {"ping_rtt_us": round(rtt, 1), "burst_us_per_request": round(per, 1),
                      "rtt_vs_ipc": round(rtt / base_rtt, 2), "burst_vs_ipc": round(per / base_per, 2),
                      "rounds": [[round(r, 1), round(p, 1)] for r, p in xs]}
    return {"rounds": rounds, "pings": pings, "burst": burst, "tokens": tokens, "address": ip,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average_1min_after": round(os.getloadavg()[0], 1), "results": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=2000)
    a = ap.parse_args()
    res = asyncio.run(main(a.rounds, a.pings, a.burst, a.tokens))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "curve.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"# ZeroMQ transport: ipc vs TCP vs TCP + CURVE ({a.rounds} interleaved rounds, medians)", "",
             f"{a.pings} sequential Pings; a burst of {a.burst} concurrent {a.tokens}-token Generate echoes. One "
             "process, one event loop (per-message cost, not a network). "
             f"{res['cpus']} CPUs shared with other jobs (1-min load average {res['load_average_1min_after']} "
             "at the end): single rounds vary 2-5x, compare the medians' ratios only.", "",
             "| transport | Ping round trip (us) | x ipc | burst (us per request) | x ipc |", "|---|---|---|---|---|"]
    for name, r in res["results"].items():  # type: ignore[attr-defined]
        lines.append(f"| {name} | {r['ping_rtt_us']} | {r['rtt_vs_ipc']} | {r['burst_us_per_request']} | {r['burst_vs_ipc']} |")
    (OUT / "curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
