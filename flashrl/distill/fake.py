"""A stand-in for TeacherEngines (unit tests): log-probabilities from a function of the sequence, and engine
failures ("engine_died", "engine_timeout", "engine_error", "garbage") and refusals ("refused") on demand, counted as
TeacherEngines counts them.

    fake = FakeTeacherEngines(lambda ids, start: [-0.5] * (len(ids) - start), fail=["engine_died"])
    teachers = Teachers(DistillConfig(teachers=[TeacherConfig(model="x")]), {"teacher": fake})
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from flashrl.aio import BusyTime
from flashrl.distill.engines import TeacherEngineFailed, TeacherRefused
from flashrl.wire.protocol import Scored

__all__ = ["FakeTeacherEngines"]


class FakeTeacherEngines:
    def __init__(self, fn: Callable[[list[int], int], list[float]], *, fail: list[str] | None = None) -> None:
        self.fn = fn
        self.fail = list(fail or [])
        self.counts: Counter[str] = Counter()
        self.busy = BusyTime(1)  # nothing counted: the fake answers at once
        self.requests: list[tuple[list[int], int]] = []  # (token ids, start)
        self.closed = False

    def pids(self) -> list[int]:
        return []

    async def start(self, wait: bool = False) -> None:
        self.counts["engines_started"] += 1

    async def score(self, ids: list[int], start: int) -> Scored:
        self.requests.append((list(ids), start))
        if self.fail:
            reason = self.fail.pop(0)
            if reason == "refused":  # the engine's Error reply for this request alone
                raise TeacherRefused(f"fake refusal of {len(ids)} tokens")
            if reason == "engine_died":
                self.counts["engine_died"] += 1
                self.counts["engine_restarts"] += 1
            raise TeacherEngineFailed(reason, f"fake {reason}")
        return Scored(logprobs=list(self.fn(list(ids), start)))

    async def aclose(self) -> None:
        self.closed = True
