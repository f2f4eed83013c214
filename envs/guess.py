"""Guess the hidden number: a multi-turn text game the built-in char-level model learns in minutes.

    reset(task) -> "Guess 0-9:\\n"                  (the same prompt for every task; the number is hidden)
    step("5")   -> " higher\\n"  (not done)         the hidden number is above 5
    step("8")   -> " lower\\n"   (not done)         ... below 8
    step("7")   -> done, reward = discount ** (turns - 1)       found on turn 3 of max_turns
    turn max_turns without finding it -> done, reward 0

A trajectory is therefore ``Guess 0-9:\\n5 higher\\n8 lower\\n7``: the model writes only digits, the
environment only " higher\\n" / " lower\\n" / " invalid\\n", all inside the built-in tokenizer's
charset and short enough for max_model_len 128 (5 turns of 0..15 take under 50 characters).

Actions are read leniently: the first run of digits counts (" 7\\n" and "7 higher" both guess 7);
an action without digits or outside the range is "invalid" and uses up a turn. With 0..9 and
max_turns 4, binary search always wins, so a perfect policy exists; any ordered search scores.
Delays and faults for this game are configured like every env's (``[env.params.faults]``, faults.py).

Warm-start teacher (``GuessSuite.demonstration``, used by the built-in model's supervised phase): each
turn it ignores the feedback with probability ``teacher_ignore`` (a guess anywhere in 0..max_number)
and otherwise guesses uniformly among the numbers the feedback still allows. Imitating it gives a policy
that wins about half its episodes (0..9, 4 turns, ignore 0.5: success 0.55, reward 0.46 by simulation);
always using the feedback wins 76%, and bisecting always wins (reward 0.82): RL has room on both counts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from flashrl.env import Demo, Env, StepResult, Task

_DIGITS = re.compile(r"\d+")


class GuessParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "guess"``."""

    max_number: Annotated[int, Meta(ge=1, le=99, description="the hidden number is in 0..max_number")] = 9
    max_turns: Annotated[int, Meta(ge=1, le=32, description="guesses allowed per episode")] = 4
    discount: Annotated[float, Meta(gt=0, le=1, description="reward = discount ** (turns - 1) when found")] = 0.9
    train_size: Annotated[int, Meta(ge=1, description="tasks in the training split")] = 10000
    teacher_ignore: Annotated[float, Meta(ge=0, le=1, description=(
        "warm-start teacher: chance per turn that it ignores the feedback and guesses anywhere"))] = 0.5


def feedback(target: int, guess: int, max_number: int) -> str:
    """The observation after a wrong guess: " higher\\n", " lower\\n" or " invalid\\n" (out of range)."""
    if not 0 <= guess <= max_number:
        return " invalid\n"
    return " higher\n" if target > guess else " lower\n"


class GuessEnv:
    """One episode of the game; ``transcript`` holds the text so far (for tests and debugging)."""

    def __init__(self, params: GuessParams) -> None:
        self.params = params
        self.target = -1
        self.turns = 0
        self.done = True
        self.transcript = ""

    async def reset(self, task: Task) -> str:
        target = int(task.answer)
        if not 0 <= target <= self.params.max_number:
            raise ValueError(f"guess: task {task.id} has answer {target}, outside 0..{self.params.max_number}")
        self.target, self.turns, self.done = target, 0, False
        self.transcript = task.prompt
        return task.prompt

    async def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("guess: step() after the episode ended; call reset() first")
        self.turns += 1
        m = _DIGITS.search(action)
        guess = int(m.group()) if m and len(m.group()) <= 3 else -1
        self.transcript += action
        info = {"turns": self.turns, "guess": guess}
        if guess == self.target:
            self.done = True
            return StepResult(reward=self.params.discount ** (self.turns - 1), done=True, info=info | {"found": True, "correct": True})
        if self.turns >= self.params.max_turns:
            self.done = True
            return StepResult(reward=0.0, done=True, info=info | {"found": False, "correct": False})
        obs = feedback(self.target, guess, self.params.max_number)
        self.transcript += obs
        return StepResult(observation=obs, reward=0.0, done=False, info=info)

    async def close(self) -> None:
        self.done = True


class GuessSuite:
    """Tasks are hidden numbers drawn with a seeded RNG; train and eval use separate streams."""

    Params: ClassVar[type] = GuessParams
    # Warm-start (flashrl.models.WarmStart overrides): imitate the teacher for a fixed number of steps;
    # greedy success is not a useful stop signal here (the teacher's mode already plays well).
    WARM_START: ClassVar[dict] = {"max_steps": 600, "target_accuracy": 1.0, "check_every": 100, "probe_size": 256}

    def __init__(self, params: GuessParams, seed: int = 0, eval_size: int = 200) -> None:
        self.params = params
        self.seed = seed
        self.eval_size = eval_size
        self._train = self._split("train", params.train_size)
        self._eval = self._split("eval", eval_size)

    def prompt(self) -> str:
        return f"Guess 0-{self.params.max_number}:\n"

    def _split(self, name: str, n: int) -> list[Task]:
        rng = random.Random(f"guess:{name}:{self.seed}")
        prompt = self.prompt()
        return [
            Task(id=f"guess-{name}-{i}", prompt=prompt, answer=str(rng.randint(0, self.params.max_number)))
            for i in range(n)
        ]

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    @property
    def max_turns(self) -> int:
        """The most guesses of an episode (flashrl.env.MultiTurn: validate wants rollout.max_turns this high)."""
        return self.params.max_turns

    def make_env(self) -> Env:
        return GuessEnv(self.params)

    def demonstration(self, task: Task, rng: random.Random) -> Demo:
        """One episode of the warm-start teacher (see the module docstring), as the env would answer it."""
        p = self.params
        target, lo, hi = int(task.answer), 0, p.max_number
        turns: list[tuple[str, str]] = []
        for turn in range(1, p.max_turns + 1):
            guess = rng.randint(0, p.max_number) if rng.random() < p.teacher_ignore else rng.randint(lo, hi)
            if guess == target or turn == p.max_turns:
                turns.append((str(guess), ""))
                break
            if guess < target:
                lo = max(lo, guess + 1)
            else:
                hi = min(hi, guess - 1)
            turns.append((str(guess), feedback(target, guess, p.max_number)))
        return Demo(prompt=task.prompt, turns=turns)
