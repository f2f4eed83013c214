"""Digits in turns: an image in every turn's observation (issue 54), the multi-turn form of envs/digits.py.

    suite = DigitsTurnsSuite(DigitsTurnsSuite.Params(turns=2), seed=0, eval_size=30)
    task = suite.train_tasks()[0]   # prompt "<image>read:", meta {"images": [PNG 1], "more": [{"answer", "image"}]}
    env = suite.make_env(); await env.reset(task)
    await env.step("47")   # -> StepResult(observation="<image>read:", images=[PNG 2], reward=0.5 if right, done=False)
    await env.step("13")   # -> StepResult(reward=0.5 if right, done=True, info={"correct": both right, ...})

Turn 1 is the digits task as it is (its prompt and image); after each answer but the last, the observation is
another ``<image>`` with the same "read:" text and carries that image (``StepResult.images``, one per
``<image>``); the episode ends with the answer to the ``turns``-th image. Every number of an episode comes from
one split of envs.digits.DigitsSuite (the same seed and ``eval_size``): a training episode's later images are
other training images (drawn with a seeded RNG), a held-out episode's are other held-out images, so the
held-out numbers never appear in training, in any turn.

Reward: 1/turns per number read right (the verifier of envs/digits.py), so an episode's reward is the
fraction read right. Why a fraction, not all-or-nothing: each reading keeps its own credit (a right turn 1
is rewarded whatever turn 2 gives), the group's rewards then differ more often (the warm-start reads ~60% of
the numbers right, so both right in only ~36% of episodes), and the reward equals the per-number accuracy,
comparable with the single-turn task's. ``info["correct"]`` (eval/accuracy) is whether all were read right;
``info["metrics"]["turn<k>"]`` is turn k's reading (logged as reward/turn<k>, eval/reward/turn<k>).

The built-in model: builtin:vlm's warm-start is the single-turn one of envs.digits (prompt -> the teacher's
reading); this suite's tasks are DigitsSuite's, so ``wrapped_env`` names DigitsSuite and its params (without
``turns``): the model's cache key, and its build, are those of the digits config with the same seed, params
and eval_size (configs/vlm.toml) — one build serves both. Unlike ``remote`` this suite is not a
flashrl.env.Wrapping (no ``task_suite``): ``flashrl validate`` sees its own ``max_turns``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from envs.digits import IMAGE_TOKEN, DigitsSuite, verify
from flashrl.env import StepResult, Task

DIGITS = "envs.digits:DigitsSuite"


class TurnsParams(DigitsSuite.Params, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of the digits-in-turns environment: envs.digits' params and ``turns``."""

    turns: Annotated[int, Meta(ge=1, le=8, description="images (numbers to read) per episode, one per turn")] = 2


class DigitsTurnsEnv:
    """One episode: read the task's image, then each later image the observations carry."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.answers: list[str] = []
        self.images: list[Any] = []
        self.turn = self.right = 0
        self.done = True

    async def reset(self, task: Task) -> str:
        more = task.meta.get("more", [])
        if len(more) != self.turns - 1:
            raise ValueError(f"digits_turns: task {task.id} has {len(more) + 1} numbers, this env reads {self.turns}")
        self.answers = [task.answer] + [m["answer"] for m in more]
        self.images = [None] + [m["image"] for m in more]
        self.turn, self.right, self.done = 0, 0, False
        return task.prompt

    async def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("digits_turns: step() after the episode ended; call reset() first")
        ok = verify(action, self.answers[self.turn])
        self.turn += 1
        self.right += ok
        info: dict[str, Any] = {"turn": self.turn, "metrics": {f"turn{self.turn}": ok}}
        reward = (1.0 if ok else 0.0) / self.turns
        if self.turn >= self.turns:
            self.done = True
            return StepResult(reward=reward, done=True, info=info | {"correct": self.right == self.turns})
        return StepResult(observation=f"{IMAGE_TOKEN}read:", images=[self.images[self.turn]], reward=reward,
                          done=False, info=info)

    async def close(self) -> None:
        self.done = True


class DigitsTurnsSuite:
    """DigitsSuite's tasks (turn 1), each with ``turns - 1`` more numbers of its own split for later turns."""

    Params: ClassVar[type] = TurnsParams
    WARM_START: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: TurnsParams, seed: int = 0, eval_size: int = 30) -> None:
        self.params = params
        inner_params = msgspec.convert(_inner_params(msgspec.to_builtins(params)), DigitsSuite.Params)
        inner = DigitsSuite(inner_params, seed, eval_size)
        self.digits = inner
        rng = random.Random(f"digits_turns:{seed}")
        self._train = self._episodes(inner.train_tasks(), rng)
        self._eval = self._episodes(inner.eval_tasks(), rng)

    def _episodes(self, split: Sequence[Task], rng: random.Random) -> list[Task]:
        """Each task of ``split`` with ``turns - 1`` other tasks of the same split (their number and image)."""
        out = []
        for i, t in enumerate(split):
            others = [split[(i + rng.randrange(1, len(split))) % len(split)] for _ in range(self.params.turns - 1)]
            more = [{"answer": o.answer, "image": o.meta["images"][0]} for o in others]
            out.append(Task(id=t.id, prompt=t.prompt, answer=t.answer, meta={"images": t.meta["images"], "more": more}))
        return out

    @staticmethod
    def wrapped_env(params: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        """(envs.digits' name, its params, their key): the tasks and the warm-start this suite shares
        (flashrl.plugins.task_env; builtin:vlm's cache key looks there)."""
        return DIGITS, _inner_params(params), "env.params"

    @property
    def max_turns(self) -> int:
        return self.params.turns

    def teacher_answer(self, task: Task, rng: random.Random) -> str:
        return self.digits.teacher_answer(task, rng)

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    def make_env(self) -> DigitsTurnsEnv:
        return DigitsTurnsEnv(self.params.turns)


def _inner_params(params: dict[str, Any]) -> dict[str, Any]:
    """``[env.params]`` without ``turns``: envs.digits' params."""
    return {k: v for k, v in params.items() if k != "turns"}
