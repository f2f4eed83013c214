"""flashrl's public environment API: what an environment is built on (the built-ins of ``envs/`` and yours).

    from flashrl.env import Env, EnvFailure, EnvSuite, StepResult, Task

Single-turn RLVR tasks are the one-step case of the same protocol.

    controller rollout coroutine                      environment
      obs = await env.reset(task)   --------------->  builds the first observation (the prompt text)
      loop: action = decode(generated tokens)
            res = await env.step(action) --------->   reward, next observation, done
            append tokens of res.observation (loss mask 0) and generate again, until res.done

An environment only ever sees text (and gives images with a vision-language policy: StepResult.images); the
controller tokenizes each observation once and keeps the trajectory as concatenated token ids (never
re-tokenized from text).

An environment signals an infrastructure failure (its process died, it hung, it produced garbage)
by raising ``EnvFailure``; the controller retries such a rollout elsewhere and counts it apart from
policy failures (a wrong answer is reward 0, not an exception).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

__all__ = [
    "EOS_MARKS", "Closable", "Counting", "Demo", "Demonstrating", "Env", "EnvFailure", "EnvSuite", "MultiTurn",
    "SingleTurnEnv", "StepResult", "Task", "Wrapping", "cut_at_eos", "states_integer",
]


class Task(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One dataset row: an id unique within its split, the prompt text and what the verifier needs."""

    id: str
    prompt: str
    answer: str = ""
    meta: dict[str, Any] = {}


class StepResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one env.step returns. ``observation`` is appended to the context when not done.

    ``info`` keys the controller reads: ``"correct"`` (bool), whether the episode counts as solved in
    ``eval/accuracy`` and ``samples.jsonl`` (without it: total reward >= 1); ``"metrics"`` (a dict of
    numbers), logged per step as ``reward/<name>`` (held-out: ``eval/reward/<name>``), the mean over
    the trajectories that have the name, each trajectory with the last value its steps gave.

    ``images``: the observation's images for a vision-language policy, one ``<image>`` in ``observation`` per
    image, in order: PNG/JPEG bytes, a file path, a PIL image or an HxWx3 uint8 array (encoded to PNG in a
    worker thread, never on the controller's loop; a remote environment sends bytes or paths). The controller
    expands each where its ``<image>`` stands, the engine and the trainer see every image of the sequence,
    samples.jsonl names them (docs/environments.md, "Images in observations").
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = True
    info: dict[str, Any] = {}
    images: list[Any] = []


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


class SingleTurnEnv:
    """The Env of single-turn RLVR, to subclass: ``reset`` keeps the task and returns its prompt as the
    first observation; ``step`` scores the action with ``judge(task, action)``, which ends the episode.

        class MathEnv(SingleTurnEnv):
            async def judge(self, task: Task, action: str) -> StepResult:
                ok = states_integer(action, task.answer)
                return StepResult(reward=float(ok), done=True, info={"correct": ok})
    """

    def __init__(self) -> None:
        self.task: Task | None = None

    async def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    async def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset: call reset(task) first")
        return await self.judge(self.task, action)

    async def judge(self, task: Task, action: str) -> StepResult:
        """The reward (and info) of ``action`` on ``task``; raise EnvFailure for an infrastructure failure."""
        raise NotImplementedError(f"{type(self).__name__}.judge: a SingleTurnEnv scores actions in judge()")

    async def close(self) -> None:
        self.task = None


class EnvSuite(Protocol):
    """An environment family as the controller uses it: data splits plus a factory of episodes.

    Optional parts, each its own protocol below: ``aclose()`` (Closable), ``counters`` (Counting),
    ``task_suite`` (Wrapping), ``demonstration()`` (Demonstrating), ``max_turns`` (MultiTurn),
    ``make_eval_env()`` (HeldOutAware), ``checkpoint_state()`` (Stateful). A suite *class*, as env.name names
    it, also has ``Params: ClassVar[type]``, a msgspec Struct (forbid_unknown_fields) of its
    ``[env.params]`` options, and is built as ``cls(params, seed=..., eval_size=...)``
    (flashrl.plugins checks both when it loads the class; the controller never needs them).
    """

    def train_tasks(self) -> Sequence[Task]: ...

    def eval_tasks(self) -> Sequence[Task]: ...

    def make_env(self) -> Env: ...


@runtime_checkable
class Closable(Protocol):
    """An EnvSuite that holds resources beyond its environments (worker processes, sandboxes): the
    controller awaits ``aclose()`` once when the run ends (bounded; a failure is logged and counted)."""

    async def aclose(self) -> None: ...


@runtime_checkable
class Counting(Protocol):
    """An EnvSuite with counters of its own (faults injected, workers restarted): the controller logs
    each numeric entry as ``env/<name>`` in every step record and in the run's summary."""

    @property
    def counters(self) -> Mapping[str, float]: ...


@runtime_checkable
class HeldOutAware(Protocol):
    """An EnvSuite whose held-out episodes differ from training ones (a reward model's running statistics learn
    from training episodes only): the controller makes each held-out (eval) episode with ``make_eval_env()``.
    Which split an episode is in is the rollout's (evals are its negative groups), never the task's id: ids are
    unique within a split only, and a dataset read twice from one folder repeats them."""

    def make_eval_env(self) -> Env: ...


@runtime_checkable
class Stateful(Protocol):
    """An EnvSuite with state a resumed run must continue (a reward model's normalization statistics):
    ``checkpoint_state()`` (JSON-able) is saved in every checkpoint and ``restore_state`` puts it back on resume."""

    def checkpoint_state(self) -> dict[str, Any]: ...

    def restore_state(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Wrapping(Protocol):
    """An EnvSuite that serves another one's tasks in another way (``remote``: in worker processes): the
    built-in model warm-starts on ``task_suite``, the wrapped suite in this process. Its class also says,
    from its params alone, what it wraps: ``wrapped_env(params) -> (env name, params, config key)``
    (flashrl.plugins.task_env; the model's cache key and ``flashrl validate`` look there)."""

    @property
    def task_suite(self) -> EnvSuite: ...


@runtime_checkable
class MultiTurn(Protocol):
    """An EnvSuite whose episodes take more than one turn, saying at most how many: an episode ends (done)
    by its ``max_turns``-th step at the latest. ``flashrl validate`` refuses ``rollout.max_turns = 1`` for
    it (every episode would be cut after its first action) and warns when rollout.max_turns is below it.
    A Demonstrating suite that does not say is judged by its demonstrations' turns (flashrl/envcheck.py)."""

    @property
    def max_turns(self) -> int: ...


class Demo(msgspec.Struct, kw_only=True, frozen=True):
    """A teacher's episode for the supervised warm-start of the built-in model.

    ``turns`` holds (action, observation) pairs in order: the model is trained on each action (plus
    the end-of-sequence token that closes a turn), never on the prompt or an observation, which is
    exactly the token layout and loss mask of a multi-turn rollout. The last observation is "".
    """

    prompt: str
    turns: list[tuple[str, str]]


@runtime_checkable
class Demonstrating(EnvSuite, Protocol):
    """An EnvSuite whose warm-start imitates a multi-turn teacher instead of ``prompt -> answer``.

    Any suite may also set ``WARM_START: ClassVar[dict]``, fields of flashrl.models.WarmStart it
    overrides for the built-in model (e.g. more steps; flashrl.plugins.warm_start_overrides checks the
    keys, ``flashrl validate`` runs it; docs/models.md lists them).
    """

    def demonstration(self, task: Task, rng: Any) -> Demo:
        """One teacher episode on ``task``; ``rng`` (random.Random) makes it deterministic."""
        ...


# Decoders that keep special tokens print them as text; a model's answer ends at the first one.
EOS_MARKS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>")
_INT_RE = re.compile(r"[+-]?\d{1,64}")


def cut_at_eos(action: str) -> str:
    """``action`` up to its first end-of-sequence mark (``EOS_MARKS``), the whole of it when there is none."""
    for mark in EOS_MARKS:
        action = action.split(mark, 1)[0]
    return action


def states_integer(action: str, answer: str) -> bool:
    """True when ``action`` (model text, possibly ending in an EOS mark) states exactly the integer ``answer``:
    the text up to the mark, stripped, is an integer equal to it (anything else, words or two numbers, is not)."""
    text = cut_at_eos(action).strip()
    if not _INT_RE.fullmatch(text):
        return False
    return int(text) == int(answer)
