"""Small code-writing tasks judged by running the answer in the sandbox (sandbox.py).

    reset(task) -> "Write a Python function f(x) that returns x + 3.\\n"
    step(code)  -> run_sandboxed(HARNESS with the code inside, stdin = nonce + test inputs)
                   -> reward = tests passed / tests, done (single-turn)

The harness execs the answer in its own namespace, calls ``f`` on each test input and prints one
line: a per-run nonce followed by the JSON of the outputs. Expected outputs never enter the child;
the parent compares JSON texts, so ``True`` does not pass for ``1`` nor ``2.0`` for ``2``. An answer
in a ```python fence is taken from the fence. Whatever the code does (loop, exhaust memory, fork,
open a socket) is a policy failure: reward 0 and the sandbox status in ``info``; only a sandbox that
cannot start is an EnvFailure. Limit: the harness shares a process with the answer, so a program
written to forge the result line could; the sandbox protects the machine, not the reward. Where the
sandbox has no isolation to offer (envs/sandbox.py: isolation) the suite refuses to start unless
``env.params.limits.allow_unisolated = true``.

Tasks come from a dozen families with seeded constants and seeded test inputs (``FAMILIES``).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from envs.sandbox import SandboxLimits, isolation, run_sandboxed, unavailable_message
from flashrl.env import Env, EnvFailure, SingleTurnEnv, StepResult, Task, cut_at_eos

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)

HARNESS = """\
import sys as _sys, json as _json
_nonce = _sys.stdin.readline().strip()
_inputs = _json.loads(_sys.stdin.readline())
_ns = {"__name__": "solution"}
_out = []
try:
    exec(compile(%s, "solution.py", "exec"), _ns)
    _f = _ns["f"]
except BaseException as _e:
    _f = None
    print("solution failed to load:", type(_e).__name__, _e, file=_sys.stderr)
for _args in _inputs:
    try:
        _out.append(["ok", _f(*_args)])
    except BaseException as _e:
        _out.append(["raised", type(_e).__name__])
def _safe(o):
    try:
        _json.dumps(o)
        return o
    except (TypeError, ValueError, RecursionError):
        return ["unserializable", ""]
print(_nonce + _json.dumps([_safe(o) for o in _out]))
"""


# --------------------------------------------------------------------------- task families
Gen = Callable[[random.Random], list[Any]]  # one test input: the argument list


def _int(lo: int, hi: int) -> Gen:
    return lambda r: [r.randint(lo, hi)]


def _ints(n: int, lo: int, hi: int) -> Gen:
    return lambda r: [[r.randint(lo, hi) for _ in range(r.randint(1, n))]]


def _word(r: random.Random) -> list[Any]:
    return ["".join(r.choice("abcde") for _ in range(r.randint(0, 8)))]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _fact(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


# name -> (prompt template with {k}, constant range, input generator, reference f(k) -> callable)
FAMILIES: dict[str, tuple[str, tuple[int, int], Gen, Callable[[int], Callable[..., Any]]]] = {
    "add": ("f(x) that returns x + {k}", (1, 9), _int(-50, 50), lambda k: lambda x: x + k),
    "mul": ("f(x) that returns x * {k}", (2, 9), _int(-50, 50), lambda k: lambda x: x * k),
    "square_plus": ("f(x) that returns x squared plus {k}", (0, 9), _int(-20, 20), lambda k: lambda x: x * x + k),
    "abs": ("f(x) that returns the absolute value of x", (0, 0), _int(-99, 99), lambda k: abs),
    "clamp": ("f(x) that returns x limited to the range 0..{k}", (5, 50), _int(-99, 99), lambda k: lambda x: min(max(x, 0), k)),
    "max": ("f(xs) that returns the largest number in the list xs", (0, 0), _ints(6, -50, 50), lambda k: max),
    "sum": ("f(xs) that returns the sum of the list xs", (0, 0), _ints(6, -50, 50), lambda k: sum),
    "count_over": ("f(xs) that returns how many numbers in xs are above {k}", (0, 9), _ints(8, 0, 20),
                   lambda k: lambda xs: sum(x > k for x in xs)),
    "reverse": ("f(s) that returns the string s reversed", (0, 0), _word, lambda k: lambda s: s[::-1]),
    "count_char": ("f(s) that returns how many times 'a' occurs in s", (0, 0), _word, lambda k: lambda s: s.count("a")),
    "palindrome": ("f(s) that returns True if s reads the same backwards, else False", (0, 0),
                   lambda r: [r.choice(["aba", "abba", "ab", "", "abc", "cdc", "aab"])], lambda k: lambda s: s == s[::-1]),
    "even": ("f(x) that returns True if x is even, else False", (0, 0), _int(-50, 50), lambda k: lambda x: x % 2 == 0),
    "digit_sum": ("f(n) that returns the sum of the decimal digits of n (n >= 0)", (0, 0), _int(0, 99999),
                  lambda k: lambda n: sum(map(int, str(n)))),
    "fib": ("f(n) that returns the n-th Fibonacci number (f(0) = 0, f(1) = 1)", (0, 0), _int(0, 25), lambda k: _fib),
    "factorial": ("f(n) that returns n factorial", (0, 0), _int(0, 10), lambda k: _fact),
}  # fmt: skip


def make_task(rng: random.Random, task_id: str, tests: int) -> Task:
    name = rng.choice(sorted(FAMILIES))
    template, (lo, hi), gen, ref = FAMILIES[name]
    k = rng.randint(lo, hi)
    f = ref(k)
    inputs = [gen(rng) for _ in range(tests)]
    expected = [f(*args) for args in inputs]
    prompt = f"Write a Python function {template.format(k=k)}.\n"
    return Task(id=task_id, prompt=prompt, answer="", meta={"family": name, "inputs": inputs, "expected": expected})


def extract_code(action: str) -> str:
    """The code in the first ```python fence of ``action``, or all of ``action`` when there is none."""
    action = cut_at_eos(action)  # decoders that print special tokens
    m = _FENCE.search(action)
    return m.group(1) if m else action


def grade(stdout: str, nonce: str, expected: list[Any]) -> int:
    """Tests passed according to the harness line that starts with ``nonce`` (0 when absent)."""
    for line in stdout.splitlines():
        if line.startswith(nonce):
            try:
                outs = json.loads(line[len(nonce) :])
            except ValueError:
                return 0
            if not isinstance(outs, list) or len(outs) != len(expected):
                return 0
            return sum(
                isinstance(o, list) and len(o) == 2 and o[0] == "ok" and json.dumps(o[1]) == json.dumps(e)
                for o, e in zip(outs, expected)
            )
    return 0


# --------------------------------------------------------------------------- env and suite
class CodeParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "code"``."""

    tests: Annotated[int, Meta(ge=1, le=50, description="test cases per task")] = 5
    train_size: Annotated[int, Meta(ge=1, le=1000000, description="tasks in the training split")] = 2000
    max_parallel: Annotated[int, Meta(ge=1, le=256, description="sandboxes running at once (per suite)")] = 2
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)


class CodeEnv(SingleTurnEnv):
    def __init__(self, params: CodeParams, gate: asyncio.Semaphore) -> None:
        super().__init__()
        self.params = params
        self.gate = gate

    async def judge(self, task: Task, action: str) -> StepResult:
        inputs, expected = task.meta["inputs"], task.meta["expected"]
        nonce = "RESULT-" + secrets.token_hex(8)
        program = HARNESS % repr(extract_code(action))
        try:
            async with self.gate:
                res = await run_sandboxed(program, nonce + "\n" + json.dumps(inputs) + "\n", self.params.limits)
        except OSError as e:
            raise EnvFailure("crash", f"sandbox failed: {e}") from e  # setup or I/O (envs/sandbox.py)
        passed = grade(res.stdout, nonce, expected) if res.status == "ok" else 0
        info = {"status": res.status, "passed": passed, "tests": len(expected), "seconds": round(res.seconds, 3)}
        return StepResult(reward=passed / len(expected), done=True, info=info)


class CodeSuite:
    Params: ClassVar[type] = CodeParams

    def __init__(self, params: CodeParams, seed: int = 0, eval_size: int = 200) -> None:
        if isolation(params.limits) is None and not params.limits.allow_unisolated:
            # Checked here so that `flashrl validate/run` stop with a config error before any process starts.
            raise ValueError(unavailable_message(params.limits, key="env.params.limits.allow_unisolated"))
        self.params = params
        tr, ev = random.Random(f"code:train:{seed}"), random.Random(f"code:eval:{seed}")
        self._train = [make_task(tr, f"code-train-{i}", params.tests) for i in range(params.train_size)]
        self._eval = [make_task(ev, f"code-eval-{i}", params.tests) for i in range(eval_size)]
        self._gate = asyncio.Semaphore(params.max_parallel)

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    def make_env(self) -> Env:
        return CodeEnv(self.params, self._gate)
