"""The checkpoint cut: what a partial-mode checkpoint saves of the training rollouts in flight.

A partial-mode run that writes checkpoints keeps its unfinished rollouts with their tokens so far, so
that ``--resume`` continues them instead of generating them again. This object is the rollouts'
registry for that, owned by the controller beside the feed (feed.Feed.cut / snapshot / go_on); the
rollout code (rollout.py, group.py) only tells it what happens, at two points of a rollout's life,
and around each engine request:

    started(sid, uid, index, traj)   an attempt (re)starts: a cut saves ``traj`` for it (its tokens so
                                     far, a restored prefix, or None: nothing generated yet)
    settled(sid)                     its outcome went to its group, in the same synchronous step that
                                     hands the sample over (buffer.add) or holds it back (``hold``)
    hold(traj) / handed(sid)         launch order (rollout.redundant_keep): a finished sample that waits
                                     for an earlier-launched one, from the step it finished to the step
                                     its group hands it over or decides without it
    await request(rid, engine) ... ended(rid), checkin(rid)     each engine request of a training rollout

``cut()`` closes the gate (no training request starts), aborts every request in flight and waits (bounded)
until each has answered and its rollout folded the tokens so far into its Trajectory (``checkin``);
the caller reads ``rollouts`` and ``held`` in one synchronous step and ``go_on()`` reopens the gate.
Each interrupted rollout then asks for the rest of its turn (rollout._gen_turn), as after a weight update.

Invariant (tests/unit/test_cut.py checks it at random cuts over random groups): at every instant
between two awaits, each training sample of a group in flight is in exactly one of

    the buffer (handed over) | ``held`` (finished, waiting) | ``rollouts`` (running or not yet begun)

or in none because it will never be handed over (it failed, or its group decided without it). So a
checkpoint that saves the buffer's groups plus ``rollouts`` and ``held`` loses no sample and trains
none twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from flashrl.aio import shielded
from flashrl.controller.types import Trajectory
from flashrl.interfaces import EngineClient

__all__ = ["CheckpointCut"]

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on one abort message to an engine
CUT_TIMEOUT_S = 10.0  # bound on a cut's wait for the interrupted requests' answers
CUT_RETRY_S = 0.5  # a cut asks again for the requests that have not answered after this long


class CheckpointCut:
    """The registry of the training rollouts in flight and the gate of their requests (module docstring)."""

    def __init__(self, engines: Sequence[EngineClient], counters: Counter[str]) -> None:
        self.engines = engines
        self.counters = counters
        self.gate = asyncio.Event()  # set: training requests may start
        self.gate.set()
        # sample id -> (prompt uid, sample index, its attempt's Trajectory so far or its saved prefix or None)
        self.rollouts: dict[str, tuple[int, int, Trajectory | None]] = {}
        self.held: dict[str, Trajectory] = {}  # sample id -> finished, waiting for an earlier launch
        self.tracked: dict[str, int] = {}  # training request id -> engine, while it runs
        self.interrupts: dict[str, asyncio.Future[None]] = {}  # a cut's aborted requests, not answered yet

    # ------------------------------------------------------------------ what the rollouts tell it
    def started(self, sid: str, uid: int, index: int, traj: Trajectory | None) -> None:
        self.rollouts[sid] = (uid, index, traj)

    def settled(self, sid: str) -> None:
        self.rollouts.pop(sid, None)

    def hold(self, traj: Trajectory) -> None:
        self.held[traj.sample_id] = traj

    def handed(self, sid: str) -> None:
        self.held.pop(sid, None)

    async def request(self, rid: str, engine: int) -> None:
        """Before a training request is sent: wait while a cut is reading, then track it. The caller must
        send it without an await in between, so that a cut sees every request sent."""
        while not self.gate.is_set():
            await self.gate.wait()
        self.tracked[rid] = engine

    def ended(self, rid: str) -> None:
        self.tracked.pop(rid, None)

    def checkin(self, rid: str) -> bool:
        """A training request ended (answered or raised): True when a cut had interrupted it; the cut
        stops waiting for it (call once its tokens are in its Trajectory)."""
        fut = self.interrupts.pop(rid, None) if self.interrupts else None
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(None)
        return True

    # ------------------------------------------------------------------ the cut
    async def cut(self, timeout_s: float = CUT_TIMEOUT_S) -> int:
        """Stop every training rollout's generation at its current token: close the gate, abort each
        tracked request, wait (at most ``timeout_s``) until each answered and its tokens are in its
        Trajectory. Returns how many did not answer in time (their tokens since the request began are
        not in the cut). The gate stays closed until ``go_on()``."""
        self.gate.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        waits: dict[asyncio.Future[None], tuple[str, int]] = {}
        for rid, i in self.tracked.items():
            fut = loop.create_future()
            self.interrupts[rid] = fut
            waits[fut] = (rid, i)
        late = set(waits)
        while late:
            by_engine: dict[int, list[str]] = {}
            for fut in late:
                rid, i = waits[fut]
                by_engine.setdefault(i, []).append(rid)
            await asyncio.gather(*(self._abort(i, rids) for i, rids in by_engine.items()))
            left = deadline - loop.time()
            if left <= 0:
                break
            # asked again after CUT_RETRY_S: should an abort reach an engine before the request it names (an
            # engine need not order two messages of one tick), it found nothing to abort
            _, late = await asyncio.wait(late, timeout=min(CUT_RETRY_S, left))
        if late:
            self.counters["checkpoint/unsettled_rollouts"] += len(late)
            log.warning("checkpoint cut: %d of %d requests did not answer their abort within %.0f s; their tokens "
                        "since the previous cut are not saved", len(late), len(waits), timeout_s)
        return len(late)

    def go_on(self) -> None:
        """Reopen the gate after a cut: the interrupted rollouts continue from their tokens so far."""
        self.gate.set()

    async def _abort(self, i: int, rids: list[str]) -> None:
        try:
            await shielded(self.engines[i].abort(rids), ABORT_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dead engine answers its requests with PeerDead: they check in that way
            log.debug("checkpoint cut: abort on %s failed: %s", self.engines[i].name, e)
