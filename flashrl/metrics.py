"""Run metrics: the live ``Snapshot`` the dashboard renders, and ``metrics.jsonl`` (one object per step).

    controller ---snapshot()---> Snapshot ---> dashboard.py (rich live view, or plain lines)
    controller ---log_step(d)--> MetricsWriter ---> runs/<name>/metrics.jsonl

Every step line has at least: step, reward/mean, time/step_s, staleness/mean; and eval/accuracy
whenever the held-out split was evaluated at that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec


class EngineStat(msgspec.Struct, kw_only=True):
    """One engine's line on the dashboard."""

    name: str
    inflight: int = 0
    busy_fraction: float = 0.0
    tokens_per_s: float = 0.0
    version: int = 0
    alive: bool = True


class Snapshot(msgspec.Struct, kw_only=True):
    """Everything a user reads on the dashboard, at one instant."""

    run_name: str = ""
    step: int = 0
    total_steps: int = 0
    version: int = 0
    elapsed_s: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    engines: list[EngineStat] = []
    # queue depths
    pending_prompts: int = 0  # admitted, not yet started
    running_samples: int = 0  # rollouts in flight
    buffered_groups: int = 0  # complete groups waiting for the trainer
    # last batch
    staleness_mean: float = 0.0
    staleness_max: int = 0
    reward_mean: float = 0.0
    weight_sync_s: float = 0.0
    step_s: float = 0.0
    # history for sparklines: (step, value)
    reward_history: list[tuple[int, float]] = []
    eval_history: list[tuple[int, float]] = []
    # counters: dropped / retried / failed rollouts and why (nothing is lost silently)
    counters: dict[str, int] = {}
    status: str = "starting"


class MetricsWriter:
    """Append one JSON object per line to ``path``; flushed per line so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a", buffering=1)
        self._enc = msgspec.json.Encoder()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(self._enc.encode(record).decode() + "\n")

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [msgspec.json.decode(line) for line in path.read_text().splitlines() if line.strip()]
