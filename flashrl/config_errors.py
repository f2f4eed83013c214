"""msgspec validation errors as ``key.path: what is wrong`` with the fix: the one formatter of config errors.

    config.toml          from_dict -> "rollout.group_sise: unknown key; did you mean `group_size`? [rollout] accepts: ..."
    [env.params]         plugins.make_suite -> "env.params.digitz: unknown key for env 'arithmetic'; did you mean
                         `digits`? [env.params] accepts: digits, ops, train_size, faults"

msgspec says where a value is wrong as `` - at `$.a.b[0]` ``; ``describe`` turns that into the dotted
key path under ``prefix`` and, for an unknown key, lists the keys the struct at that path accepts
(with the closest one first when there is one); for a bad enum value, the values allowed.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Annotated, Any, Literal

import msgspec

__all__ = ["describe"]

_PATH_RE = re.compile(r" - at `\$((?:\.[A-Za-z0-9_]+|\[[^\]]*\])*)`")


def _struct_at(root: type, path: str) -> Any:
    t: Any = root
    for part in [p for p in path.split(".") if p]:
        if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
            return None
        t = next((f.type for f in msgspec.structs.fields(t) if f.name == part), None)
        if typing.get_origin(t) is Annotated:
            t = typing.get_args(t)[0]
    return t


def _fields_at(root: type, path: str) -> list[str]:
    t = _struct_at(root, path)
    return [f.name for f in msgspec.structs.fields(t)] if isinstance(t, type) and issubclass(t, msgspec.Struct) else []


def _literal_values(root: type, path: str) -> list[Any]:
    parent, _, leaf = path.rpartition(".")
    item = leaf.endswith("]")  # an element of a list of literals: "target_modules[1]"
    leaf = leaf.split("[", 1)[0]
    t = _struct_at(root, parent)
    if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
        return []
    for f in msgspec.structs.fields(t):
        if f.name == leaf:
            inner = typing.get_args(f.type)[0] if typing.get_origin(f.type) is Annotated else f.type
            if item and typing.get_origin(inner) in (list, tuple, set, frozenset):
                inner = typing.get_args(inner)[0]
            return list(typing.get_args(inner)) if typing.get_origin(inner) is Literal else []
    return []


def describe(msg: str, root: type, prefix: str = "", owner: str = "", extra_keys: tuple[str, ...] = ()) -> tuple[str, str]:
    """(dotted key path, what is wrong) of msgspec's ``msg`` for a value converted to ``root``.

    ``prefix`` is where ``root`` sits in the user's file ("env.params"); ``owner`` names what the keys
    belong to in an unknown-key message ("env 'arithmetic'"); ``extra_keys`` are accepted at the top of
    ``root`` besides its fields (taken out before the conversion, e.g. env.params.faults).
    """
    m = _PATH_RE.search(msg)
    path = m.group(1).lstrip(".") if m else ""
    what = _PATH_RE.sub("", msg)
    full = ".".join(p for p in (prefix, path) if p)
    unknown = re.match(r"Object contains unknown field `([^`]+)`", what)
    if unknown:
        name = unknown.group(1)
        fields = _fields_at(root, path) + (list(extra_keys) if not path else [])
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        of = f" for {owner}" if owner else ""
        return f"{full}.{name}" if full else name, f"unknown key{of}; {hint}[{full or 'top level'}] accepts: {', '.join(fields)}"
    enum = re.match(r"Invalid enum value (.*)", what)
    if enum:
        allowed = _literal_values(root, path)
        if allowed:
            return full, f"invalid value {enum.group(1)}; expected one of: {', '.join(map(repr, allowed))}"
    return full, what
