"""A teacher's vLLM engine processes (the pool of flashrl/engine/served.py): the policy's engine server serving the
teacher's weights, never synced, restarted when one dies.

    TeacherEngines.score(ids, start): the least-loaded live engine; Score -> Scored within timeout_s;
        its death (PeerDead), the deadline, a reply of the wrong length or with a non-finite or positive
        log-probability (garbage) -> TeacherEngineFailed(reason): retried by the scorer (client.py); a hung
        engine or one answering garbage is killed, and so restarted like a dead one (engine_recycled)
        the engine answered Error (vLLM refused this sequence: longer than the teacher's max_model_len)
                                        -> TeacherRefused: the same sequence would be refused again
        every engine down for good (teacher.max_restarts spent) -> TeacherDown: the run stops (exit 3)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from pathlib import Path
from typing import Any

from flashrl.distill.config import TeacherConfig
from flashrl.engine.served import ServedEngines
from flashrl.launch.base import Launcher
from flashrl.launch.local import LocalLauncher
from flashrl.wire.protocol import Score, Scored
from flashrl.wire.transport import PeerDead, RemoteError, TransportError

log = logging.getLogger("flashrl.distill")

__all__ = ["TeacherDown", "TeacherEngineFailed", "TeacherEngines", "TeacherRefused", "check_scored"]


class TeacherEngineFailed(Exception):
    """A scoring request failed for the engine's sake: ``reason`` is engine_died | engine_timeout | engine_error |
    garbage."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TeacherRefused(Exception):
    """The teacher refused this sequence for its input (its engine is healthy and would refuse it again)."""


class TeacherDown(RuntimeError):
    """Every engine of a teacher is down and none can come back (its max_restarts spent): no sample can be scored
    any more, and a sample is never trained without its teacher's scores, so the run stops, naming it."""


def check_scored(got: Scored, n: int, k: int) -> str:
    """What is wrong with a reply that should score ``n`` tokens (``k`` top tokens each), or "" when nothing is:
    a log-probability must be finite and <= 0 (a tiny positive rounding excess is tolerated)."""
    if len(got.logprobs) != n:
        return f"{len(got.logprobs)} log-probabilities for {n} tokens"
    bad = next((x for x in got.logprobs if not (math.isfinite(x) and x <= 1e-4)), None)
    if bad is not None:
        return f"a log-probability of {bad}"
    if k and (len(got.top_logprobs) != n or any(len(t) != k for t in got.top_logprobs)):
        return f"top-{k} lists of lengths {sorted({len(t) for t in got.top_logprobs})} for {n} tokens"
    return ""


class TeacherEngines(ServedEngines):
    """One teacher's engines; ``tc`` is its [[distill.teachers]] table, ``index0`` its first launcher index."""

    Down = TeacherDown

    def __init__(self, tc: TeacherConfig, model: str | Path, logs: Path, *, launcher: Launcher | None = None,
                 **kw: Any) -> None:
        """``launcher``: the run's, or None: a local launcher of this teacher's own (closed by ``aclose``)."""
        super().__init__(tc, model, logs, launcher=launcher or LocalLauncher(logs.parent), own_launcher=launcher is None,
                         **kw)
        self.tc = tc
        self.what = f"teacher {tc.name}"
        self.names = f"teacher-{tc.name}-"
        self.restarts_key = f"the teacher {tc.name}'s max_restarts"
        self._ids = itertools.count()

    async def score(self, ids: list[int], start: int) -> Scored:
        """The teacher's log-probability of ``ids[start:]`` (and its top_k there) from the least-loaded live engine."""
        try:
            i, ep = await self.live()
        except TimeoutError:
            raise TeacherEngineFailed("engine_died", f"no engine of {self.what} alive within startup_timeout_s = "
                                                     f"{self.tc.startup_timeout_s} s") from None
        req = Score(request_id=f"{self.names}{next(self._ids)}", token_ids=ids, start=start, top_k=self.tc.top_k)
        try:
            with self.busy.request(i):
                async with asyncio.timeout(self.tc.timeout_s):
                    got = await ep.client.score(req)
        except TimeoutError:
            self._recycle(i, ep, f"no scores within timeout_s = {self.tc.timeout_s} s")
            raise TeacherEngineFailed("engine_timeout", f"{self.what} engine {i} gave no scores within timeout_s = "
                                                        f"{self.tc.timeout_s} s") from None
        except PeerDead as e:
            raise TeacherEngineFailed("engine_died", f"{self.what} engine {i} died: {e}") from None
        except RemoteError as e:  # this request alone (the engine answered): asked again, it is refused again
            raise TeacherRefused(f"{self.what} engine {i} refused a sequence of {len(ids)} tokens (max_model_len "
                                 f"{self.max_model_len}): {e}") from None
        except TransportError as e:
            raise TeacherEngineFailed("engine_error", f"{self.what} engine {i} failed the request: {e}") from None
        wrong = check_scored(got, len(ids) - start, self.tc.top_k)
        if wrong:
            self._recycle(i, ep, f"garbage: {wrong}")
            raise TeacherEngineFailed("garbage", f"{self.what} engine {i} answered garbage: {wrong}")
        return got

    def _recycle(self, i: int, ep: Any, why: str) -> None:
        """A hung engine, or one whose answers are garbage, is killed: its watcher restarts it, like a dead one
        (max_restarts), and the requests on it fail over to the others at once."""
        proc = self.procs[i]
        if proc is not None and proc is ep and proc.alive:
            log.error("%s engine %d: %s; killing it (it is restarted)", self.what, i, why)
            self.counts["engine_recycled"] += 1
            proc.kill()
