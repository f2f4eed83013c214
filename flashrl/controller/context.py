"""What every rollout shares (RolloutContext: config, tokenizer, engines, router, meters, the staleness
rule, the checkpoint cut) and what one rollout is asked to do (RolloutSpec). The rollouts themselves:
rollout.py (one trajectory, one sample) and group.py (one group)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flashrl.aio import Deadlines, TaskCancel
from flashrl.config import Config
from flashrl.controller.cut import CheckpointCut
from flashrl.controller.scheduler import Router, mark_engine_dead
from flashrl.controller.types import Trajectory
from flashrl.core.meters import BusyMeter, RateMeter
from flashrl.core.staleness import Staleness
from flashrl.env import EnvSuite, Task
from flashrl.interfaces import ChatTokenizer, EngineClient, Tokenizer
from flashrl.moe.routes import RouteShape

__all__ = ["RolloutContext", "RolloutSpec"]


class RolloutSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to roll out: the task, the group and index (ids, seeds), the sampling temperature."""

    task: Task
    group: int
    index: int
    temperature: float
    seed_key: tuple[int, int]  # (prompt uid, sample index) for training; (-1 - k, version) for eval
    sample_id: str = ""
    resume: Trajectory | None = None  # a checkpoint's unfinished rollout of this index: continue it (first attempt)


PROMPT_CACHE = 4096  # prompts whose token ids RolloutContext keeps (oldest out first)


@dataclass(eq=False)
class RolloutContext:
    """Everything a rollout needs, shared by all of them (single event loop: no locks)."""

    cfg: Config
    tokenizer: Tokenizer
    suite: EnvSuite
    engines: Sequence[EngineClient]
    router: Router
    version: Callable[[], int]
    counters: Counter[str] = field(default_factory=Counter)
    live: dict[str, int] = field(default_factory=dict)  # request id -> engine, while generating
    # per engine: time with >= 1 generate in flight (the controller's, started with its run: the busy
    # fractions of its dashboard); none given: meters of this context's own (stand-alone rollouts)
    busy: list[BusyMeter] = field(default_factory=list)
    token_rates: list[RateMeter] = field(default_factory=list)  # per engine; empty: not metered
    # the run's staleness rule (shared with the buffer, which advances its next_step); None turns
    # the stale early abort off
    staleness: Staleness | None = None
    # who handles an engine death: the controller's supervisor (supervisor.EngineSupervisor.engine_dead:
    # marks it dead, counts it, restarts it when a launcher can); None: this context marks it dead in
    # the router itself (stand-alone rollouts, no restarts)
    on_engine_dead: Callable[[int, BaseException], None] | None = None
    # awaited when every engine is down, until one is back (given only when engines can be restarted)
    wait_engine: Callable[[], Coroutine[Any, Any, None]] | None = None
    # attempts watched for staleness (multi-turn training rollouts past their first turn):
    # what cancels the attempt -> the version of its first generated token
    watched: dict[TaskCancel, int] = field(default_factory=dict, init=False)
    # the trajectory deadline of every attempt in flight (rollout.trajectory_timeout_s): one timer
    deadlines: Deadlines = field(init=False)
    # the tokenizer when it renders turns itself (interfaces.ChatTokenizer), else None: decided once
    chat: ChatTokenizer | None = field(init=False)
    # the prompt's token ids by its text: a group's samples (and replicas, retries) share their prompt,
    # which was tokenized once per sample (a fifth of the controller's CPU on the embedded default)
    _prompts: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False)
    # checkpoint cuts (cut.py; partial mode with checkpoints): the training rollouts and their requests
    # register there; None: no cuts
    cut: CheckpointCut | None = None
    # on-policy distillation (flashrl/distill/client.py Teachers): a finished training rollout is scored by its
    # teacher before it goes to its group; None: no teacher
    teachers: Any = None
    # a MoE policy whose engines capture routes (flashrl/moe/routes.py): their shape, checked on every answer
    routes: RouteShape | None = None
    # a vision-language policy (flashrl/vision/prompts.py VisionPrompts): a task's images onto its prompt; None:
    # text only (a task's meta["images"] is then not read)
    vision: Any = None

    def prompt_ids(self, obs: str) -> list[int]:
        """The first observation's token ids (chat-rendered when the tokenizer has a chat template)."""
        ids = self._prompts.get(obs)
        if ids is None:
            ids = tuple(self.chat.encode_prompt(obs) if self.chat is not None else self.tokenizer.encode(obs))
            if len(self._prompts) >= PROMPT_CACHE:
                self._prompts.pop(next(iter(self._prompts)))  # the oldest
            self._prompts[obs] = ids
        return list(ids)

    def __post_init__(self) -> None:
        self.deadlines = Deadlines(self.cfg.rollout.trajectory_timeout_s)
        self.chat = self.tokenizer if isinstance(self.tokenizer, ChatTokenizer) else None
        if not self.busy:
            self.busy = [BusyMeter() for _ in self.engines]

    def cut_for(self, group: int) -> CheckpointCut | None:
        """The checkpoint cut a rollout of ``group`` reports to: training rollouts only (evals are not saved)."""
        return self.cut if group >= 0 else None

    def checkin(self, rid: str) -> bool:
        """A training request ended: True when a checkpoint cut had interrupted it (CheckpointCut.checkin)."""
        return self.cut is not None and self.cut.checkin(rid)

    def engine_dead(self, i: int, err: BaseException) -> None:
        """Engine ``i`` is gone (its request raised PeerDead): no more rollouts or weights for it.
        Counted once per death under ``engine/deaths`` (scheduler.mark_engine_dead); restarted when
        the handler given as ``on_engine_dead`` can."""
        if self.on_engine_dead is not None:
            self.on_engine_dead(i, err)
        else:
            mark_engine_dead(self.router, self.counters, self.engines, i, err)

    def abort_stale(self) -> int:
        """Cancel every watched trajectory that became too stale to train; return how many.

        The controller calls this whenever ``staleness.next_step`` grows (a batch was taken).
        """
        rule = self.staleness
        if rule is None:
            return 0
        n = 0
        for scope, version_start in self.watched.items():
            if not scope.cancel_called and rule.doomed(version_start):
                scope.cancel()
                n += 1
        return n
