"""Where flashrl's torch.distributed groups listen: the master address only, loopback locally.

torch's TCPStore master listens on every interface ("::", dual-stack) whatever ``host_name`` says,
and a gloo device binds to whatever the machine's hostname resolves to. The store has no
authentication: anyone who reaches it can join or disturb a group. So both groups flashrl creates
(the trainer's default process group, and the weight-sync group of trainer rank 0 + engines) use:

    master:  socket bound to (master_addr, port) -> TCPStore(master_listen_fd=...) (torch's documented
             hook: "the underlying TCPServer will listen on this file descriptor")
    others:  TCPStore client connecting to (master_addr, port)
    gloo:    a master address on loopback (the local launcher: 127.0.0.1) -> every member's gloo
             device on 127.0.0.1; otherwise the address's own interface is the user's choice
             (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, as torch documents for clusters)

On a cluster the master address is the trainer node's address on the cluster network (MASTER_ADDR,
InitWeightSync.master_addr): the store listens on that interface only. Under torchrun with its
agent store (TORCHELASTIC_USE_AGENT_STORE=True) the store belongs to torchrun, not to flashrl.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

LOOPBACK_IFNAME = "lo"


def master_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's TCPStore server, listening on ``host``:``port`` only (not every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=max(128, world_size))
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port} for the torch.distributed store: {e.strerror}") from e
    fd = sock.detach()  # the store's TCP server owns the listening socket from here
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def group_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store on ``host`` (``master_store``); the other ranks connect to it."""
    if rank == 0:
        return master_store(host, port, world_size, timeout)
    wait_listening(host, port, timeout)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def wait_listening(host: str, port: int, timeout: datetime.timedelta, poll_s: float = 0.01) -> bool:
    """Wait until ``host``:``port`` accepts a TCP connection (closed at once), at most ``timeout``.

    Members of a group are asked to join at the same moment, so one often connects a few milliseconds
    before the master listens; TCPStore's own client then backs off for ~0.3 s before it retries (that
    was half of every engine's join). Returns False at the deadline: TCPStore then raises its own error.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(poll_s, 1.0)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def is_loopback(host: str) -> bool:
    """transport.is_loopback, imported here on use: a trainer-only process (bench/ckpt_async.py) needs no pyzmq."""
    from flashrl.wire.transport import is_loopback as loopback

    return loopback(host)


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
               master_addr: str) -> dist.ProcessGroupGloo:
    """A gloo group whose own sockets bind to loopback when the master is local, else the default device."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs omit the options class
    opts._timeout = timeout
    if is_loopback(master_addr):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def init_default_group(backend: str, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` from torchrun's variables (MASTER_ADDR, MASTER_PORT), listening on
    MASTER_ADDR only; with a loopback master the gloo/NCCL sockets use the loopback interface."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if is_loopback(host) and LOOPBACK_IFNAME in {name for _, name in socket.if_nameindex()}:
        # the default group's gloo device (and NCCL's bootstrap) come from these; a user's setting wins
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    store = group_store(host, port, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
