"""Types the controller's parts share, in a module of their own so that none imports another for them.

    rollout.py ──Trajectory──> buffer.py (SampleBuffer.add) ──> controller (batches -> trainer)
                                                             ──> ledger.py (step records, samples.jsonl)
    publisher.py ──Published (under its lock)──> supervisor.py (a restarted engine's catch-up)

``Trajectory`` is one rollout as the controller keeps it. Invariant: ``loss_mask``,
``behav_logp`` and ``versions`` have one entry per ``response_ids`` token (generated tokens:
mask 1, the engine's logprob and policy version; observation tokens: mask 0, 0.0, -1), so
``version_start`` (the staleness bound's input) is the version of the first generated token.

``Published`` is what every live engine holds. Invariant: ``manifest`` and ``version`` change only
under ``lock``, and only once every live engine has loaded that version; the lock also keeps a
restarted engine's catch-up from interleaving with a regular sync.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec

from flashrl.wire.protocol import TrainSample, WeightManifest

__all__ = ["Published", "Trajectory", "metric_means"]


class Trajectory(msgspec.Struct, kw_only=True):
    """One rollout as the controller keeps it: token ids, per-token data, outcome and timings."""

    sample_id: str
    group: int  # prompt uid (admission index); eval rollouts use -1 - task position
    index: int  # sample index inside the group (seeds, ordering)
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    loss_mask: list[int] = []
    behav_logp: list[float] = []
    versions: list[int] = []
    reward: float = 0.0
    correct: bool = False  # StepResult.info["correct"] when the env says, else reward >= 1
    finish_reason: str = ""  # engine's "stop"/"length", or "max_turns", "max_model_len"
    turns: int = 0
    status: Literal["ok", "failed"] = "ok"
    failure: str = ""  # counter name of the failure when status == "failed"
    engine: str = ""
    attempts: int = 1
    version_sent: int = 0  # controller version when the last attempt began
    t_start: float = 0.0
    t_end: float = 0.0
    gen_s: float = 0.0  # inside engine.generate
    env_s: float = 0.0  # inside env.reset / env.step
    wait_s: float = 0.0  # waiting for an engine permit
    task_id: str = ""
    metrics: dict[str, float] = {}  # StepResult.info["metrics"] (e.g. a reward function's extras), last value per key
    # Multi-turn chat trajectories (rollout._measure_template), -1 where not measured: tokens by which the
    # chat template's re-rendering of the finished conversation differs from prompt_ids + response_ids,
    # and tokens that decoding and re-encoding its generated turns alone would change.
    template_mismatch: int = -1
    retokenize_mismatch: int = -1

    @property
    def version_start(self) -> int:
        """Version of the first generated token (the staleness bound is on this)."""
        for m, v in zip(self.loss_mask, self.versions):
            if m:
                return v
        return self.version_sent

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)

    def generated_versions(self) -> list[int]:
        """The policy version of each generated token, in order (observation tokens left out)."""
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    def to_train_sample(self) -> TrainSample:
        return TrainSample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            behav_logp=self.behav_logp,
            versions=self.versions,
            reward=self.reward,
            group=self.group,
            sample_id=self.sample_id,
        )


class Published:
    """The weights every live engine holds: their manifest (None: version 0, the base model) and version.

    ``version`` is a lower bound on the version of any token generated from now on (the rollouts'
    ``RolloutContext.version``); the controller's own version runs ahead of it while a sync runs.
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
