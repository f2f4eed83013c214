"""flashrl/wire/rendezvous.py: torch.distributed stores and gloo sockets listen on the master address only.

torch's own TCPStore master listens on every interface; these tests look at the listening sockets
(psutil) of a store, the weight-sync group and a real 2-process default group.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from flashrl.wire.rendezvous import master_store
from flashrl.wire.transport import free_port
from flashrl.wire.weights import join_group

ROOT = Path(__file__).resolve().parents[2]
T = datetime.timedelta(seconds=20)
WILDCARD = {"0.0.0.0", "::"}


def _listening(pid: int | None = None) -> set[tuple[str, int]]:
    proc = psutil.Process(pid)
    return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def test_store_listens_on_its_host_only_unlike_torchs_default() -> None:
    port = free_port()
    plain = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=T, wait_for_workers=False)
    # the problem: torch binds the wildcard address whatever host_name says
    assert {ip for ip, p in _listening() if p == port} & WILDCARD
    del plain
    port = free_port()
    store = master_store("127.0.0.1", port, 2, T)
    assert {ip for ip, p in _listening() if p == port} == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=T)
    store.set("k", "v")
    assert client.get("k") == b"v"
    with pytest.raises(OSError, match="cannot listen on 127.0.0.1"):  # the port is taken: a named error
        master_store("127.0.0.1", port, 2, T)


def test_weight_sync_group_listens_on_loopback() -> None:
    before = _listening()
    port = free_port()
    group = join_group("127.0.0.1", port, 0, 1, "gloo", 20)
    new = _listening() - before
    assert ("127.0.0.1", port) in new  # the store
    assert len(new) >= 2 and {ip for ip, _ in new} == {"127.0.0.1"}  # and the gloo device
    t = torch.arange(4.0)
    group.broadcast(t, 0).wait()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


RANK_SCRIPT = """
import datetime, json, os, psutil, torch.distributed as dist
from flashrl.wire.rendezvous import init_default_group
init_default_group("gloo", int(os.environ["RANK"]), 2, datetime.timedelta(seconds=60))
dist.barrier()
ls = [[c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
print(json.dumps(ls), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_trainer_default_group_listens_on_loopback() -> None:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-2000:]
            outs.append({(ip, int(pt)) for ip, pt in json.loads(out.strip().splitlines()[-1])})
    finally:
        for p in procs:
            p.kill()
    assert ("127.0.0.1", port) in outs[0]  # rank 0 hosts the store
    for listening in outs:
        assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening


def test_a_member_asked_before_the_master_listens_connects_once_it_does() -> None:
    """group_store waits for the master's listener itself (wait_listening) before TCPStore connects, and
    its probe connection does not disturb the store; nothing listening -> False at the deadline."""
    import threading
    import time

    from flashrl.wire.rendezvous import group_store, wait_listening

    port = free_port()
    assert wait_listening("127.0.0.1", port, datetime.timedelta(seconds=0.1)) is False  # nothing there: a deadline
    got: dict[str, object] = {}

    def member() -> None:
        try:
            s = group_store("127.0.0.1", port, 1, 2, T)
            got["value"] = s.get("k")
        except Exception as e:  # reported below
            got["error"] = e

    t = threading.Thread(target=member)
    t.start()
    time.sleep(0.2)  # the member is already waiting: nothing listens yet
    assert t.is_alive()
    master = group_store("127.0.0.1", port, 0, 2, T)
    master.set("k", "v")
    t.join(timeout=20)
    assert not t.is_alive() and got == {"value": b"v"}
