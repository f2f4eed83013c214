"""The sample buffer: one group per admitted prompt, as an explicit state machine.

    admit() ──> ADMITTED ──start()──> RUNNING ──add() x group_size──> COMPLETE ──take_batch()──> TRAINING
                                        ^                                 |                          |
                                        └──── stale samples dropped ──────┘          mark_trained() (after the
                                              (refill: start() again)                 weights are published)
                                                                                               v
                              drop(): unfillable group, or all rewards tied (filter_ties)  ──> TRAINED / DROPPED
                                                                                            (slot freed)

Invariants (each is checked where it can break; tests/unit/test_buffer.py exercises them):

The staleness rule itself (capacity, fresh, the step still to come) is flashrl/core/staleness.py's;
the buffer applies it, sharing the run's one ``Staleness`` object with the rollouts' early abort.

1. Capacity = the staleness bound on admission. ``outstanding`` = groups admitted and not yet
   TRAINED or DROPPED. ``admit()`` is refused unless ``outstanding < capacity`` with
   ``capacity = staleness.capacity(batch_prompts)`` = (async_ratio + 1) * batch_prompts (AReaL's
   rule), so outstanding never exceeds it.
   A slot is freed by ``mark_trained()``, which the controller calls only after the update that
   trained the group is published to every engine: a prompt admitted into that slot therefore
   generates with the new weights (with async_ratio = 0 every sample is exactly on-policy).
2. Staleness per sample, by ``staleness.mode`` (scheduler.stale; the bounds are stated and proved
   in core/staleness.py). drop: the batch taken at step s (the update that makes version s+1)
   holds only samples with ``staleness.fresh(s, version_start)``; ``take_batch()`` removes any
   sample that breaks it, counts it (``stale/dropped_samples``, ``stale/dropped_tokens``) and hands
   its group back as RUNNING for a refill. wait: nothing is removed; a batch is handed out only when
   the groups left behind can all still meet their deadlines (``staleness.wait_ok``), so the train
   loop holds the step until then. partial: nothing is removed, nothing is held. Handing out the
   batch of step s records ``staleness.taken(s)`` (the early abort then knows no earlier step will
   take a sample). Nothing is lost silently: every sample that leaves the buffer is either in a
   batch or in a counter.
3. Order. Batches are whole COMPLETE groups in completion order (``ordered=True``, the barrier
   mode: in admission order, so the synchronous loop is reproduced exactly); wait: earliest
   deadline first, ties in that order. Inside a group, samples are ordered by their sample index.
4. A group holds at most ``group_size`` samples: the first ``group_size`` to finish. A sample
   arriving for a group that is not RUNNING is refused (counted ``buffer/late_samples``).
5. A run of ``total_steps`` steps admits no more groups than it will train: ``admit_room()`` is at
   most (total_steps - staleness.next_step) * batch_prompts less the groups admitted and not yet in
   a batch. So the last steps drain what was admitted and the run ends with nothing generating:
   no rollout is thrown away at the end, and the trained set is not short of the long answers that
   a fixed step count would otherwise leave in flight (the length bias of a run's tail).
6. Lent slots (``lending()``: the version an eval holds the engines at, in partial mode, else None;
   the controller decides, scheduler.admit_during_evals). With h held and R = async_ratio, a TRAINING
   group of a step h..h + R whose update has not loaded (``step + 1 > version()``: the eval defers it)
   may lend its slot, once, to a group admitted now (a borrower: ``unsettled`` counts those whose
   lender still holds the slot; counted ``admitted/lent_slots``). A borrower generates at once but
   does not join the completion order while its lender holds the slot: completing then, it is
   ``parked`` (COMPLETE), takeable only by the steps h' + R + 1 .. h + 2R + 1 of a hold (of h' >= h),
   which no group completing during that hold may be in (partial's bound: h' + R at most), after the
   complete groups; taken so, it counts as completed at version h' + R + 1, and its first token lags
   2R + 1 versions at most. ``mark_trained`` of its
   lender settles it: the slot is the borrower's from then on, and a parked one joins the order at
   the version loaded then. So outstanding - unsettled never exceeds the capacity (invariant 1 as
   partial's proof counts it), the groups completing during the hold are taken as without lending,
   and a settled borrower counts as a group admitted into a freed slot (core/staleness.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from flashrl.controller.types import Trajectory
from flashrl.core.staleness import Staleness, wait_ok
from flashrl.env import Task

__all__ = ["Group", "GroupState", "SampleBuffer"]

log = logging.getLogger(__name__)


class GroupState(enum.Enum):
    ADMITTED = "admitted"  # holds a slot, no rollout started yet
    RUNNING = "running"  # rollouts in flight (or a refill after stale samples were dropped)
    COMPLETE = "complete"  # group_size samples, waiting for the trainer
    TRAINING = "training"  # in the batch the trainer is working on; slot still held
    TRAINED = "trained"  # its update is published; slot freed
    DROPPED = "dropped"  # could not be filled, or filtered; slot freed, counted


@dataclass(eq=False)
class Group:
    """One admitted prompt and its samples. ``uid`` is the admission index (Trajectory.group)."""

    uid: int
    task: Task
    need: int
    state: GroupState = GroupState.ADMITTED
    samples: list[Trajectory] = field(default_factory=list)
    next_index: int = 0  # next sample index to launch; indices seed requests, never reused
    admitted_at: float = 0.0
    completed_at: float = 0.0
    drop_reason: str = ""
    # min version_start over ``samples`` (each sample's is computed once, when it joins): the group
    # passes the staleness bound at step s iff staleness.fresh(s, oldest)
    oldest: int = 1 << 62
    admitted_version: int = 0  # the engines' version at admission: every token's is >= this
    completed_version: int = 0  # the engines' version when the group completed (partial's bound)
    step: int = -1  # TRAINING: the step whose batch took it
    lent_hold: int | None = None  # admitted into a lent slot while an eval held this version (invariant 6)
    # slots lent during an eval hold (invariant 6): the TRAINING group whose slot this one was admitted
    # into, until that group's update loads (then the slot is this one's), and the reverse link
    lender: Group | None = field(default=None, repr=False)
    borrower: Group | None = field(default=None, repr=False)

    @property
    def missing(self) -> int:
        return self.need - len(self.samples)

    def deadline(self, staleness: Staleness) -> int:
        """Wait mode: the last step that may train this group (its oldest token's version + async_ratio;
        before it is complete, its admitted version's, a lower bound on every token's)."""
        v = self.oldest if self.missing == 0 else self.admitted_version
        return staleness.deadline(v)


class SampleBuffer:
    """Groups keyed by prompt uid; see the module docstring for the invariants."""

    def __init__(
        self,
        *,
        group_size: int,
        batch_prompts: int,
        staleness: Staleness,
        ordered: bool = False,
        filter_ties: bool = False,
        counters: Counter[str] | None = None,
        version: Callable[[], int] = lambda: 0,
        total_steps: int | None = None,
        lending: Callable[[], int | None] = lambda: None,
    ) -> None:
        """``version``: the version every live engine holds (types.Published.version), read at admission
        (wait's deadlines) and completion (partial's bound). ``total_steps``: the run's step count
        (run.steps), which bounds admission (invariant 5); None: no bound but the capacity. ``lending``: the
        version an eval holds the engines at while slots may be lent (invariant 6), else None."""
        self.group_size = group_size
        self.batch_prompts = batch_prompts
        self.staleness = staleness
        self.ordered = ordered
        self.filter_ties = filter_ties
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.version = version
        self.total_steps = total_steps
        self.groups: dict[int, Group] = {}  # outstanding groups only (not TRAINED / DROPPED)
        self.dropped_uids: list[int] = []  # every group given up, in order (checkpointed: no prompt unaccounted for)
        self.complete: list[Group] = []  # COMPLETE groups in completion order
        self._generating = 0  # groups ADMITTED or RUNNING (kept, not counted, on every change)
        self._training = 0  # groups TRAINING (kept likewise: admit_room reads it per admission)
        self.lending = lending
        self.unsettled = 0  # groups admitted into a lent slot whose lender still holds it (invariant 6)
        self.parked: list[Group] = []  # COMPLETE groups among those, in completion order (invariant 6)
        # Staleness is re-checked in full only when the step changes; otherwise only the groups
        # completed since the last check are (nothing else can have become stale).
        self._checked_step: int | None = None
        self._unchecked: list[Group] = []
        self._waiters: list[asyncio.Future[None]] = []

    # ------------------------------------------------------------------ accounting
    @property
    def capacity(self) -> int:
        return self.staleness.capacity(self.batch_prompts)

    @property
    def outstanding(self) -> int:
        return len(self.groups)

    @property
    def generating(self) -> int:
        return self._generating

    def can_admit(self) -> bool:
        return self.admit_room() > 0

    @property
    def admission_capacity(self) -> int:
        """How many groups may be outstanding now: the capacity, plus the slots lent (invariant 6)."""
        return self.capacity + self.unsettled + len(self._lendable())

    def _lendable(self) -> list[Group]:
        """TRAINING groups whose slot may be lent now (invariant 6), oldest step first."""
        held = self.lending()
        if held is None:
            return []
        v, last = self.version(), held + self.staleness.async_ratio
        return sorted((g for g in self.groups.values() if g.state is GroupState.TRAINING and g.borrower is None
                       and g.step + 1 > v and g.step <= last and g.lender is None),
                      key=lambda g: (g.step, g.uid))

    def admit_room(self) -> int:
        """Groups that may be admitted now: the capacity left (invariant 1; with lent slots, 6) and, with
        ``total_steps``, no more than the run still trains beyond the groups admitted and not yet in a
        batch (invariant 5)."""
        room = self.admission_capacity - self.outstanding
        left = self._left_to_train()
        if left is not None:
            room = min(room, left - (len(self.groups) - self._training))  # minus the groups not yet in a batch
        return max(0, room)

    def _left_to_train(self) -> int | None:
        """Groups the run's batches still to be taken will train (None: no ``total_steps``)."""
        if self.total_steps is None:
            return None
        return (self.total_steps - self.staleness.next_step) * self.batch_prompts

    # ------------------------------------------------------------------ transitions
    def admit(self, uid: int, task: Task, now: float = 0.0) -> Group:
        if not self.can_admit():
            raise RuntimeError(
                f"admission over capacity: {self.outstanding} outstanding groups, capacity "
                f"{self.capacity} = (async_ratio + 1) * batch_prompts, groups the run still trains "
                f"{self._left_to_train() or 'unbounded'}; the admission loop must check admit_room()"
            )
        if uid in self.groups:
            raise RuntimeError(f"prompt uid {uid} admitted twice")
        g = Group(uid=uid, task=task, need=self.group_size, admitted_at=now, admitted_version=self.version())
        if self.outstanding - self.unsettled >= self.capacity:  # no slot of its own: a lent one (invariant 6)
            lender = self._lendable()[0]
            g.lender, lender.borrower = lender, g
            g.lent_hold = self.lending()
            self.unsettled += 1
            self.counters["admitted/lent_slots"] += 1
        self.groups[uid] = g
        self._generating += 1
        self.counters["admitted/groups"] += 1
        self._notify()
        return g

    def restore(self, uid: int, task: Task, samples: list[Trajectory], *, complete: bool, next_index: int,
                admitted_version: int, completed_version: int, now: float = 0.0) -> Group:
        """Put back a group a checkpoint saved (resume): complete ones go to the end of the completion
        order (call in the checkpoint's order), the others are RUNNING, for the caller to launch their
        rollouts. It takes an admission slot like an admitted group; its counts were the checkpoint's."""
        if uid in self.groups:
            raise RuntimeError(f"prompt uid {uid} restored twice")
        if self.outstanding >= self.capacity:  # the capacity only: a restored group was admitted before
            raise RuntimeError(f"restoring group {uid}: {self.outstanding} outstanding groups fill the capacity "
                               f"{self.capacity}; the checkpoint holds more untrained groups than the config allows")
        g = Group(uid=uid, task=task, need=self.group_size, samples=list(samples), next_index=next_index,
                  admitted_at=now, admitted_version=admitted_version, completed_version=completed_version)
        g.oldest = min((t.version_start for t in samples), default=g.oldest)
        if len(samples) > self.group_size or complete != (len(samples) == self.group_size):
            raise RuntimeError(f"group {uid} restored with {len(samples)} samples of {self.group_size} "
                               f"({'complete' if complete else 'running'}): the checkpoint is inconsistent")
        self.groups[uid] = g
        if complete:
            g.state = GroupState.COMPLETE
            g.completed_at = now
            self.complete.append(g)
            if self.staleness.mode == "drop":
                self._unchecked.append(g)
        else:
            g.state = GroupState.RUNNING
            self._generating += 1
        self._notify()
        return g

    def start(self, g: Group, n: int) -> int:
        """Mark ``n`` rollouts launched for ``g``; return the first of their sample indices."""
        if g.state not in (GroupState.ADMITTED, GroupState.RUNNING):
            raise RuntimeError(f"group {g.uid} cannot start rollouts in state {g.state.value}")
        g.state = GroupState.RUNNING
        first = g.next_index
        g.next_index += n
        return first

    def add(self, traj: Trajectory, now: float = 0.0) -> bool:
        """A finished sample joins its group at once. Returns False if the group cannot take it.

        Waiters are woken only when the group completes: a sample that leaves its group short
        changes nothing the admission or the train loop decide on.
        """
        g = self.groups.get(traj.group)
        if g is None or g.state is not GroupState.RUNNING or g.missing == 0:
            self.counters["buffer/late_samples"] += 1
            return False
        g.samples.append(traj)
        v = traj.version_start
        if v < g.oldest:
            g.oldest = v
        if g.missing == 0:
            self._generating -= 1
            if self.filter_ties and len({t.reward for t in g.samples}) == 1:
                self.drop(g, "ties")
                return True
            g.state = GroupState.COMPLETE
            g.completed_at = now
            if g.lender is not None:  # its slot is still lent: it joins the completion order when it loads
                g.completed_version = g.lender.step + 1  # the version it joins at, at the earliest
                self.parked.append(g)
            else:
                g.completed_version = self.version()
                self.complete.append(g)
                if self.staleness.mode == "drop":
                    self._unchecked.append(g)
            self._notify()
        return True

    def drop(self, g: Group, reason: str) -> None:
        """Give up on a group (cannot be filled, or no learning signal); its slot is freed, counted."""
        if g.state in (GroupState.TRAINED, GroupState.DROPPED, GroupState.TRAINING):
            raise RuntimeError(f"group {g.uid} cannot be dropped in state {g.state.value}")
        if g.lender is not None:
            g.lender.borrower, g.lender = None, None
            self.unsettled -= 1
        if g.state is GroupState.COMPLETE:
            (self.parked if g in self.parked else self.complete).remove(g)
        elif g.missing > 0:  # ADMITTED or RUNNING (a group completed by add() was counted there)
            self._generating -= 1
        g.state = GroupState.DROPPED
        g.drop_reason = reason
        del self.groups[g.uid]
        self.dropped_uids.append(g.uid)
        self.counters[f"dropped/groups_{reason}"] += 1
        self.counters["dropped/samples"] += len(g.samples)
        self._notify()

    def take_batch(self, step: int) -> tuple[list[Group] | None, list[Group]]:
        """(batch of ``batch_prompts`` groups or None, groups handed back for a refill).

        drop: every COMPLETE group is checked against the staleness bound for ``step`` (invariant 2);
        a group that lost samples goes back to RUNNING and is returned in the second list, for the
        controller to launch ``g.missing`` new rollouts. wait: None while the batch would leave a
        group unable to meet its deadline (the caller waits for ``changed()`` and asks again).
        partial: never drops, never holds. The second list is empty outside drop.
        """
        mode = self.staleness.mode
        refills = self._drop_stale(step) if mode == "drop" else []
        lent = self._lent_takeable(step)
        if len(self.complete) + len(lent) < self.batch_prompts:
            return None, refills
        pool = sorted(self.complete, key=lambda g: g.uid) if self.ordered else self.complete
        if lent and len(pool) < self.batch_prompts:
            pool = [*pool, *lent]
        if mode == "wait":
            pool = sorted(pool, key=lambda g: g.deadline(self.staleness))  # stable: ties keep the order above
        batch = pool[: self.batch_prompts]
        if mode == "wait" and not self._wait_ok(step, batch):
            return None, refills
        taken_lent = [g for g in batch if g in lent]  # borrowers taken during the hold (invariant 6)
        for g in taken_lent:
            g.completed_version = self.lending() + self.staleness.async_ratio + 1  # type: ignore[operator]
        if mode != "drop":
            self._check_bound(step, batch)
        for g in batch:
            (self.parked if g in taken_lent else self.complete).remove(g)
            g.state = GroupState.TRAINING
            self._training += 1
            g.step = step
            g.samples.sort(key=lambda t: t.index)
        self.staleness.taken(step)
        self._notify()
        return batch, refills

    def _lent_takeable(self, step: int) -> list[Group]:
        """The parked borrowers ``step`` may take (invariant 6: steps h + R + 1 .. h + 2R + 1 of the hold)."""
        held = self.lending() if self.parked else None
        if held is None:
            return []
        r = self.staleness.async_ratio
        if step <= held + r:
            return []
        return [g for g in self.parked if g.lent_hold is not None and step <= g.lent_hold + 2 * r + 1]

    def _drop_stale(self, step: int) -> list[Group]:
        """Drop mode: remove every sample too old for ``step`` (counted); their groups, for a refill."""
        refills: list[Group] = []
        if step != self._checked_step:
            check = self.complete
            self._checked_step = step
        else:
            check = [g for g in self._unchecked if g.state is GroupState.COMPLETE]
        self._unchecked = []
        bound = self.staleness.oldest(step)  # a sample is fresh iff version_start >= bound
        stale_groups = [g for g in check if g.oldest < bound]
        for g in stale_groups:
            kept = [t for t in g.samples if t.version_start >= bound]
            self.counters["stale/dropped_samples"] += len(g.samples) - len(kept)
            self.counters["stale/dropped_tokens"] += sum(t.n_generated for t in g.samples if t.version_start < bound)
            g.samples = kept
            g.oldest = min((t.version_start for t in kept), default=1 << 62)
            g.state = GroupState.RUNNING
            self._generating += 1
            self.complete.remove(g)
            refills.append(g)
        if refills:
            self._notify()
        return refills

    def _wait_ok(self, step: int, batch: list[Group]) -> bool:
        """Wait mode: may ``batch`` be the batch of ``step``? Yes when every group left behind can still
        meet its deadline (core/staleness.wait_ok). When not even the earliest-deadline batch of every
        group left, complete or not, could pass, waiting cannot help (the bound's proof rules this out:
        a bug); the batch then goes, counted under stale/over_bound_groups, rather than stall the run."""
        rule = self.staleness
        taken = {g.uid for g in batch}
        left = [g.deadline(rule) for g in self.groups.values()
                if g.uid not in taken and g.state is not GroupState.TRAINING]
        if wait_ok(step, left, self.batch_prompts):
            return True
        ideal = sorted([*left, *(g.deadline(rule) for g in batch)])[self.batch_prompts:]
        if wait_ok(step, ideal, self.batch_prompts):
            return False  # a more urgent group is still generating: hold the step for it
        log.error("wait mode: step %d cannot keep every group within scheduler.async_ratio = %d; training "
                  "the most urgent complete groups (stale/over_bound_groups counts the late ones)", step, rule.async_ratio)
        return True

    def _check_bound(self, step: int, batch: list[Group]) -> None:
        """wait and partial: count any group ``batch`` trains past the mode's bound (never, by the proofs)."""
        rule = self.staleness
        if rule.mode == "wait":
            late = sum(g.deadline(rule) < step for g in batch)
        else:
            late = sum(not rule.fresh(step, g.completed_version) for g in batch)
        if late:
            self.counters["stale/over_bound_groups"] += late

    def mark_trained(self, batch: list[Group]) -> None:
        """The update that trained ``batch`` is published: free their slots (invariant 1); a slot lent
        is its borrower's from now on, and a borrower already complete joins the completion order at
        the version loaded now (invariant 6)."""
        settled = False
        for g in batch:
            if g.state is not GroupState.TRAINING:
                raise RuntimeError(f"group {g.uid} marked trained in state {g.state.value}")
            g.state = GroupState.TRAINED
            self._training -= 1
            del self.groups[g.uid]
            if g.borrower is not None:  # the slot is its borrower's now
                g.borrower.lender, g.borrower = None, None
                self.unsettled -= 1
                settled = True
            if g.lender is not None:  # a borrower trained before its lender: the lender's slot stays lent-free
                g.lender.borrower, g.lender = None, None
                self.unsettled -= 1
        if settled:
            v = self.version()
            for p in [p for p in self.parked if p.lender is None]:  # in completion order
                self.parked.remove(p)
                p.completed_version = max(v, p.completed_version)
                self.complete.append(p)
        self.counters["trained/groups"] += len(batch)
        self._notify()

    # ------------------------------------------------------------------ waiting
    def wake(self) -> None:
        """Wake every ``changed()`` waiter without a change (the controller's stop request)."""
        self._notify()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def changed(self) -> None:
        """Wait for the next change that matters to a decision: an admission, a group completing,
        a drop, a batch or refill taken, a publish (not every sample: see ``add``)."""
        w = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        await w
