"""Slow, hanging, crashing and garbage-producing environments on demand, around any Env.

    rollout coroutine --reset/step--> FaultyEnv --(delay drawn from the distribution)--> inner Env
                                          |  one seeded draw per call picks at most one fault:
                                          |    hang    -> await forever (the caller's deadline must fire)
                                          |    crash   -> raise EnvFailure("crash")
                                          |    garbage -> the observation is replaced by junk
                                          |    exit    -> the process exits (remote workers only)
                                          v
                      validate_observation(text, max_chars) on every observation, injected or not:
                      junk -> EnvFailure("garbage", reason), counted in ``counters``

This is how flashrl stands in for ALFWorld- or SWE-style environments whose steps take seconds and
sometimes never return: the scheduling code sees the same delays and failures it would see there.

Configuration, for every ``env.name``: a reserved ``[env.params.faults]`` sub-table (``FaultParams``).
``envs.make_suite`` removes it before the environment's own ``Params`` are checked and wraps the suite
in ``FaultySuite``; an environment never sees it. Example::

    [env.params.faults]
    delay = {kind = "lognormal", mean_s = 0.5, sigma = 1.0, max_s = 10.0}
    hang = 0.01      # probability per call
    crash = 0.01
    garbage = 0.01

Delays and faults apply to every call (``reset`` and ``step``). Randomness is seeded per env instance
(suite seed, instance number), so a run's fault pattern repeats; the delay uses ``asyncio.sleep``, so
the simulator's virtual clock drives it as well.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import Meta

from flashrl.env import Env, EnvFailure, StepResult, Task

# Set by envs.remote in its worker processes: only there may the "exit" fault end the process.
WORKER_ENV_VAR = "FLASHRL_ENV_WORKER"
EXIT_FAULT_CODE = 70


# --------------------------------------------------------------------------- delay distributions
class _Delay(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    max_s: Annotated[float, Meta(gt=0, description="cap on one delay in seconds")] = 3600.0


class ConstantDelay(_Delay, tag="constant"):
    """Every call waits ``seconds``."""

    seconds: Annotated[float, Meta(ge=0, description="delay of every call")] = 0.0


class UniformDelay(_Delay, tag="uniform"):
    """Delay uniform in [low_s, high_s]."""

    low_s: Annotated[float, Meta(ge=0, description="shortest delay")] = 0.0
    high_s: Annotated[float, Meta(ge=0, description="longest delay")] = 1.0

    def __post_init__(self) -> None:
        if self.high_s < self.low_s:
            raise ValueError(f"delay: high_s={self.high_s} is below low_s={self.low_s}; swap them")


class LognormalDelay(_Delay, tag="lognormal"):
    """Heavy-tailed delay with the given mean: exp(N(mu, sigma)), mu = ln(mean_s) - sigma^2 / 2."""

    mean_s: Annotated[float, Meta(gt=0, description="mean delay in seconds (before the max_s cap)")] = 1.0
    sigma: Annotated[float, Meta(ge=0, le=5, description="log-space standard deviation (tail weight)")] = 1.0


Delay = Union[ConstantDelay, UniformDelay, LognormalDelay]


def draw_delay(delay: Delay | None, rng: random.Random) -> float:
    """One delay in seconds from ``delay`` (0 when None), capped at ``delay.max_s``."""
    if delay is None:
        return 0.0
    if isinstance(delay, ConstantDelay):
        d = delay.seconds
    elif isinstance(delay, UniformDelay):
        d = rng.uniform(delay.low_s, delay.high_s)
    else:
        d = rng.lognormvariate(math.log(delay.mean_s) - delay.sigma**2 / 2, delay.sigma)
    return min(d, delay.max_s)


# --------------------------------------------------------------------------- params
class FaultParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params.faults]``: per-call delay and fault probabilities (at most one fault per call)."""

    delay: Delay | None = None
    hang: Annotated[float, Meta(ge=0, le=1, description="probability that a call never returns")] = 0.0
    crash: Annotated[float, Meta(ge=0, le=1, description="probability that a call raises EnvFailure('crash')")] = 0.0
    garbage: Annotated[float, Meta(ge=0, le=1, description="probability that an observation is replaced by junk")] = 0.0
    exit: Annotated[float, Meta(ge=0, le=1, description="probability that the worker process exits (env.name = remote only)")] = 0.0
    max_obs_chars: Annotated[int, Meta(ge=1, description="longest valid observation; longer is garbage")] = 2048

    def __post_init__(self) -> None:
        total = self.hang + self.crash + self.garbage + self.exit
        if total > 1:
            raise ValueError(f"faults: hang + crash + garbage + exit = {total:g} exceeds 1; lower the rates")


# --------------------------------------------------------------------------- validation
def validate_observation(text: Any, max_chars: int) -> str | None:
    """None when ``text`` is a valid observation, else the reason: "not_text", "too_long", "non_printable".

    Valid: a str of at most ``max_chars`` characters, each printable or a newline/tab. Control
    characters, NULs, lone surrogates and other unprintables would tokenize into junk (or fail to).
    """
    if not isinstance(text, str):
        return "not_text"
    if len(text) > max_chars:
        return "too_long"
    if not all(c.isprintable() or c in "\n\t" for c in text):
        return "non_printable"
    return None


def _garbage(rng: random.Random, max_chars: int) -> str:
    """Junk that ``validate_observation`` rejects: control bytes, or far too much text."""
    if rng.random() < 0.5:
        return "".join(chr(rng.randrange(0, 32)) for _ in range(16)) + "\x00"
    return "x" * (max_chars + 1 + rng.randrange(100))


# --------------------------------------------------------------------------- wrapper
class FaultyEnv:
    """An Env that delays, hangs, crashes or corrupts the calls of ``inner`` at the given rates.

    ``counters`` (shared with the suite) counts: "calls", "delay_s" (total injected), "hang",
    "crash", "garbage" (injected), and "rejected:<reason>" for every observation refused.
    """

    def __init__(self, inner: Env, params: FaultParams, rng: random.Random, counters: Counter[str] | None = None) -> None:
        self.inner = inner
        self.params = params
        self.rng = rng
        self.counters: Counter[str] = counters if counters is not None else Counter()

    async def _before(self) -> str | None:
        """Sleep the drawn delay; return the fault to apply to this call, if any."""
        p = self.params
        self.counters["calls"] += 1
        d = draw_delay(p.delay, self.rng)
        u = self.rng.random()  # drawn even without faults so the delay sequence is rate-independent
        if d > 0:
            self.counters["delay_s"] += d  # type: ignore[assignment]  # seconds (a float) beside the counts
            await asyncio.sleep(d)
        for name, rate in (("hang", p.hang), ("crash", p.crash), ("garbage", p.garbage), ("exit", p.exit)):
            if u < rate:
                return name
            u -= rate
        return None

    async def _fault(self, fault: str | None) -> None:
        if fault is None or fault == "garbage":
            return
        self.counters[fault] += 1
        if fault == "hang":
            await asyncio.Event().wait()  # forever: only the caller's deadline ends this
        if fault == "crash":
            raise EnvFailure("crash", "injected fault (env.params.faults.crash)")
        if fault == "exit":
            if os.environ.get(WORKER_ENV_VAR) != "1":
                raise EnvFailure("crash", "injected 'exit' fault outside a remote worker (not exiting the controller)")
            os._exit(EXIT_FAULT_CODE)

    def _check(self, text: str, fault: str | None) -> str:
        if fault == "garbage":
            self.counters["garbage"] += 1
            text = _garbage(self.rng, self.params.max_obs_chars)
        reason = validate_observation(text, self.params.max_obs_chars)
        if reason is not None:
            self.counters[f"rejected:{reason}"] += 1
            raise EnvFailure("garbage", f"observation rejected: {reason}")
        return text

    async def reset(self, task: Task) -> str:
        fault = await self._before()
        await self._fault(fault)
        return self._check(await self.inner.reset(task), fault)

    async def step(self, action: str) -> StepResult:
        fault = await self._before()
        await self._fault(fault)
        res = await self.inner.step(action)
        if not res.done or fault == "garbage":
            res.observation = self._check(res.observation, fault)
        return res

    async def close(self) -> None:
        await self.inner.close()


class FaultySuite:
    """Wraps an EnvSuite: same tasks, every env a FaultyEnv. Built by ``envs.make_suite``."""

    Params: ClassVar[type] = FaultParams

    def __init__(self, inner: Any, params: FaultParams, seed: int) -> None:
        self.inner = inner
        self.params = params
        self.seed = seed
        self.counters: Counter[str] = Counter()
        self._instances = itertools.count()

    def train_tasks(self) -> Sequence[Task]:
        return self.inner.train_tasks()

    def eval_tasks(self) -> Sequence[Task]:
        return self.inner.eval_tasks()

    def make_env(self) -> Env:
        rng = random.Random(f"faults:{self.seed}:{next(self._instances)}")
        return FaultyEnv(self.inner.make_env(), self.params, rng, self.counters)

    def __getattr__(self, name: str) -> Any:  # suite-specific extras (e.g. aclose) of the inner suite
        return getattr(self.__dict__["inner"], name)


def parse_faults(raw: Any) -> FaultParams:
    """``[env.params.faults]`` -> FaultParams; errors name ``env.params.faults.<key>``."""
    try:
        return msgspec.convert(raw, FaultParams, strict=True)
    except msgspec.ValidationError as e:
        msg = str(e).replace(" - at `$", " - at `env.params.faults")
        raise ValueError(f"env.params.faults: {msg}") from None


def with_faults(suite: Any, raw: Any, seed: int) -> FaultySuite:
    """Wrap ``suite`` as ``[env.params.faults]`` (a dict) says."""
    return FaultySuite(suite, parse_faults(raw), seed)


__all__ = [
    "ConstantDelay",
    "Delay",
    "FaultParams",
    "FaultyEnv",
    "FaultySuite",
    "LognormalDelay",
    "UniformDelay",
    "draw_delay",
    "validate_observation",
    "with_faults",
]
