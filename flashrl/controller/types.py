"""Types the controller's parts share, in a module of their own so that none imports another for them.

    rollout.py ──Trajectory──> buffer.py (SampleBuffer.add) ──> controller (batches -> trainer)
                                                             ──> ledger.py (step records, samples.jsonl)
    publisher.py ──Published (under its lock)──> supervisor.py (a restarted engine's catch-up)

``Trajectory`` is one rollout: the record the buffer keeps, the checkpoint saves and the trainer
trains on, defined once in flashrl/wire/trajectory.py (its invariant is there) and re-exported here.

``Published`` is what every live engine holds. Invariant: ``manifest`` and ``version`` change only
under ``lock``, and only once every live engine has loaded that version; the lock also keeps a
restarted engine's catch-up from interleaving with a regular sync.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

from flashrl.wire.protocol import WeightManifest
from flashrl.wire.trajectory import Trajectory

__all__ = ["Published", "Trajectory", "metric_means"]


class Published:
    """The weights every live engine that takes requests holds: their version, and the newest manifest sent
    (None: version 0, the base model; what a restarted engine's catch-up sends, the trainer holds it).

    ``version`` is a lower bound on the version of any token generated from now on (the rollouts'
    ``RolloutContext.version``); the controller's own version runs ahead of it while a sync runs. With LoRA an
    engine may refuse a version and keep serving the one before: it is held back from new requests
    (Router.hold_back) until it loads a newer one, and ``version`` moves only if some live engine holds it, so
    ``manifest.version`` may then be ahead of ``version`` (publisher.py).
    """

    def __init__(self, version: int = 0) -> None:
        self.lock = asyncio.Lock()  # a regular sync and a restarted engine's catch-up never interleave
        self.manifest: WeightManifest | None = None
        self.version = version


def metric_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Mean of each per-trajectory metric (a reward function's extras) over the trajectories that have it."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for t in trajs:
        for k, v in t.metrics.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] += 1
    return {k: total / counts[k] for k, total in sums.items()}


def env_share(trajs: Sequence[Trajectory]) -> float:
    """The share of the trajectories' lifetimes (first start to end, summed) spent inside env.reset and
    env.step: how much of an agentic rollout waits for its environment (0.0 when none has a lifetime)."""
    life = sum(max(0.0, t.t_end - t.t_start) for t in trajs)
    return min(1.0, sum(t.env_s for t in trajs) / life) if life > 0 else 0.0
