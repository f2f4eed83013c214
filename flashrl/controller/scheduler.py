"""Scheduling decisions: which prompt next, how many at once, which engine serves each request.

    train split --DataStream (seeded shuffle, epoch after epoch)--> (uid, task)
         |
    Admission.can_admit(buffer)            queue scheduling: while outstanding < capacity
         |                                 barrier (sync):   only when no admitted group is still
         v                                                   generating, then up to capacity
    one group = group_size (+ redundancy) single-sample requests
         |
    Router.pick() per request  -> least ``inflight`` engine, ties round-robin   (replication on)
    Router.pick() once per group, all samples there                              (replication off)
         |
    Router.slot(engine)  -> per-engine concurrency permits (engine.max_num_seqs, aio.Permits), see rollout.py

The synchronous baseline (``async_ratio = 0``, ``queue_scheduling = false``) is therefore: admit
``batch_prompts`` prompts, generate all of them, train, sync, repeat. Request seeds come from
``request_seed(run seed, prompt uid, sample index, turn)``, never from which engine serves a
request or when, so the samples are the same whatever the engine count and the timing.

Nothing here waits or reads a clock: these are pure decisions the controller calls from its loops.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import random
from collections.abc import Callable, Sequence
from contextvars import ContextVar

from flashrl.aio import Permits
from flashrl.env import Task
from flashrl.interfaces import EngineClient

__all__ = ["Admission", "DataStream", "Router", "mark_engine_dead", "request_seed", "sample_id"]

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1  # vLLM seeds a torch.Generator: any non-negative int64 works


def request_seed(run_seed: int, prompt_uid: int, sample_index: int, turn: int = 0, done: int = 0) -> int:
    """The sampling seed of one generate call, a pure function of where the sample sits in the run.

    A stable hash (not Python's ``hash``, which is salted per process) so that a rerun, another
    engine count or another async ratio produce the same samples for the same (uid, index, turn).
    ``done``: tokens of this turn generated before (a continuation after a checkpoint's cut); 0 gives
    the turn's own seed, so a cut before its first token changes nothing.
    """
    key = f"{run_seed}:{prompt_uid}:{sample_index}:{turn}{f'+{done}' if done else ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK


def sample_id(prompt_uid: int, sample_index: int) -> str:
    """The id of one sample: ``"<uid>-<index>"`` (request ids append ``.<attempt>.<turn>``, and ``.<k>`` for
    the k-th continuation of a turn after checkpoint cuts: rollout.py)."""
    return f"{prompt_uid}-{sample_index}"


class DataStream:
    """The train split in a seeded shuffled order, epoch after epoch.

    ``uid`` counts prompts handed out since the start of the run (0, 1, 2, ...): it names the group
    (Trajectory.group) and seeds its requests, so a prompt seen again in a later epoch is a new
    group with new seeds. Epoch ``e`` is ``random.Random(f"{seed}:{e}")``'s shuffle of the split.
    """

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("the environment's train split is empty: check env.name / env.params")
        self._tasks = list(tasks)
        self._seed = seed
        self.epoch = 0
        self._order: list[int] = []
        self._pos = 0
        self.uid = 0  # the uid the next new prompt gets
        self._readmit: collections.deque[int] = collections.deque()  # resume: uids handed out again first
        self._shuffle()

    def _shuffle(self) -> None:
        self._order = list(range(len(self._tasks)))
        random.Random(f"{self._seed}:{self.epoch}").shuffle(self._order)
        self._pos = 0

    @property
    def size(self) -> int:
        return len(self._tasks)

    def task_of(self, uid: int) -> Task:
        """The task uid ``uid`` was (or will be) handed out with: epoch ``uid // size``, position ``uid % size``."""
        epoch, pos = divmod(uid, len(self._tasks))
        order = list(range(len(self._tasks)))
        random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return self._tasks[order[pos]]

    def restore(self, next_uid: int, readmit: Sequence[int] = ()) -> None:
        """Continue a checkpointed stream: hand out ``readmit`` (their own uids, ascending) first, then
        ``next_uid``, ``next_uid + 1``, ... exactly as the uninterrupted stream would have."""
        self.epoch, self._pos = divmod(next_uid, len(self._tasks))
        self._shuffle_keep_pos()
        self.uid = next_uid
        self._readmit = collections.deque(sorted(readmit))

    @property
    def pending_readmit(self) -> list[int]:
        """Re-admitted uids not handed out yet (resume)."""
        return list(self._readmit)

    def _shuffle_keep_pos(self) -> None:
        pos = self._pos
        self._shuffle()
        self._pos = pos

    def next(self) -> tuple[int, Task]:
        if self._readmit:
            uid = self._readmit.popleft()
            return uid, self.task_of(uid)
        if self._pos == len(self._order):
            self.epoch += 1
            self._shuffle()
        task = self._tasks[self._order[self._pos]]
        self._pos += 1
        uid = self.uid
        self.uid += 1
        return uid, task


class Admission:
    """How many new prompts may start now. The capacity itself lives in the buffer (staleness bound).

    queue scheduling on : ``capacity - outstanding`` (a slot freed by training refills at once).
    queue scheduling off: a batch barrier. Nothing while any admitted group is still generating;
                          then fill up to capacity. With async_ratio = 0 the capacity is one batch,
                          which is exactly the synchronous loop (admit, generate all, train, sync).
    """

    def __init__(self, queue_scheduling: bool) -> None:
        self.queue_scheduling = queue_scheduling

    def admit_count(self, outstanding: int, capacity: int, generating: int) -> int:
        free = max(0, capacity - outstanding)
        if self.queue_scheduling or generating == 0:
            return free
        return 0


# The engines an eval's requests go to (evals.py sets it in the eval's task; the rollout tasks it starts
# inherit it): None outside evals. See Router.reserve.
EVAL_ENGINES: ContextVar[frozenset[int] | None] = ContextVar("eval_engines", default=None)


class Router:
    """Least-loaded routing over engines, plus one concurrency permit pool per engine.

    ``inflight[i]`` is the controller's own count of live rollouts bound to engine i (routed and
    not finished, whether generating, waiting for a permit, or in an env step). It is incremented
    in the same synchronous call that picks the engine, so a burst of picks (one prompt's n
    samples, all started in one tick) spreads over engines; ``EngineClient.inflight`` would only
    move once each request is actually sent. Ties go round-robin from the engine after the last
    pick. Dead engines are never picked.

    Engines set apart for an eval (``reserve``: run.eval_engines, publisher.py) take no new training
    request while they hold the evaluated version (older than the others'), unless no other engine is
    live; a request made inside an eval (``EVAL_ENGINES`` set) goes to those engines only, while one
    of them is live. Engines held back (``hold_back``: behind the published version, LoRA) take no new
    request, training or eval, while another live engine can.
    """

    def __init__(self, n_engines: int, max_num_seqs: int) -> None:
        if n_engines < 1:
            raise ValueError("the controller needs at least one engine (engine.count >= 1)")
        self.inflight = [0] * n_engines
        self.alive = [True] * n_engines
        self._rr = 0
        self._dead = 0  # engines marked dead (0: the fast path of pick() applies)
        self._slots = [Permits(max_num_seqs) for _ in range(n_engines)]
        self._reserved: frozenset[int] = frozenset()  # set apart for an eval (see the class docstring)
        # live engines behind the published version (LoRA: their vLLM refused the adapter; publisher.py)
        self._behind: frozenset[int] = frozenset()

    def reserve(self, engines: frozenset[int]) -> None:
        """Set ``engines`` apart for an eval (empty: none): no new training request goes to them."""
        self._reserved = engines

    @property
    def reserved(self) -> frozenset[int]:
        return self._reserved

    def hold_back(self, engines: frozenset[int]) -> None:
        """``engines`` hold an older version than the published one (LoRA: they refused the adapter): no new
        request goes to them while another live engine can take it, until they load a newer version."""
        self._behind = engines

    @property
    def behind(self) -> frozenset[int]:
        return self._behind

    def pick(self, exclude: Sequence[int] = ()) -> int:
        """The live engine with the fewest inflight rollouts; ties round-robin. Counts it as taken."""
        only = EVAL_ENGINES.get()
        if only is not None:  # an eval's request: its engines, while one of them is live
            if any(self.alive[i] and i not in exclude for i in only):
                return self._pick_from(exclude, lambda i: i in only)
        elif self._behind and any(a and i not in self._reserved and i not in self._behind and i not in exclude
                                  for i, a in enumerate(self.alive)):
            return self._pick_from(exclude, lambda i: i not in self._reserved and i not in self._behind)
        if self._reserved and any(a and i not in self._reserved and i not in exclude for i, a in enumerate(self.alive)):
            return self._pick_from(exclude, lambda i: i not in self._reserved)
        return self._pick_from(exclude, None)

    def _pick_from(self, exclude: Sequence[int], allowed: Callable[[int], bool] | None) -> int:
        inflight = self.inflight
        n = len(inflight)
        if not self._dead and not exclude and allowed is None:
            # Every engine is live: min() and index() scan in C (once per sample, 128 engines and up).
            # The first minimum at or after the round-robin position, else the first from 0.
            low = min(inflight)
            try:
                best = inflight.index(low, self._rr)
            except ValueError:
                best = inflight.index(low)
            self._rr = (best + 1) % n
            self.take(best)
            return best
        best = -1
        for k in range(n):
            i = (self._rr + k) % n
            if not self.alive[i] or i in exclude or (allowed is not None and not allowed(i)):
                continue
            if best < 0 or self.inflight[i] < self.inflight[best]:
                best = i
        if best < 0:
            # Every engine is dead (or excluded): nothing can generate. A loud error, not a retry.
            raise RuntimeError(
                f"no live engine to route to ({sum(self.alive)} of {n} alive): "
                "check the engine logs in the run directory and restart the run"
            )
        self._rr = (best + 1) % n
        self.take(best)
        return best

    def take(self, i: int) -> None:
        self.inflight[i] += 1

    def release(self, i: int) -> None:
        self.inflight[i] -= 1

    def mark_dead(self, i: int) -> None:
        if self.alive[i]:
            self._dead += 1
        self.alive[i] = False

    def revive(self, i: int) -> None:
        """Engine i is back (restarted and holding the current weights): route to it again."""
        if not self.alive[i]:
            self._dead -= 1
        self.alive[i] = True
        self._behind -= {i}  # a restarted engine caught up to the newest weights

    @property
    def all_dead(self) -> bool:
        return self._dead == len(self.alive)

    def slot(self, i: int) -> Permits:
        """Engine i's concurrency permits (engine.max_num_seqs); held while a request generates."""
        return self._slots[i]

    @property
    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]


def mark_engine_dead(router: Router, counters: collections.Counter[str], engines: Sequence[EngineClient],
                     i: int, err: BaseException) -> bool:
    """Engine ``i`` is gone (PeerDead, or found dead): no more rollouts or weights for it. Counted and
    logged once per death (``engine/deaths``); False when it was marked dead already."""
    if not router.alive[i]:
        return False
    router.mark_dead(i)
    counters["engine/deaths"] += 1
    log.error("engine %s is dead (%s); its rollouts move to other engines", engines[i].name, err)
    return True
