"""A resumed run's start: a checkpoint's controller state put back into a new controller's parts.

    restored = restore(state, cfg, stream, buffer, staleness, ledger, counters)
      restored: the untrained groups still generating, with their unfinished and held-back rollouts;
      the feed launches them first when run() starts (feed.Feed.restored). The caller sets its own
      version and the published one to ``state.version`` first.

The stream re-admits the prompts that were outstanding (and the groups it cannot restore); the buffer
gets the untrained groups back (partial mode's saved prefixes, flashrl/checkpoint.py's RolloutSnapshot);
the ledger its counters and histories; the staleness rule its next step. A checkpoint of other data (a
different train split, seed or task at a saved uid) is a ValueError naming what changed.
"""

from __future__ import annotations

import logging
from collections import Counter

from flashrl.checkpoint import ControllerState, RolloutSnapshot
from flashrl.config import Config
from flashrl.controller.buffer import Group, SampleBuffer
from flashrl.controller.ledger import Ledger
from flashrl.controller.scheduler import DataStream
from flashrl.controller.types import Trajectory
from flashrl.core.staleness import Staleness

__all__ = ["Restored", "restore"]

log = logging.getLogger(__name__)


# an untrained group still generating, its unfinished rollouts and its finished ones held back (launch order)
Restored = list[tuple[Group, list[Trajectory], list[Trajectory]]]


def restore(st: ControllerState, cfg: Config, stream: DataStream, buffer: SampleBuffer, staleness: Staleness,
            ledger: Ledger, counters: Counter[str]) -> Restored:
    """Put ``st`` back into the parts of a controller built for the same run (call before run())."""
    if st.train_size != stream.size or st.seed != cfg.run.seed:
        raise ValueError(
            f"checkpoint does not match this run's data: train split of {st.train_size} tasks with seed "
            f"{st.seed}, this run has {stream.size} with seed {cfg.run.seed} (env.params / run.seed changed?)"
        )
    restored: Restored = []
    ledger.restore(st)
    staleness.next_step = st.step  # the next batch is step ``st.step``
    readmit = list(st.readmit)
    if st.rollouts is not None:
        readmit += _restore_rollouts(st.rollouts, st.version, stream, buffer, staleness, counters, restored)
    stream.restore(st.next_uid, readmit)
    buffer.dropped_uids = list(st.dropped_uids)
    return restored


def _restore_rollouts(snap: RolloutSnapshot, version: int, stream: DataStream, buffer: SampleBuffer,
                      staleness: Staleness, counters: Counter[str],
                      restored: Restored) -> list[int]:
    """Put a checkpoint's untrained groups back into the buffer (their unfinished rollouts go to ``restored``,
    launched first when run() starts: feed.Feed.restored); the uids to re-admit instead.

    A complete group that partial mode's bound no longer lets train at this version (it completed
    more than async_ratio versions ago: never, by the bound's proof, in a checkpoint this flashrl
    wrote) is re-admitted, counted under resume/over_bound_groups and its tokens under
    resume/regenerated_tokens. Counted: resume/restored_groups, restored_samples (finished: handed over or held back),
    restored_rollouts (unfinished, continued), restored_tokens (generated tokens kept), restored_routes (a MoE
    policy's: the tokens among them whose engine routes were saved, replayed by r3; only when there are)."""
    n: Counter[str] = Counter(regenerated_tokens=snap.regenerated_tokens)  # this resume's (the counters add up)
    readmit: list[int] = []
    for sg in snap.groups:
        task = stream.task_of(sg.uid)
        if task.id != sg.task_id:
            raise ValueError(f"checkpoint's rollouts of prompt uid {sg.uid} are for task {sg.task_id!r}, this run's "
                             f"data gives {task.id!r} (env.params / the dataset changed?)")
        samples = list(sg.samples)
        kept = sum(t.n_generated for t in samples)
        if sg.complete and not staleness.fresh(version, sg.completed_version):
            n["over_bound_groups"] += 1
            n["regenerated_tokens"] += kept
            readmit.append(sg.uid)
            continue
        g = buffer.restore(sg.uid, task, samples, complete=sg.complete, next_index=sg.next_index,
                           admitted_version=sg.admitted_version, completed_version=sg.completed_version)
        if not sg.complete:
            unfinished = list(sg.unfinished)
            held = list(sg.held)  # finished, waiting for an earlier launch (launch order)
            restored.append((g, unfinished, held))
            n["restored_rollouts"] += len(unfinished)
            n["restored_samples"] += len(held)
            kept += sum(t.n_generated for t in (*unfinished, *held))
        n["restored_groups"] += 1
        n["restored_samples"] += len(samples)
        n["restored_tokens"] += kept
        n["restored_routes"] += sum(1 for t in (*samples, *sg.unfinished, *sg.held) for r in t.routes if r)
    n["readmitted_groups"] += len(readmit)
    for k in ("restored_groups", "restored_samples", "restored_rollouts", "restored_tokens", "regenerated_tokens",
              "readmitted_groups", "over_bound_groups", "restored_routes"):
        if n[k] or k not in ("over_bound_groups", "restored_routes"):
            counters[f"resume/{k}"] += n[k]
    log.info("resume: %d untrained groups restored (%d finished samples, %d unfinished rollouts continued, "
             "%d generated tokens kept); %d tokens to generate again; %d groups re-admitted",
             n["restored_groups"], n["restored_samples"], n["restored_rollouts"], n["restored_tokens"],
             n["regenerated_tokens"], n["readmitted_groups"])
    return readmit
