"""Tool use: the model multiplies two numbers by calling a calculator, then states the product.

    reset(task)            -> "37*48="                      (the prompt: two 2-digit operands)
    step("calc(37*48)")    -> "=1776\\n"   (not done)        a tool call: the calculator's answer, after a
                                                             delay drawn from ``latency`` (module notes)
    step("1776")           -> done, reward 1.0               any other text is the final answer
    step("calc(3748)")     -> "error: write calc(a*b)\\n"    a malformed call: a useful observation, a turn used

A trajectory therefore reads ``37*48=calc(37*48)=1776\\n1776``: the model writes the call and the
answer, the environment writes ``=1776\\n`` (or an error line); all inside the built-in tokenizer's
charset and under 40 characters. The product of two 2-digit numbers is what the tiny character-level
model cannot work out in its head, so the tool is how it scores: the final answer is exact (the text
up to the end-of-sequence mark, stripped, is the product: ``flashrl.env.states_integer``), reward 1 or
0; a right answer without a call is rewarded too (the task is hard enough that it is rare: the
``direct`` and ``direct_correct`` metrics show it). ``max_turns`` (default 3: a malformed call, a
call and the answer) ends an episode that never answers, reward 0. The calculator evaluates what the
call says, so a call with the wrong operands returns a wrong (but well-formed) product; it accepts
``a*b``, ``a+b`` and ``a-b`` of integers up to 6 digits, spaces allowed; anything else after
``calc`` is malformed. Nothing the model writes raises: a policy error is a reward, never an
exception.

Per-trajectory metrics (``StepResult.info["metrics"]``, averaged into the step records and evals as
``reward/<name>``): ``called`` (the episode made a well-formed call), ``direct`` (it answered without
one), ``malformed`` (it made a malformed call), ``copied`` (its answer equals the last calculator
result).

Splits (held-out shares no prompt and no target with training): every pair ``(a, b)`` with both in
``[min_operand, max_operand]`` is drawn in a seeded order; the held-out split is its first
``eval_size`` pairs, the training split the next pairs whose product is none of the held-out
products (so neither ``b*a`` of a held-out ``a*b`` nor another pair with the same product trains),
up to ``train_size``. Identical for a seed, different for another.

Latency (``[env.params.latency]``): each well-formed tool call waits a delay drawn from a lognormal
fitted to ``median_s`` and ``p99_s`` (``mu = ln median``, ``sigma = ln(p99 / median) / z_0.99``),
capped at ``max_s``; the final answer costs nothing (a verifier, not a tool). The defaults (median
0.2 s, p99 2 s) stand for a sandbox or web call. ``asyncio.sleep``, so the simulator's virtual clock
drives it; seeded per environment instance. Faults (hangs, crashes, garbage, worker exits) come from
the shared ``[env.params.faults]`` table (envs/faults.py); run it in worker processes with
``env.name = "remote"``, ``inner = "tools"`` (configs/tools.toml).

Warm-start teacher (``ToolsSuite.demonstration``, flashrl.env.Demonstrating): it plants the call
format, not the policy. With probability ``teacher_direct`` it answers at once without calling
(stating the true product, which the model cannot compute: imitating it gives a 4-digit guess);
otherwise it calls, with probability ``teacher_malformed`` first writing a malformed call
(``calc(3748)``) and then the right one after the error line; with probability
``teacher_operand_slip`` the call has one operand digit wrong (and it copies the wrong product);
with probability ``teacher_copy_slip`` it copies the calculator's result with one digit changed.
With the defaults (0.5, 0.1, 0.05, 0.1) the teacher itself wins 0.5 + 0.5 * 0.95 * 0.9 = 93% (its direct
answers are right); a model that imitates it wins only through the calls, about 0.5 * 0.95 * 0.9 = 43%
at best (seed 0: 20% sampled at T = 1 with slips of 0.1 and 0.15), while the
policy "always call, copy exactly" wins every time: RL has the decision to call and the copying to fix.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from flashrl.env import Demo, Env, StepResult, Task, cut_at_eos, states_integer

Z99 = 2.3263478740408408  # the standard normal's 0.99 quantile
_CALL = re.compile(r"calc\((.*)\)", re.DOTALL)
_EXPR = re.compile(r"\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*")
MALFORMED_OBS = "error: write calc(a*b)\n"


class ToolLatency(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params.latency]``: the delay of one tool call, lognormal with this median and 99th percentile."""

    median_s: Annotated[float, Meta(ge=0, description="median delay of one tool call in seconds (0 = no delay)")] = 0.2
    p99_s: Annotated[float, Meta(ge=0, description="99th percentile of the delay, >= median_s (the tail)")] = 2.0
    max_s: Annotated[float, Meta(gt=0, description="cap on one delay (keep it under rollout.turn_timeout_s)")] = 10.0

    def __post_init__(self) -> None:
        if self.p99_s < self.median_s:
            raise ValueError(f"latency: p99_s={self.p99_s} is below median_s={self.median_s}; the p99 is the tail, "
                             "raise it (or lower median_s)")

    @property
    def sigma(self) -> float:
        """Log-space standard deviation of the fitted lognormal (0 when p99 == median: a constant delay)."""
        if self.median_s == 0:
            return 0.0
        return math.log(self.p99_s / self.median_s) / Z99

    def draw(self, rng: random.Random) -> float:
        """One delay in seconds: exp(N(ln median_s, sigma)), capped at max_s; 0 when median_s is 0."""
        if self.median_s == 0:
            return 0.0
        return min(rng.lognormvariate(math.log(self.median_s), self.sigma), self.max_s)


class ToolsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "tools"``."""

    min_operand: Annotated[int, Meta(ge=0, le=99_999, description="smallest operand")] = 10
    max_operand: Annotated[int, Meta(ge=1, le=99_999, description="largest operand")] = 99
    max_turns: Annotated[int, Meta(ge=1, le=16, description="actions per episode (calls + the answer); past it reward 0")] = 3
    train_size: Annotated[int, Meta(ge=1, le=10_000_000, description="training problems (capped by what the split leaves)")] = 5000
    latency: ToolLatency = msgspec.field(default_factory=ToolLatency)
    teacher_direct: Annotated[float, Meta(ge=0, le=1, description=(
        "warm-start teacher: chance it answers without calling the tool (the policy RL must fix)"))] = 0.5
    teacher_malformed: Annotated[float, Meta(ge=0, le=1, description=(
        "warm-start teacher: chance its first call is malformed (it retries after the error line)"))] = 0.1
    teacher_operand_slip: Annotated[float, Meta(ge=0, le=1, description=(
        "warm-start teacher: chance its call has one operand digit wrong"))] = 0.05
    teacher_copy_slip: Annotated[float, Meta(ge=0, le=1, description=(
        "warm-start teacher: chance it copies the calculator's result with one digit changed"))] = 0.1

    def __post_init__(self) -> None:
        if self.min_operand > self.max_operand:
            raise ValueError(f"env.params.min_operand: {self.min_operand} is above max_operand={self.max_operand}; swap them")


def parse_prompt(prompt: str) -> tuple[int, int]:
    """(a, b) of a prompt "a*b="; ValueError naming the prompt otherwise."""
    m = re.fullmatch(r"(\d+)\*(\d+)=", prompt)
    if m is None:
        raise ValueError(f"tools: prompt {prompt!r} is not of the form 'a*b='")
    return int(m.group(1)), int(m.group(2))


def parse_call(action: str) -> tuple[bool, int | None]:
    """Read model text as a tool call: (is_call, value). ``is_call``: the text (up to the end-of-sequence
    mark, stripped) starts with "calc"; ``value``: the calculator's result of a well-formed call
    ``calc(a*b)`` (also + and -), None when the call is malformed. Never raises."""
    text = cut_at_eos(action).strip()
    if not text.startswith("calc"):
        return False, None
    m = _CALL.fullmatch(text)
    e = _EXPR.fullmatch(m.group(1)) if m else None
    if e is None:
        return True, None
    x, op, y = int(e.group(1)), e.group(2), int(e.group(3))
    return True, x * y if op == "*" else x + y if op == "+" else x - y


class ToolsEnv:
    """One episode: tool calls answered with the calculator's result (after the drawn latency), then the answer."""

    def __init__(self, params: ToolsParams, rng: random.Random, counters: Counter[str] | None = None) -> None:
        self.params = params
        self.rng = rng
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.task: Task | None = None
        self.turns = 0
        self.calls = 0
        self.malformed = 0
        self.last_value: int | None = None
        self.done = True
        self.transcript = ""

    async def reset(self, task: Task) -> str:
        parse_prompt(task.prompt)  # a task of another env is a bug of the caller: say so now
        self.task, self.turns, self.calls, self.malformed, self.last_value, self.done = task, 0, 0, 0, None, False
        self.transcript = task.prompt
        return task.prompt

    def _metrics(self, answered: bool, correct: bool, text: str) -> dict[str, float]:
        copied = answered and self.last_value is not None and text == str(self.last_value)
        return {"called": float(self.calls > 0), "direct": float(answered and self.calls == 0),
                "direct_correct": float(answered and self.calls == 0 and correct),
                "malformed": float(self.malformed > 0), "copied": float(copied), "tool_calls": float(self.calls)}

    async def step(self, action: str) -> StepResult:
        if self.done or self.task is None:
            raise RuntimeError("tools: step() after the episode ended or before reset(); call reset(task) first")
        self.turns += 1
        self.transcript += action
        is_call, value = parse_call(action)
        if not is_call:  # the final answer
            self.done = True
            text = cut_at_eos(action).strip()
            ok = states_integer(action, self.task.answer)
            return StepResult(reward=1.0 if ok else 0.0, done=True,
                              info={"correct": ok, "turns": self.turns, "metrics": self._metrics(True, ok, text)})
        if value is None:
            self.malformed += 1
            self.counters["malformed_calls"] += 1
            obs = MALFORMED_OBS
        else:
            self.calls += 1
            self.last_value = value
            delay = self.params.latency.draw(self.rng)
            self.counters["tool_calls"] += 1
            self.counters["tool_latency_s"] += delay  # type: ignore[assignment]  # seconds beside the counts
            if delay > 0:
                await asyncio.sleep(delay)
            obs = f"={value}\n"
        if self.turns >= self.params.max_turns:  # out of turns without an answer
            self.done = True
            return StepResult(reward=0.0, done=True,
                              info={"correct": False, "turns": self.turns, "metrics": self._metrics(False, False, "")})
        self.transcript += obs
        return StepResult(observation=obs, reward=0.0, done=False, info={"turns": self.turns})

    async def close(self) -> None:
        self.done = True


def _slip(rng: random.Random, n: int) -> int:
    """``n`` with one digit changed (never the leading digit to 0): the teacher's copying slip."""
    s = list(str(n))
    i = rng.randrange(len(s))
    choices = [d for d in "0123456789" if d != s[i] and not (i == 0 and d == "0" and len(s) > 1)]
    s[i] = rng.choice(choices)
    return int("".join(s))


class ToolsSuite:
    """Seeded train/held-out splits that share no prompt and no product (module docstring)."""

    Params: ClassVar[type] = ToolsParams
    # The built-in model's warm-start (flashrl.models.WarmStart overrides): imitate the teacher for a fixed
    # number of steps of 32 episodes (greedy success is no stop signal: the teacher's mode already calls
    # the tool; at step 200 of 64 the greedy probe was already at 85%).
    WARM_START: ClassVar[dict[str, Any]] = {"max_steps": 500, "batch": 32, "target_accuracy": 1.0,
                                            "check_every": 250, "probe_size": 128}

    def __init__(self, params: ToolsParams, seed: int = 0, eval_size: int = 200) -> None:
        self.params = params
        self.seed = seed
        self.counters: Counter[str] = Counter()
        self._instances = itertools.count()
        lo, hi = params.min_operand, params.max_operand
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        if eval_size >= len(pairs):
            raise ValueError(f"env.eval_size: {eval_size} held-out problems leave none to train on ({len(pairs)} "
                             f"pairs in {lo}..{hi}); lower eval_size or widen min_operand..max_operand")
        random.Random(f"tools:{seed}").shuffle(pairs)
        held = pairs[:eval_size]
        products = {a * b for a, b in held}
        train = [(a, b) for a, b in pairs[eval_size:] if a * b not in products][: params.train_size]
        if not train:
            raise ValueError("env.eval_size: the held-out products cover every training pair; lower eval_size")
        self._eval = [self._task(f"eval-{i}", a, b) for i, (a, b) in enumerate(held)]
        self._train = [self._task(f"train-{i}", a, b) for i, (a, b) in enumerate(train)]

    @staticmethod
    def _task(tid: str, a: int, b: int) -> Task:
        return Task(id=tid, prompt=f"{a}*{b}=", answer=str(a * b))

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    @property
    def max_turns(self) -> int:
        """The most turns of an episode (flashrl.env.MultiTurn: validate wants rollout.max_turns this high)."""
        return self.params.max_turns

    def make_env(self) -> Env:
        rng = random.Random(f"tools-latency:{self.seed}:{next(self._instances)}")
        return ToolsEnv(self.params, rng, self.counters)

    def demonstration(self, task: Task, rng: random.Random) -> Demo:
        """One episode of the warm-start teacher (module docstring), with the env's own observations."""
        p = self.params
        a, b = parse_prompt(task.prompt)
        if p.max_turns < 2 or rng.random() < p.teacher_direct:
            return Demo(prompt=task.prompt, turns=[(str(a * b), "")])
        turns: list[tuple[str, str]] = []
        if rng.random() < p.teacher_malformed and p.max_turns >= 3:
            turns.append((f"calc({a}{b})", MALFORMED_OBS))
        x, y = a, b
        if rng.random() < p.teacher_operand_slip:
            x, y = (_slip(rng, a), b) if rng.random() < 0.5 else (a, _slip(rng, b))
        value = x * y
        turns.append((f"calc({x}*{y})", f"={value}\n"))
        answer = _slip(rng, value) if rng.random() < p.teacher_copy_slip else value
        turns.append((str(answer), ""))
        return Demo(prompt=task.prompt, turns=turns)


__all__ = ["MALFORMED_OBS", "ToolLatency", "ToolsEnv", "ToolsParams", "ToolsSuite", "parse_call", "parse_prompt"]
