"""A stand-in reward-model backend (``flashrl.rewardmodel.client.Scorer``) for tests and the simulator:
scores in-process with a function, and fails on demand the way a worker does.

    fake = FakeScorer(lambda text: float(text.endswith("46")), fail=["crash", "garbage"])
    client = RewardModelClient(fake, max_batch=8)      # the first two batches fail, then scores come

``fail``: the failures of the next batches, in order ("crash", "timeout", "garbage", "error"), each counted
the way ProcessScorer counts it (a crash or garbage "restarts" the worker: ``restarts`` grows). ``delay_s``:
each batch takes this long (virtual or real, whatever the loop's clock is). ``batches`` records every batch.
A text whose ``fn`` raises is refused alone, as the worker refuses it (why, a str, in its score's place).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from flashrl.rewardmodel.client import ScoreFailed

__all__ = ["FakeScorer"]


class FakeScorer:
    def __init__(self, fn: Callable[[str], float], *, fail: list[str] | None = None, delay_s: float = 0.0) -> None:
        self.fn = fn
        self.fail = list(fail or [])
        self.delay_s = delay_s
        self.batches: list[list[str]] = []
        self.restarts = 0
        self.closed = False

    @property
    def counters(self) -> dict[str, int]:
        return {"rm_workers_started": 1 + self.restarts}

    def pids(self) -> list[int]:
        return []

    async def start(self) -> None:
        pass

    async def score_batch(self, texts: list[str], timeout_s: float) -> list[float | str]:
        self.batches.append(list(texts))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            what = self.fail.pop(0)
            if what in ("crash", "garbage", "timeout"):
                self.restarts += 1
            raise ScoreFailed(what, f"fake {what}")
        return [self._one(t) for t in texts]

    def _one(self, text: str) -> float | str:
        try:
            return self.fn(text)
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    async def aclose(self) -> None:
        self.closed = True
