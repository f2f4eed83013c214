"""Trainer rank 0's end of the weight sync: joins the group as rank 0 and broadcasts the buckets.

The format, the checksums and the group (build_manifest, bucket_checksum, join_group, ...) are
flashrl/weightsync.py's, shared with the engine's end (engine/weights.py).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from flashrl.weightsync import group_device, join_group

log = logging.getLogger(__name__)


class WeightSender:
    """Trainer rank 0's end of the weight-sync group: broadcasts buckets from group rank 0."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._device = torch.device("cpu")
        self.backend = ""

    def init(self, master_addr: str, master_port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Host the group's store and join as rank 0 (blocks until every engine has joined)."""
        self._group = join_group(master_addr, master_port, 0, world_size, backend, timeout_s)
        self._device = group_device(backend)
        self.backend = backend
        log.info("weight sync: joined %s group of %d at %s:%d as rank 0", backend, world_size, master_addr, master_port)

    def send(self, buckets: list[torch.Tensor]) -> float:
        """Broadcast every bucket in manifest order; return the seconds it took.

        Blocks until each broadcast completes; engines must be receiving (UpdateWeights) concurrently.
        """
        if self._group is None:
            raise RuntimeError("WeightSender.send before init: send InitWeightSync to the trainer first")
        t0 = time.perf_counter()
        for flat in buckets:
            self._group.broadcast(flat.to(self._device), 0).wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._group is not None:
            # A stateless group is not registered with torch.distributed; dropping it releases it.
            self._group = None
