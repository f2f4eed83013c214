"""The learning-rate schedule: a pure function of the training step (the trainer sets it; a resume reads it).

``trainer.warmup_steps`` ramps the lr up; ``trainer.lr_decay`` then decays it to lr * ``min_lr_ratio`` at
the run's last step (``run.steps``). The trainer sets its optimizer's lr from the batch's step every
step (not from scheduler state), so a resumed run continues the schedule where its checkpoint left it.
"""

from __future__ import annotations

import math
from typing import Protocol


class LrSettings(Protocol):
    """What the schedule reads: ``[trainer]`` (``flashrl.config.TrainerConfig``) has these keys."""

    @property
    def lr(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def lr_decay(self) -> str: ...  # "none" | "linear" | "cosine"
    @property
    def min_lr_ratio(self) -> float: ...


def warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """``trainer.warmup_steps``: training step ``step`` (from 0) uses lr * min(1, (step + 1) / warmup_steps).

    A fresh AdamW's first updates on a warm-started model are large relative to its noisy early
    gradients; ramping the lr keeps the first RL steps from undoing the warm-start."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else lr


def scheduled_lr(tc: LrSettings, total_steps: int, step: int) -> float:
    """The lr of training step ``step`` (from 0) of ``total_steps``: the warm-up (``warmup_lr``), then
    ``trainer.lr_decay`` from lr at the warm-up's last step to lr * ``min_lr_ratio`` at the last step
    (linear, or cosine: half a cosine period). A function of the step alone, so a resumed run continues it.

    Decay settles the policy at the end of a run: with a constant lr, the last updates move it as much
    as the first, and a run's final accuracy is a draw from its plateau's noise."""
    lr = warmup_lr(tc.lr, tc.warmup_steps, step)
    if tc.lr_decay == "none":
        return lr
    start = max(tc.warmup_steps, 1) - 1
    p = min(1.0, max(0.0, (step - start) / max(1, total_steps - 1 - start)))
    shape = 1.0 - p if tc.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return lr * (tc.min_lr_ratio + (1.0 - tc.min_lr_ratio) * shape)
