"""THE staleness rule: how far behind the trained weights a sample may be. Every user asks here.

Versions and steps: the engines generate with policy version v (the number of updates published);
train step s is the update that makes version s + 1, so the trainer holds version s while it
trains step s. A sample's ``version_start`` is the version of its first generated token (a
multi-turn sample, or one generated across a weight update, has later tokens at higher versions:
the first is the oldest).

    lag(step, version_start)   = step - version_start          (the staleness of a sample at a step)
    fresh(step, version_start) = lag <= async_ratio             (the bound: trainable at that step)

Users, all through one ``Staleness`` object per run (the controller's, shared):

    admission   capacity(batch_prompts) = (async_ratio + 1) * batch_prompts  (AReaL's rule: at most
                that many groups admitted and not yet trained; buffer.SampleBuffer.can_admit)
    buffer      take_batch(step) keeps a sample iff fresh(step, version_start); once it hands out
                the batch of step s it calls taken(s): no step before s + 1 takes a sample again
    early abort doomed(version_start): fresh at no step still to come (``next_step`` on), so a
                multi-turn rollout is cancelled instead of finished (controller/rollout.py)
    metrics     lag_stats(step, version_starts) -> (mean, max): the staleness/* of a step record

Evals and the bound: a held-out eval of version v holds the engines at v until it ends
(controller/publisher.py hold), so training rollouts meanwhile start at v too. Nothing here changes
for them: step s still takes only version_start >= oldest(s), so the trainer goes on for at most
async_ratio steps beyond v on samples of v and then waits, for samples of the version loaded when
the eval ends (that wait is the eval's ``time/eval_wait_s``). Admission slots stay bounded too: a
batch frees its slots only once a newer version is on the engines. Eval rollouts are never trained
and never watched for early abort.

Pure: no sockets, torch, tasks or clocks.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Staleness", "lag_stats"]


class Staleness:
    """The staleness bound of one run (``scheduler.async_ratio``) and the earliest step still to come."""

    __slots__ = ("async_ratio", "next_step")

    def __init__(self, async_ratio: int, next_step: int = 0) -> None:
        if async_ratio < 0:
            raise ValueError(f"scheduler.async_ratio must be >= 0, got {async_ratio}")
        self.async_ratio = async_ratio
        self.next_step = next_step  # earliest train step that may still take a sample

    def __repr__(self) -> str:
        return f"Staleness(async_ratio={self.async_ratio}, next_step={self.next_step})"

    @staticmethod
    def lag(step: int, version_start: int) -> int:
        """Versions the sample is behind the weights trained at ``step``."""
        return step - version_start

    def fresh(self, step: int, version_start: int) -> bool:
        """May a sample whose first token has ``version_start`` be trained at ``step``?"""
        return step - version_start <= self.async_ratio

    def oldest(self, step: int) -> int:
        """The smallest ``version_start`` still fresh at ``step`` (fresh iff version_start >= this)."""
        return step - self.async_ratio

    def doomed(self, version_start: int) -> bool:
        """Can such a sample never be trained, at any step from ``next_step`` on?"""
        return not self.fresh(self.next_step, version_start)

    def taken(self, step: int) -> None:
        """The batch of ``step`` was taken: only later steps take samples from now on."""
        if step + 1 > self.next_step:
            self.next_step = step + 1

    def capacity(self, batch_prompts: int) -> int:
        """Groups admitted and not yet trained, at most (the bound on admission)."""
        return (self.async_ratio + 1) * batch_prompts


def lag_stats(step: int, version_starts: Iterable[int]) -> tuple[float, int]:
    """(mean, max) staleness of the samples trained at ``step``; (0.0, 0) for none."""
    lags = [step - v for v in version_starts]
    if not lags:
        return 0.0, 0
    return sum(lags) / len(lags), max(lags)
