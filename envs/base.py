"""The environment protocol. Single-turn RLVR tasks are the one-step case of the same protocol.

    controller rollout coroutine                      environment
      obs = await env.reset(task)   --------------->  builds the first observation (the prompt text)
      loop: action = decode(generated tokens)
            res = await env.step(action) --------->   reward, next observation, done
            append tokens of res.observation (loss mask 0) and generate again, until res.done

An environment only ever sees text; the controller tokenizes each observation once and keeps the
trajectory as concatenated token ids (never re-tokenized from text).

An environment signals an infrastructure failure (its process died, it hung, it produced garbage)
by raising ``EnvFailure``; the controller retries such a rollout elsewhere and counts it apart from
policy failures (a wrong answer is reward 0, not an exception).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec


class Task(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One dataset row: an id unique within its split, the prompt text and what the verifier needs."""

    id: str
    prompt: str
    answer: str = ""
    meta: dict[str, Any] = {}


class StepResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one env.step returns. ``observation`` is appended to the context when not done."""

    observation: str = ""
    reward: float = 0.0
    done: bool = True
    info: dict[str, Any] = {}


class EnvFailure(Exception):
    """Infrastructure failure of an environment (not the policy's fault): retry on another worker.

    ``reason`` is a short counter name: "timeout", "crash", "garbage", ...
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@runtime_checkable
class Env(Protocol):
    async def reset(self, task: Task) -> str:
        """Start an episode for ``task``; return the first observation (the prompt text)."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the policy's text ``action``; return reward, next observation and done."""
        ...

    async def close(self) -> None:
        """Release resources (processes, temp dirs). Safe to call twice."""
        ...


class EnvSuite(Protocol):
    """An environment family as the controller uses it: data splits plus a factory of episodes.

    ``Params`` is a msgspec Struct (forbid_unknown_fields) of the ``[env.params]`` options.
    """

    Params: ClassVar[type]

    def train_tasks(self) -> Sequence[Task]: ...

    def eval_tasks(self) -> Sequence[Task]: ...

    def make_env(self) -> Env: ...


class Demo(msgspec.Struct, kw_only=True, frozen=True):
    """A teacher's episode for the supervised warm-start of the built-in model.

    ``turns`` holds (action, observation) pairs in order: the model is trained on each action (plus
    the end-of-sequence token that closes a turn), never on the prompt or an observation, which is
    exactly the token layout and loss mask of a multi-turn rollout. The last observation is "".
    """

    prompt: str
    turns: list[tuple[str, str]]


@runtime_checkable
class Demonstrating(Protocol):
    """An EnvSuite whose warm-start imitates a multi-turn teacher instead of ``prompt -> answer``.

    ``WARM_START`` overrides fields of flashrl.models.WarmStart for this suite (e.g. more steps).
    """

    WARM_START: ClassVar[dict[str, Any]]

    def demonstration(self, task: Task, rng: Any) -> Demo:
        """One teacher episode on ``task``; ``rng`` (random.Random) makes it deterministic."""
        ...
