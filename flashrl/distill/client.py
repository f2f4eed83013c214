"""Teachers: a finished training rollout scored whole by the teacher its prompt names, retried, counted.

    Teachers.score(traj, meta) -> traj.teacher_logp (one per response token: the teacher's log-probability of each
                                  generated token, 0.0 on observation tokens), traj.teacher_top (top_k > 0),
                                  traj.teacher (its name), traj.teacher_s
        which teacher: meta[distill.teacher_key] (a dataset column), else the first [[distill.teachers]]
        the sequence: prompt_ids + response_ids, scored from the first response token (one Score request: vLLM's
                      prompt logprobs; the teacher sees exactly the tokens the student's context held)
        an engine that died / hung / answered garbage -> asked again, on a live (or restarted) engine, retries
                      times (teacher_retries, teacher_engine_<reason>), then TeacherFailed: the sample fails
                      (rollout/failed_teacher_<reason>) and is never trained with a signal it did not get
        a sequence the teacher refuses (TeacherRefused: longer than its max_model_len) -> TeacherFailed("refused")
                      at once (it would be refused again)
        a prompt naming no teacher of the run -> TeacherFailed("unknown"), said once with the names there are
        every engine of its teacher down for good -> TeacherDown: the run stops (exit 3, runs/<name>/failure.json)

``counters`` (the suite's counters' way: env/teacher_* in every step record, continued across a resume):
teacher_scored, teacher_tokens, teacher_retries, teacher_engine_<reason>, teacher_failed, teacher_refused,
teacher_unknown, teacher_busy_s (summed over engines), teacher_inflight (now), teacher_latency_ms (mean, this
process); and each teacher's engine counts as teacher_<name>_engine_died / _engine_restarts / _engines_started.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from flashrl.distill.config import DistillConfig
from flashrl.distill.engines import TeacherEngineFailed, TeacherRefused
from flashrl.wire.protocol import Scored
from flashrl.wire.trajectory import Trajectory

__all__ = ["TeacherFailed", "Teachers", "fill"]

log = logging.getLogger("flashrl.distill")


class TeacherFailed(Exception):
    """A sample's teacher scores could not be had: ``reason`` (engine_died, engine_timeout, engine_error, garbage,
    refused, unknown) names why; the sample fails, counted as rollout/failed_teacher_<reason>."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"teacher {reason}: {detail}")
        self.reason = reason


def fill(traj: Trajectory, got: Scored, name: str) -> None:
    """``got`` (one score per response token) into ``traj``: observation tokens (mask 0) get 0.0 and []."""
    mask = traj.loss_mask
    traj.teacher_logp = [lp if m else 0.0 for lp, m in zip(got.logprobs, mask)]
    traj.teacher_top = [list(t) if m else [] for t, m in zip(got.top_logprobs, mask)] if got.top_logprobs else []
    traj.teacher = name


class Teachers:
    """Every teacher of the run by name (``pools``: TeacherEngines, or stand-ins with score/start/aclose/counts/
    busy/pids: flashrl/distill/fake.py), the first the default."""

    def __init__(self, dc: DistillConfig, pools: Mapping[str, Any]) -> None:
        self.dc = dc
        self.pools = dict(pools)
        self.default = dc.teachers[0].name
        self.counts: Counter[str] = Counter()
        self.latency_s = 0.0
        self.retries = {t.name: t.retries for t in dc.teachers}

    @property
    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {f"teacher_{k}": v for k, v in self.counts.items()}
        for name, pool in self.pools.items():
            out.update({f"teacher_{name}_{k}": v for k, v in pool.counts.items()})
        out["teacher_busy_s"] = round(sum(p.busy.busy_s for p in self.pools.values()), 3)
        out["teacher_inflight"] = sum(sum(p.busy.inflight) for p in self.pools.values())
        if self.counts["scored"]:
            out["teacher_latency_ms"] = 1000 * self.latency_s / self.counts["scored"]
        return out

    def pids(self) -> list[int]:
        return [pid for p in self.pools.values() for pid in p.pids()]

    async def start(self) -> None:
        for pool in self.pools.values():
            await pool.start()

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in self.pools.values()), return_exceptions=True)

    async def score_or_reason(self, traj: Trajectory, meta: Mapping[str, Any]) -> str:
        """``score``, for the rollout: "" once ``traj`` is scored, else the reason its scores could not be had."""
        try:
            await self.score(traj, meta)
        except TeacherFailed as e:
            return e.reason
        return ""

    def name_of(self, meta: Mapping[str, Any]) -> str:
        return str(meta.get(self.dc.teacher_key, self.default))

    async def score(self, traj: Trajectory, meta: Mapping[str, Any]) -> None:
        """Fill ``traj``'s teacher fields (the module doc); raises TeacherFailed, or TeacherDown (final)."""
        clock = asyncio.get_running_loop().time
        t0 = clock()
        name = self.name_of(meta)
        pool = self.pools.get(name)
        if pool is None:
            self.counts["unknown"] += 1
            if self.counts["unknown"] == 1:
                log.error("distill: task %s names the teacher %r (Task.meta[%r]); this run's teachers are %s: the "
                          "sample fails (counted as env/teacher_unknown)", traj.task_id, name, self.dc.teacher_key,
                          sorted(self.pools))
            raise TeacherFailed("unknown", f"no teacher named {name!r}")
        got = await self._ask(pool, name, list(traj.prompt_ids) + list(traj.response_ids), len(traj.prompt_ids))
        fill(traj, got, name)
        traj.teacher_s = clock() - t0
        self.counts["scored"] += 1
        self.counts["tokens"] += traj.n_generated
        self.latency_s += traj.teacher_s

    async def _ask(self, pool: Any, name: str, ids: list[int], start: int) -> Scored:
        failure: TeacherEngineFailed | None = None
        retries = self.retries[name]
        for attempt in range(retries + 1):
            try:
                return await pool.score(ids, start)
            except TeacherRefused as e:
                self.counts["refused"] += 1
                if self.counts["refused"] == 1:
                    log.warning("distill: %s (the sample fails; counted as env/teacher_refused)", e)
                raise TeacherFailed("refused", str(e)) from None
            except TeacherEngineFailed as e:
                failure = e
                self.counts[f"engine_{e.reason}" if e.reason != "garbage" else "garbage"] += 1
                if attempt < retries:
                    self.counts["retries"] += 1
                    log.debug("distill: %s; scoring again (retry %d of %d)", e, attempt + 1, retries)
        assert failure is not None
        self.counts["failed"] += 1
        raise TeacherFailed(failure.reason, failure.detail)
