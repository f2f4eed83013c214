"""Column addition written out line by line: the built-in long-tail task ("347+85=" -> a scratchpad).

    suite = ScratchpadSuite(ScratchpadParams(), seed=0, eval_size=400)
    env = suite.make_env(); prompt = await env.reset(task)            # "347+85="
    res = await env.step("34+8,1,2\\n3+,1,32\\n+,0,432\\n432")         # reward 1.0

The response is the teacher's written-out column addition, one line per column from the units up:
each line states what is left of the two operands (each loses its last digit), the carry out of the
column just added and the digits of the sum found so far; the last line is the sum::

    347+85=          (prompt)
    34+8,1,2         7+5 = 12: write 2, carry 1
    3+,1,32          4+8+1 = 13: write 3, carry 1 (85 is used up)
    +,0,432          3+1 = 4: write 4, carry 0
    432              the answer (a carry left over would lead it)

A problem with d columns has d lines of about 2d characters each, so the response grows as
1.5 d^2: 19 tokens at d=2, 142 at d=8, 207 at d=10 (with the end-of-sequence token). The number
of columns is drawn from a power law, ``P(d) ~ (d - min_digits + 1) ** -size_exponent`` for
min_digits <= d <= max_digits (default 2..10, exponent 1.8: 60% two-column problems, 2.6% with 9
or 10), so most responses are short and a few in a hundred are 9-11x the median: the long tail that
holds a synchronous batch hostage. (With exponent 2, 1.8% with 9 or 10, the warm-started model's
p99/median on seed 0's 400 held-out problems was 8.2, too close to 8 to hold on every seed; with
1.8 the task's own answers give p99/median 9.1 on those problems and 10.4 on the training split.)
Both operands are uniform in [0, 10**d), so one of them may have fewer digits (it then drops out of
the lines early, as 85 does above).

The verifier is exact, and by default (``check_scratchpad``) it checks the whole response, not only
the answer: reward 1 when the text up to the end-of-sequence mark, with trailing whitespace stripped,
is exactly the written-out addition above, else 0. Why the whole scratchpad: each line follows from
the line before, so "consistent" and "exactly the teacher's" are the same thing; a correct response
then has one length per problem, and RL cannot shorten the tail by learning to skip lines (the
length distribution is the task's, not a drift of the policy's, which is what a long-tail benchmark
compares). ``check_scratchpad = false`` scores the last line alone (any scratchpad, even none).
``info`` says which part failed: ``answer_ok`` (the last line states the sum) and ``scratchpad_ok``.
Malformed text (empty, words, a missing line) is a wrong answer, reward 0, never an error.

Splits: eval_size held-out problems, then train_size training problems, drawn from one seeded stream
without repeats (a repeat is redrawn at the same size, so the sizes keep their distribution), so the
splits share no problem, are identical for a seed and
differ for another; a size class too small to hold its share (two columns: 10**4 problems) raises.

Warm-start (the built-in model, flashrl.env.Demonstrating): it imitates a teacher that writes the
scratchpad exactly except that, with probability ``teacher_carry_slip`` on a problem whose units
column carries, it forgets that carry (writes 0 and goes on consistently from there, so its answer
is 10 short). The model learns the layout and the column sums, and to drop the first carry more often
than not: greedy it answers the no-carry problems, sampled it sometimes carries; RL with the exact
verifier has that carry to fix (as the arithmetic task's warm-start plants).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from flashrl.env import Demo, SingleTurnEnv, StepResult, Task, cut_at_eos

_PROMPT_RE = re.compile(r"(\d+)\+(\d+)=")


class ScratchpadParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "scratchpad"``."""

    min_digits: Annotated[int, Meta(ge=1, le=20, description="fewest columns of a problem")] = 2
    max_digits: Annotated[int, Meta(ge=1, le=20, description="most columns of a problem")] = 10
    size_exponent: Annotated[float, Meta(ge=0, le=10, description=(
        "P(columns = d) ~ (d - min_digits + 1) ** -size_exponent: 0 = uniform sizes, larger = fewer long problems"))] = 1.8
    check_scratchpad: Annotated[bool, Meta(description=(
        "reward only the exact written-out addition (true) or any response whose last line is the sum (false)"))] = True
    teacher_carry_slip: Annotated[float, Meta(ge=0, le=1, description=(
        "warm-start teacher: chance it forgets the units carry of a problem that has one (0 = exact teacher)"))] = 0.65
    train_size: Annotated[int, Meta(ge=1, le=1_000_000, description="training problems")] = 5000


def scratchpad(a: int, b: int, slip_units_carry: bool = False) -> str:
    """The written-out column addition of ``a + b`` (module docstring), without the end-of-sequence mark.

    ``slip_units_carry``: write the units column's carry as 0 and go on consistently from there (the
    warm-start teacher's slip; a no-op when the units column does not carry).
    """
    if a < 0 or b < 0:
        raise ValueError(f"scratchpad: operands must be non-negative, got {a} and {b}")
    top, bot, carry, digits = str(a), str(b), 0, ""
    lines = []
    first = True
    while top or bot:
        s = (int(top[-1]) if top else 0) + (int(bot[-1]) if bot else 0) + carry
        top, bot = top[:-1], bot[:-1]
        carry, digits = s // 10, str(s % 10) + digits
        if first and slip_units_carry:
            carry = 0
        first = False
        lines.append(f"{top}+{bot},{carry},{digits}")
    lines.append(("1" if carry else "") + digits)
    return "\n".join(lines)


def parse_prompt(prompt: str) -> tuple[int, int]:
    """(a, b) of a prompt "a+b="; ValueError naming the prompt otherwise."""
    m = _PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise ValueError(f"scratchpad: prompt {prompt!r} is not of the form 'a+b='")
    return int(m.group(1)), int(m.group(2))


class Verdict(msgspec.Struct, frozen=True):
    """What the verifier found: the last line states the sum; the whole response is the exact scratchpad."""

    answer_ok: bool
    scratchpad_ok: bool


def verify(action: str, a: int, b: int) -> Verdict:
    """Judge model text ``action`` (possibly ending in an EOS mark) for ``a + b``; never raises on any text."""
    text = cut_at_eos(action).rstrip()
    last = text.rsplit("\n", 1)[-1].strip()
    answer_ok = last.isascii() and last.isdigit() and len(last) <= 64 and int(last) == a + b
    return Verdict(answer_ok=answer_ok, scratchpad_ok=text == scratchpad(a, b))


def response_tokens(a: int, b: int) -> int:
    """Characters (tokens of the built-in char tokenizer) of the exact response, plus its end-of-sequence token."""
    return len(scratchpad(a, b)) + 1


class ScratchpadEnv(SingleTurnEnv):
    """One episode: the prompt is the problem, the single step is the written-out addition."""

    def __init__(self, check_scratchpad: bool = True) -> None:
        super().__init__()
        self.check_scratchpad = check_scratchpad

    async def judge(self, task: Task, action: str) -> StepResult:
        a, b = parse_prompt(task.prompt)
        v = verify(action, a, b)
        ok = v.scratchpad_ok if self.check_scratchpad else v.answer_ok
        return StepResult(reward=1.0 if ok else 0.0, done=True,
                          info={"correct": ok, "answer_ok": v.answer_ok, "scratchpad_ok": v.scratchpad_ok})


def size_weights(p: ScratchpadParams) -> dict[int, float]:
    """P(columns = d) for each size d the params allow (sums to 1)."""
    w = {d: (d - p.min_digits + 1) ** -p.size_exponent for d in range(p.min_digits, p.max_digits + 1)}
    total = sum(w.values())
    return {d: x / total for d, x in w.items()}


class ScratchpadSuite:
    """Seeded, disjoint train/held-out splits of heavy-tailed column additions (module docstring)."""

    Params: ClassVar[type] = ScratchpadParams
    # The built-in model's warm-start (flashrl.models.WarmStart overrides): batches of 32 (the long ones
    # cost ~10x a short one even as micro-batches); a greedy probe of 128 train problems every 100 steps;
    # stop once 35% of the probe is exactly right (the teacher itself is on ~70%: RL has the slipped
    # carries and the model's own copying errors to fix). Seed 0: stopped at step 800 (probe 35.9%,
    # held-out greedy 36.3%) in 398 s on the 2-core machine shared with other jobs (load 4-7); the
    # micro-batches of flashrl.models.tiny.demo_batches make a step ~2.5x cheaper than one padded batch.
    WARM_START: ClassVar[dict[str, Any]] = {"batch": 32, "max_steps": 2000, "check_every": 100, "probe_size": 128,
                                            "target_accuracy": 0.35}

    def __init__(self, params: ScratchpadParams, seed: int = 0, eval_size: int = 400) -> None:
        if params.min_digits > params.max_digits:
            raise ValueError(f"env.params.min_digits: {params.min_digits} is above max_digits={params.max_digits}; "
                             "lower min_digits or raise max_digits")
        self.params = params
        self.seed = seed
        weights = size_weights(params)
        sizes, probs = list(weights), list(weights.values())
        rng = random.Random(f"scratchpad:{seed}")
        need = eval_size + params.train_size
        for d, pd in weights.items():
            # Expected draws of size d against the 10**(2d) problems of that size: past half, redrawing
            # repeats below would crawl (and a class could run out).
            if pd * need > 0.5 * 100**d:
                raise ValueError(
                    f"env.params.train_size: {params.train_size} training + {eval_size} held-out problems want about "
                    f"{pd * need:.0f} with {d} columns, more than half of the {100**d} that exist; lower train_size "
                    f"or eval_size, or raise min_digits")
        seen: set[tuple[int, int]] = set()
        tasks: list[Task] = []
        while len(tasks) < need:
            d = rng.choices(sizes, probs)[0]
            a, b = rng.randrange(10**d), rng.randrange(10**d)
            while (a, b) in seen:  # a problem appears once across both splits: held-out never leaks into
                a, b = rng.randrange(10**d), rng.randrange(10**d)  # train; same size, so P(d) stays exact
            seen.add((a, b))
            tasks.append(Task(id="", prompt=f"{a}+{b}=", answer=str(a + b), meta={"digits": d}))
        self._eval = [msgspec.structs.replace(t, id=f"eval-{i}") for i, t in enumerate(tasks[:eval_size])]
        self._train = [msgspec.structs.replace(t, id=f"train-{i}") for i, t in enumerate(tasks[eval_size:])]

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return self._eval

    def make_env(self) -> ScratchpadEnv:
        return ScratchpadEnv(self.params.check_scratchpad)

    def demonstration(self, task: Task, rng: random.Random) -> Demo:
        """The warm-start teacher's response to ``task``: exact, except that with probability
        ``teacher_carry_slip`` it forgets a units carry (one ``rng.random()`` per problem that has one)."""
        a, b = parse_prompt(task.prompt)
        slip = (a % 10 + b % 10 >= 10) and rng.random() < self.params.teacher_carry_slip
        return Demo(prompt=task.prompt, turns=[(scratchpad(a, b, slip_units_carry=slip), "")])
