"""The stand-in families of flashrl/sim: every member implements its role's protocol, and the table
in flashrl/sim's docstring names only stand-ins that exist.

``isinstance`` against a ``runtime_checkable`` Protocol checks only that the names exist; here every
method must take the protocol's parameters (names, kinds, which have defaults) and be a coroutine
exactly where the protocol's is, so a stand-in the controller would call wrongly fails here first.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

import flashrl.sim
import flashrl.sim.engine
import flashrl.sim.envs
import flashrl.sim.fake
import flashrl.sim.instant
import flashrl.sim.trainer
from flashrl.interfaces import EngineClient, Tokenizer, TrainerClient
from flashrl.sim.engine import SimEngine
from flashrl.sim.envs import SimTokenizer
from flashrl.sim.fake import FakeEngine, FakeTokenizer, FakeTrainer
from flashrl.sim.instant import InstantEngine, InstantTrainer
from flashrl.sim.trainer import SimTrainer

STANDINS: list[tuple[type, Any]] = [
    (EngineClient, FakeEngine()),
    (EngineClient, SimEngine("e0")),
    (EngineClient, InstantEngine()),
    (TrainerClient, FakeTrainer()),
    (TrainerClient, SimTrainer()),
    (TrainerClient, InstantTrainer()),
    (Tokenizer, FakeTokenizer()),
    (Tokenizer, SimTokenizer()),
    (Tokenizer, SimTokenizer(cache=True)),
]


def _shape(fn: Any) -> tuple[bool, list[tuple[str, Any, bool]]]:
    """(is a coroutine function, [(name, kind, has a default)] past ``self``)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return inspect.iscoroutinefunction(fn), [(p.name, p.kind, p.default is not p.empty) for p in params]


def protocol_mismatches(proto: type, obj: Any) -> list[str]:
    """What ``obj`` lacks or gets wrong of ``proto``: methods by shape, properties and attributes by presence."""
    problems = []
    members = {n for c in proto.__mro__ if c is not object for n in vars(c) if not n.startswith("_")}
    members |= {n for c in proto.__mro__ for n in getattr(c, "__annotations__", {})}
    for name in sorted(members):
        want = inspect.getattr_static(proto, name, None)
        if isinstance(want, property) or want is None:  # a property or a plain attribute: the instance has it
            if not hasattr(obj, name):
                problems.append(f"{name}: missing")
            continue
        have = inspect.getattr_static(type(obj), name, None)
        if not callable(have):
            problems.append(f"{name}: not a method")
        elif _shape(have) != _shape(want):
            problems.append(f"{name}: {_shape(have)} != the protocol's {_shape(want)}")
    return problems


@pytest.mark.parametrize(("proto", "obj"), STANDINS, ids=lambda x: type(x).__name__ if not isinstance(x, type) else x.__name__)
def test_every_standin_implements_its_role(proto: type, obj: Any) -> None:
    assert protocol_mismatches(proto, obj) == []


def test_the_check_sees_a_wrong_method() -> None:
    class Sync(InstantEngine):
        def abort(self, request_ids: list[str]) -> None:  # type: ignore[override]  # not a coroutine
            pass

    class Renamed(InstantEngine):
        async def update_weights(self, m: Any) -> Any:  # type: ignore[override]
            return None

    assert protocol_mismatches(EngineClient, Sync()) == [
        "abort: (False, [('request_ids', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>, False)]) != the protocol's "
        "(True, [('request_ids', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>, False)])"]
    assert [p.split(":")[0] for p in protocol_mismatches(EngineClient, Renamed())] == ["update_weights"]
    assert protocol_mismatches(TrainerClient, InstantEngine()) != []


def test_the_table_names_only_standins_that_exist() -> None:
    doc = flashrl.sim.__doc__ or ""
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^    (engine|trainer|env suite|tokenizer) {2,}(.+)$", doc, re.M)}
    assert set(rows) == {"engine", "trainer", "env suite", "tokenizer"}
    names = set(re.findall(r"\b((?:Fake|Sim|Instant)[A-Z]\w+)", " ".join(rows.values())))
    where = {n for m in (flashrl.sim.engine, flashrl.sim.envs, flashrl.sim.fake, flashrl.sim.instant, flashrl.sim.trainer)
             for n in vars(m)}
    assert len(names) == 14 and names <= where  # 3 engines, 3 trainers, 3 suites + 3 envs, 2 tokenizers, names - where
