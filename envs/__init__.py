"""Environments. ``ENVIRONMENTS`` maps a config ``env.name`` to a loader returning an EnvSuite class.

Loaders import lazily so that a config naming one environment does not import the others.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import msgspec

# env.name -> "module:Class" of an EnvSuite (see envs/base.py)
ENVIRONMENTS: dict[str, str] = {
    "arithmetic": "envs.arithmetic:ArithmeticSuite",
    "sim": "flashrl.sim.envs:SimSuite",  # simulated delays/failures for `flashrl bench`
    "countdown": "envs.countdown:CountdownSuite",
    "guess": "envs.guess:GuessSuite",  # multi-turn guessing game
    "code": "envs.code:CodeSuite",  # sandboxed code execution
    "remote": "envs.remote:RemoteSuite",  # any env in worker processes behind ZeroMQ
}


def _params_error(msg: str, env: str, params_type: type) -> str:
    """msgspec's message as `env.params.<key>: what is wrong`, listing the accepted keys for a typo."""
    at = re.search(r" - at `\$((?:\.[A-Za-z0-9_]+|\[[^\]]*\])*)`", msg)
    path = "env.params" + (at.group(1) if at else "")
    what = msg[: at.start()] if at else msg
    unknown = re.match(r"Object contains unknown field `([^`]+)`", what)
    if unknown:
        fields = [f.name for f in msgspec.structs.fields(params_type)]
        return f"{path}.{unknown.group(1)}: unknown key for env {env!r}; accepted: {', '.join(fields)} (and faults)"
    return f"{path}: {what} (env {env!r})"


def suite_class(name: str) -> type:
    """The EnvSuite class registered for ``env.name`` (imported on demand)."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"env.name: unknown environment {name!r}; expected one of {sorted(ENVIRONMENTS)}")
    module, cls_name = ENVIRONMENTS[name].split(":")
    return getattr(importlib.import_module(module), cls_name)


def warm_start_overrides(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The WarmStart fields ``env.name`` overrides for the built-in model (envs.base.Demonstrating);
    a wrapper suite (remote) answers for the suite it wraps."""
    cls = suite_class(name)
    hook = getattr(cls, "warm_start_overrides", None)
    return dict(hook(params)) if hook is not None else dict(getattr(cls, "WARM_START", {}))


def make_suite(name: str, params: dict[str, Any], seed: int, eval_size: int) -> Any:
    """Build the EnvSuite for ``env.name``; bad params raise ValueError naming ``env.params.<key>``."""
    cls = suite_class(name)
    # ``faults`` is reserved for every env: delays and injected faults around it (envs/faults.py).
    faults = params.get("faults")
    params = {k: v for k, v in params.items() if k != "faults"}
    try:
        p = msgspec.convert(params, cls.Params, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(_params_error(str(e), name, cls.Params)) from None
    suite = cls(p, seed=seed, eval_size=eval_size)
    if faults is not None:
        from envs.faults import with_faults

        suite = with_faults(suite, faults, seed)
    return suite
