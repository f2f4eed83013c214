"""Countdown (the ROLL Flash / TinyZero task): reach a target with the given numbers and + - * /.

    reset(task) -> "Make 22 from 3 5 7:\\n"          compact: the built-in model sees 128 characters
    step("3*5+7") -> done, reward 1.0 (hits 22) | format_reward (a valid expression that misses) | 0

The verifier never evaluates model text as code. ``verify`` parses it with ``ast`` and walks the
tree itself, admitting only int literals, the binary operators + - * /, and parentheses (which the
parser folds away). Each given number may be used at most as often as it was given (not all must be
used). Arithmetic is exact (``fractions.Fraction``), so 7/2*2 = 7 and 1/3*3 = 1; division by zero
is an invalid expression. Text after "=" is ignored ("3*5+7=22" is judged by "3*5+7"), as is any
line after the first. The input is capped at ``MAX_EXPR_CHARS`` before parsing, so neither a huge
literal nor deep nesting reaches the parser.

format_reward (default 0.1, TinyZero's format score for Countdown) rewards a well-formed expression
over the allowed numbers that misses the target; set it to 0 for the paper's pure 0/1 reward.

Tasks: ``count`` numbers in 1..max_number; the target is the value of a random expression over a
random subset of at least two of them (so every task is solvable), a positive integer <= max_target.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from flashrl.env import Env, SingleTurnEnv, StepResult, Task

MAX_EXPR_CHARS = 64
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class CountdownParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "countdown"``."""

    count: Annotated[int, Meta(ge=2, le=6, description="numbers given per task")] = 3
    max_number: Annotated[int, Meta(ge=1, le=100, description="numbers are drawn from 1..max_number")] = 10
    max_target: Annotated[int, Meta(ge=1, le=100000, description="largest target")] = 100
    format_reward: Annotated[float, Meta(ge=0, le=1, description="reward for a valid expression that misses the target")] = 0.1
    train_size: Annotated[int, Meta(ge=1, le=1000000, description="tasks in the training split")] = 10000


class Verdict(msgspec.Struct, frozen=True):
    """What the verifier concluded: ``value`` when the expression is valid, else ``reason``."""

    valid: bool
    value: Fraction | None = None
    reason: str = ""


class _Invalid(Exception):
    pass


def _eval(node: ast.AST, budget: Counter[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: excluded
        if budget[node.value] <= 0:
            raise _Invalid(f"number {node.value} not given (or used too often)")
        budget[node.value] -= 1
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left, budget), _eval(node.right, budget)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise _Invalid("division by zero")
        return left / right
    raise _Invalid(f"{type(node).__name__} is not allowed (only int literals, + - * /, parentheses)")


def verify(expression: str, numbers: Sequence[int]) -> Verdict:
    """Judge ``expression`` over ``numbers`` without executing it. Never raises on any input."""
    # "<" starts an end-of-sequence mark ("<eos>") when the decoder prints special tokens.
    text = expression.strip().split("\n", 1)[0].split("=", 1)[0].split("<", 1)[0].strip()
    if not text:
        return Verdict(False, reason="empty")
    if len(text) > MAX_EXPR_CHARS:
        return Verdict(False, reason=f"longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return Verdict(False, reason=f"not an expression: {type(e).__name__}")
    try:
        value = _eval(tree.body, Counter(numbers))
    except _Invalid as e:
        return Verdict(False, reason=str(e))
    except RecursionError:
        return Verdict(False, reason="nested too deeply")
    return Verdict(True, value=value)


def score(expression: str, numbers: Sequence[int], target: int, format_reward: float) -> tuple[float, Verdict]:
    v = verify(expression, numbers)
    if not v.valid:
        return 0.0, v
    return (1.0 if v.value == target else format_reward), v


def make_task(rng: random.Random, p: CountdownParams, task_id: str) -> Task:
    """A solvable task: the target is the value of a random expression over some of the numbers."""
    while True:
        numbers = [rng.randint(1, p.max_number) for _ in range(p.count)]
        used = rng.sample(numbers, rng.randint(2, p.count))
        value, expr = Fraction(used[0]), str(used[0])
        for n in used[1:]:
            op = rng.choice("+-*/")  # numbers are >= 1: no division by zero
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
            expr = f"({expr}){op}{n}"
        if value.denominator == 1 and 1 <= value <= p.max_target:
            target = int(value)
            prompt = f"Make {target} from {' '.join(map(str, numbers))}:\n"
            return Task(id=task_id, prompt=prompt, answer=str(target), meta={"numbers": numbers, "solution": expr})


class CountdownEnv(SingleTurnEnv):
    """Single-turn: reset returns the prompt, one step judges the answer and ends the episode."""

    def __init__(self, params: CountdownParams) -> None:
        super().__init__()
        self.params = params

    async def judge(self, task: Task, action: str) -> StepResult:
        reward, v = score(action, task.meta["numbers"], int(task.answer), self.params.format_reward)
        info: dict[str, Any] = {"valid": v.valid, "correct": reward == 1.0}
        if not v.valid:
            info["reason"] = v.reason
        return StepResult(reward=reward, done=True, info=info)


class CountdownSuite:
    Params: ClassVar[type] = CountdownParams

    def __init__(self, params: CountdownParams, seed: int = 0, eval_size: int = 200) -> None:
        self.params = params
        train_rng = random.Random(f"countdown:train:{seed}")
        eval_rng = random.Random(f"countdown:eval:{seed}")
        self._train = [make_task(train_rng, params, f"countdown-train-{i}") for i in range(params.train_size)]
        self._eval = [make_task(eval_rng, params, f"countdown-eval-{i}") for i in range(eval_size)]

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    def make_env(self) -> Env:
        return CountdownEnv(self.params)
