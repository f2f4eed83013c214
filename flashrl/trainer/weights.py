"""Trainer rank 0's end of the weight sync: one group of two per engine, joined as rank 0; broadcasts the buckets.

The format, the checksums and the group (build_manifest, bucket_checksum, join_group, ...) are
flashrl/wire/weights.py's, shared with the engine's end (engine/weights.py).

Why a group per engine and not one group of all: a collective waits for every member, so in one
static group a dead engine would stall (then fail) every sync, and a restarted engine could never
rejoin (gloo and nccl groups cannot change members). With a group per engine, a sync never waits
on a dead engine, a restarted engine joins its own new group while the others train, and a catch-up
sync to one engine (``SendWeights(v, [peer])`` of the last published buckets) touches nobody else.
The cost: rank 0 sends the weights once per engine (N x the bytes, concurrently: N engines share
rank 0's link), where one broadcast over a tree or ring sends each byte over each link once. For a
few engines per trainer (and gloo on a host, or NVLink within a node) that is cheap: the tiny model's
sync is milliseconds; for many engines across nodes, a two-level scheme (one group per node with a
local relay) would bring back tree bandwidth and keep members independent between nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flashrl.wire.weights import group_device, join_group

log = logging.getLogger(__name__)

POLL_S = 0.001  # how often a send looks whether a peer it waits on was dropped


class WeightSender:
    """Trainer rank 0's end of the weight sync: one small group per engine, broadcast to all at once.

    Each engine has its own group of two (trainer rank 0 = group rank 0, the engine = rank 1), made
    with a fresh rendezvous port whenever that engine (re)starts. A dead or hung engine therefore
    fails only its own group: ``send`` issues every live group's broadcast of a bucket before it
    waits on any, reports the groups that failed (and forgets them), and finishes the others.
    ``join`` may run on another thread while ``send`` runs (a restarted engine joins mid-training).
    """

    def __init__(self) -> None:
        self._groups: dict[str, dist.ProcessGroupGloo | dist.ProcessGroupNCCL] = {}
        self._lock = threading.Lock()
        self._device = torch.device("cpu")
        self.backend = ""
        # Groups of dropped peers and the broadcasts left unfinished in them (``drop``), kept for the
        # process's life: releasing a group waits for its pending work (up to the group's timeout). One
        # entry per engine death: a handful per run.
        self._dropped: list[Any] = []
        self._left: list[Any] = []

    @property
    def peers(self) -> list[str]:
        with self._lock:
            return list(self._groups)

    def join(self, peer: str, master_addr: str, master_port: int, backend: str, timeout_s: float) -> None:
        """Host ``peer``'s group store and join as its rank 0 (blocks until the engine has joined).

        Replaces an earlier group of the same peer (the engine restarted)."""
        group = join_group(master_addr, master_port, 0, 2, backend, timeout_s)
        with self._lock:
            self._groups[peer] = group
            self._device = group_device(backend)
            self.backend = backend
        log.info("weight sync: %s joined (%s group of 2 at %s:%d)", peer, backend, master_addr, master_port)

    def drop(self, peer: str) -> bool:
        """``peer`` is dead (the controller says so): a send waiting on its group stops waiting at once
        (``send`` reports it failed) and the group is never used again. Any thread. Returns whether
        ``peer`` had a group.

        Why: a broadcast to a dead peer ends when gloo notices the closed connection, which it does at
        once for a killed process, but not always: a CI run once waited the group's whole timeout
        (300 s) on an engine SIGKILLed mid-sync, and a hung peer holds it the same way. The sync of
        every other engine waits on that send."""
        with self._lock:
            group = self._groups.pop(peer, None)
            if group is not None:
                self._dropped.append(group)
        if group is not None:
            log.warning("weight sync: %s dropped (its engine is dead); a send to it stops waiting", peer)
        return group is not None

    @property
    def stuck(self) -> int:
        """Broadcasts to dropped peers not ended yet (exit without waiting for them: see ``drop``)."""
        with self._lock:
            return sum(not w.is_completed() for w in self._left)

    def _wait(self, peer: str, group: Any, work: Any) -> str | None:
        """Wait for one peer's broadcast; None when it ended well, else why not. Polled, so that a
        ``drop`` of its peer (or a new group joined for it: the engine restarted) ends the wait."""
        while not work.is_completed():
            with self._lock:
                known = any(g is group for g in self._dropped)
                dropped = known or self._groups.get(peer) is not group  # (or replaced by a new join)
                if dropped:
                    if not known:
                        self._dropped.append(group)
                    self._left.append(work)
            if dropped:
                return "dropped: its engine is dead (the broadcast was left unfinished)"
            time.sleep(POLL_S)
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - a broken group fails its own peer only
            return f"{type(e).__name__}: {e}"
        return None

    def send(self, buckets: list[torch.Tensor], peers: Sequence[str] | None = None) -> tuple[float, dict[str, str]]:
        """Broadcast every bucket, in manifest order, to ``peers`` (None: every joined engine) at once.

        Returns (seconds, {peer: error}) for the peers that failed (not joined, died, timed out);
        a failed peer is forgotten (it must join again) and never holds up the others. The engines
        must be receiving (UpdateWeights) concurrently.
        """
        with self._lock:
            if not self._groups and peers is None:
                raise RuntimeError("WeightSender.send before any engine joined: send InitWeightSync to the trainer first")
            names = list(self._groups) if peers is None else list(peers)
            targets = {p: self._groups[p] for p in names if p in self._groups}
            device = self._device
        failed = {p: "not in the weight sync (no InitWeightSync since it started)" for p in names if p not in targets}
        t0 = time.perf_counter()
        for flat in buckets:
            data = flat.to(device)
            works: dict[str, Any] = {}
            for p, g in targets.items():  # issue every broadcast first: the groups transfer concurrently
                try:
                    works[p] = g.broadcast(data, 0)  # type: ignore[union-attr]  # Backend.broadcast: bound in C++, not in torch stubs
                except Exception as e:  # noqa: BLE001 - a broken group fails its own peer only
                    failed[p] = f"{type(e).__name__}: {e}"
            for p, w in works.items():
                if (why := self._wait(p, targets[p], w)) is not None:
                    failed[p] = why
            for p in failed:
                gone = targets.pop(p, None)
                if gone is not None:
                    log.error("weight sync to %s failed: %s", p, failed[p])
                    with self._lock:
                        if self._groups.get(p) is gone:  # not a group it joined again meanwhile
                            del self._groups[p]
        return time.perf_counter() - t0, failed

    def close(self) -> None:
        with self._lock:
            # Stateless groups are not registered with torch.distributed; dropping them releases them.
            # (Dropped groups with a broadcast still pending stay: releasing them would wait for it.)
            self._groups.clear()
