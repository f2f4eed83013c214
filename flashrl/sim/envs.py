"""Simulated environments (``env.name = "sim"``) and the character tokenizer the simulator uses.

    controller rollout ---reset(task)---> SimEnv: prompt text (prompt_chars characters), a delay if reset_delay
                       ---step(action)--> SimEnv: sleeps a delay drawn from ``delay`` (not on the
                                          episode's last step when answer_delay is false),
                                          maybe fail-slow (sleeps slow_factor x longer),
                                          maybe fail-stop (raises EnvFailure("crash") or hangs),
                                          returns an observation of obs_chars characters until the
                                          episode's last turn, then done with a 0/1 reward

Every random draw is a pure function of (suite seed, task id, turn, action text, attempt), where
``attempt`` counts identical calls; so a synchronous and an asynchronous run that issue the same
calls see the same delays, failures and rewards, whatever order they issue them in.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

from flashrl.env import EnvFailure, StepResult, Task
from flashrl.sim.engine import FIRST_TEXT_ID, uniform

# --------------------------------------------------------------------------- tokenizer
SIM_CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 .:\n"


class SimTokenizer:
    """One token per character of SIM_CHARSET (ids from 4; 0..3 = pad, bos, eos, unk). Pure Python, fast.

    ``cache=True`` remembers each encoded text and hands out a fresh copy (the caller may keep or
    extend it): for the overhead bench, whose prompts and observations repeat, so the tokenizer's
    cost stays out of what it measures. Off by default: the simulator's texts rarely repeat.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    unk_token_id = 3

    def __init__(self, charset: str = SIM_CHARSET, *, cache: bool = False) -> None:
        self.charset = charset
        self._cache: dict[str, list[int]] | None = {} if cache else None
        self._ids = {ch: FIRST_TEXT_ID + i for i, ch in enumerate(charset)}
        self._chars = ["", "", "", "?"] + list(charset)
        self.vocab_size = len(self._chars)
        if self.vocab_size > 256 or not charset.isascii():
            raise ValueError("SimTokenizer: the charset must be at most 252 ASCII characters")
        table = bytearray(b"?" * 256)
        for i, ch in enumerate(self._chars):
            if ch:
                table[i] = ord(ch)
        self._table = bytes(table)
        self._special = bytes([self.pad_token_id, self.bos_token_id, self.eos_token_id])

    def encode(self, text: str) -> list[int]:
        cache = self._cache
        if cache is not None:
            ids = cache.get(text)
            if ids is None:
                ids = cache[text] = self._encode(text)
            return list(ids)  # a fresh list: the caller may keep or extend it
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        get = self._ids.get
        return [get(ch, self.unk_token_id) for ch in text]

    def decode(self, ids: list[int]) -> str:
        try:
            # C speed for the common case (every id < 256): map bytes, drop the special tokens.
            return bytes(ids).translate(self._table, self._special).decode("ascii")
        except ValueError:
            chars = self._chars
            n = len(chars)
            return "".join(chars[i] if 0 <= i < n else "?" for i in ids)


# --------------------------------------------------------------------------- suite
class DelayModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Seconds one env.step takes: lognormal around ``median_s`` (sigma 0 = constant)."""

    median_s: Annotated[float, Meta(ge=0, description="median step delay")] = 0.0
    sigma: Annotated[float, Meta(ge=0, description="std of the log delay (0 = constant)")] = 0.0
    max_s: Annotated[float, Meta(ge=0, description="cap on one delay (0 = none), as envs/faults.py's max_s")] = 0.0

    def draw(self, u: float) -> float:
        if self.median_s == 0 or self.sigma == 0:
            d = self.median_s
        else:
            d = self.median_s * math.exp(self.sigma * _NORMAL.inv_cdf(u))
        return min(d, self.max_s) if self.max_s > 0 else d


_NORMAL = NormalDist()


class SimEnvParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of the simulated environment."""

    train_size: Annotated[int, Meta(ge=1, description="tasks in the training split")] = 4096
    prompt_chars: Annotated[int, Meta(ge=1, description="prompt length in tokens (one per character)")] = 64
    obs_chars: Annotated[int, Meta(ge=0, description="observation length per turn in tokens")] = 32
    turns_min: Annotated[int, Meta(ge=1, description="fewest environment turns of an episode")] = 1
    turns_max: Annotated[int, Meta(ge=1, description="most environment turns of an episode")] = 1
    turns_mean: Annotated[float, Meta(ge=0, description=(
        "if > 0: turns per episode floor(turns_mean) or one more, drawn so their mean is turns_mean (a measured "
        "mean such as 1.66 turns, which rounding would turn into a tool call for every episode); overrides "
        "turns_min/turns_max"))] = 0.0
    delay: DelayModel = msgspec.field(default_factory=DelayModel)
    reset_delay: Annotated[bool, Meta(description="reset waits a delay too (as [env.params.faults] delays every call)")] = False
    answer_delay: Annotated[bool, Meta(description=(
        "the episode's last step waits a delay too; false for a tool-use env whose final answer goes to a "
        "verifier, not a tool (envs/tools.py delays its tool calls only)"))] = True
    fail_slow_rate: Annotated[float, Meta(ge=0, le=1, description="probability a step is slow (fail-slow)")] = 0.0
    slow_factor: Annotated[float, Meta(ge=1, description="a slow step takes this many times its delay")] = 10.0
    fail_stop_rate: Annotated[float, Meta(ge=0, le=1, description="probability a step fails (fail-stop)")] = 0.0
    fail_stop_mode: Annotated[Literal["raise", "hang"], Meta(description="raise EnvFailure after the delay, or never answer (the controller's timeout must catch it)")] = "raise"
    evaluate: Annotated[bool, Meta(description="offer held-out tasks (off in benchmarks: evals would cost engine time in both variants)")] = False
    p_correct: Annotated[float, Meta(ge=0, le=1, description="probability an episode ends with reward 1")] = 0.5


class SimEnv:
    """One episode of the simulated environment (flashrl.env.Env)."""

    def __init__(self, suite: SimSuite) -> None:
        self._suite = suite
        self._task: Task | None = None
        self._turn = 0
        self._turns = 1

    async def reset(self, task: Task) -> str:
        self._task = task
        self._turn = 0
        self._turns = int(task.meta.get("turns", 1))
        p = self._suite.params
        if p.reset_delay:
            key = f"{task.id}|reset"
            delay = p.delay.draw(uniform(self._suite.seed, f"{key}|{self._suite.count(key)}".encode(), b"delay"))
            if delay > 0:
                await asyncio.sleep(delay)
        return task.prompt

    async def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("SimEnv.step before reset")
        p = self._suite.params
        self._turn += 1
        key = f"{self._task.id}|{self._turn}|{action}"
        attempt = self._suite.count(key)
        key_b = f"{key}|{attempt}".encode()
        seed = self._suite.seed
        delay = p.delay.draw(uniform(seed, key_b, b"delay"))
        if p.fail_stop_rate and uniform(seed, key_b, b"stop") < p.fail_stop_rate:
            self._suite.fail_stops += 1
            if p.fail_stop_mode == "hang":
                await asyncio.Event().wait()  # never answers: only a timeout ends it
            await asyncio.sleep(delay)
            raise EnvFailure("crash", f"simulated fail-stop of task {self._task.id} turn {self._turn}")
        if p.fail_slow_rate and uniform(seed, key_b, b"slow") < p.fail_slow_rate:
            self._suite.fail_slows += 1
            delay *= p.slow_factor
        if not p.answer_delay and self._turn >= self._turns:  # the answer, not a tool call: no latency
            delay = 0.0
        if delay > 0:
            await asyncio.sleep(delay)
        self._suite.steps += 1
        if self._turn >= self._turns:
            reward = 1.0 if uniform(seed, f"{self._task.id}|{action}".encode(), b"reward") < p.p_correct else 0.0
            return StepResult(reward=reward, done=True)
        return StepResult(observation=self._suite.observation, done=False)

    async def close(self) -> None:
        self._task = None


class SimSuite:
    """EnvSuite of the simulator: tasks with fixed-length prompts and a per-task number of turns."""

    Params: ClassVar[type] = SimEnvParams

    def __init__(self, params: SimEnvParams | None = None, seed: int = 0, eval_size: int = 16) -> None:
        self.params = params or SimEnvParams()
        if self.params.turns_max < self.params.turns_min:
            raise ValueError(
                f"env.params.turns_max ({self.params.turns_max}) must be >= env.params.turns_min ({self.params.turns_min})"
            )
        self.seed = seed
        self.eval_size = eval_size
        self.observation = ("obs " * (self.params.obs_chars // 4 + 1))[: self.params.obs_chars]
        self._train = [self._task("t", i) for i in range(self.params.train_size)]
        self._eval = [self._task("e", i) for i in range(eval_size)]
        self._attempts: dict[str, int] = {}
        self.steps = 0
        self.fail_stops = 0
        self.fail_slows = 0

    def _task(self, split: str, i: int) -> Task:
        p = self.params
        head = f"{split}{i}: "
        prompt = (head + "q" * p.prompt_chars)[: p.prompt_chars]
        u = uniform(self.seed, f"{split}{i}".encode(), b"turns")
        if p.turns_mean > 0:
            lo = max(1, math.floor(p.turns_mean))
            turns = lo + (1 if u < p.turns_mean - lo else 0)
        else:
            turns = p.turns_min + int(u * (p.turns_max - p.turns_min + 1))
        return Task(id=f"{split}{i}", prompt=prompt, answer="", meta={"turns": turns})

    def count(self, key: str) -> int:
        n = self._attempts.get(key, 0)
        self._attempts[key] = n + 1
        return n

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval if self.params.evaluate else []

    def make_env(self) -> SimEnv:
        return SimEnv(self)
