"""The configuration reference, generated from the config structs (``flashrl config-reference``).

``reference_markdown()`` walks ``flashrl.config.Config`` with ``msgspec.inspect`` and renders one
table per section: every key as ``section.key``, its type, its default (as TOML), its bounds and its
one-line description from ``Meta(description=...)``. docs/configuration.md is this function's output;
tests/unit/test_configref.py regenerates it and fails when the committed file differs, so the reference
cannot drift from the structs. ``undescribed()`` lists any field without a description (the test
requires none).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi

from flashrl.config import Config, _toml_value

HEADER = """# Configuration reference

Generated from the config structs in `flashrl/config.py` by `flashrl config-reference --out
docs/configuration.md`; a test fails when this file is stale. Every key is optional: a missing key
takes its default. `flashrl validate CONFIG` checks a file against exactly these types and bounds
(and `[env.params]` against the chosen environment's own struct: see docs/environments.md) and names
the key and the fix on any problem. `--set section.key=value` overrides any key on the command line.
"""


def _description(t: Any) -> str:
    if isinstance(t, mi.Metadata):
        return str((t.extra_json_schema or {}).get("description", ""))
    return ""


def _inner(t: Any) -> Any:
    return t.type if isinstance(t, mi.Metadata) else t


def _type_name(t: Any) -> str:
    t = _inner(t)
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.IntType):
        return "int"
    if isinstance(t, mi.FloatType):
        return "float"
    if isinstance(t, mi.StrType):
        return "string"
    if isinstance(t, mi.LiteralType):
        return " \\| ".join(_toml_value(v) for v in t.values)
    if isinstance(t, mi.UnionType):
        return " \\| ".join(_type_name(x) for x in t.types)
    if isinstance(t, mi.ListType):
        return f"list of {_type_name(t.item_type)}"
    if isinstance(t, mi.DictType):
        return f"table of {_type_name(t.value_type)}"
    if isinstance(t, mi.StructType):
        return "table"
    if isinstance(t, mi.AnyType):
        return "any"
    return type(t).__name__


def _bounds(t: Any, what: str = "") -> list[str]:
    """The bounds msgspec checks for ``t`` (``what`` prefixes those of list items and table values)."""
    t = _inner(t)
    out: list[str] = []
    if isinstance(t, (mi.IntType, mi.FloatType)):
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(t, attr)
            if v is not None:
                out.append(f"{what}{op} {v}")
    elif isinstance(t, mi.StrType):
        if t.min_length is not None:
            out.append(f"{what}length >= {t.min_length}")
        if t.max_length is not None:
            out.append(f"{what}length <= {t.max_length}")
        if t.pattern is not None:
            out.append(f"{what}matches `{t.pattern}`")
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            out += _bounds(x, what)
    elif isinstance(t, mi.ListType):
        out += _bounds(t.item_type, "items ")
    elif isinstance(t, mi.DictType):
        out += _bounds(t.value_type, "values ")
    return out


def _default(f: mi.Field) -> str:
    value = f.default if f.default is not mi.NODEFAULT else f.default_factory()
    return _toml_value(msgspec.to_builtins(value))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sections(st: mi.StructType, path: str) -> Iterator[tuple[str, type, list[mi.Field]]]:
    """(dotted path, struct class, its value fields) for ``st`` and every section below it, depth first."""
    values = [f for f in st.fields if not isinstance(f.type, mi.StructType)]
    if values:
        yield path, st.cls, values
    for f in st.fields:
        if isinstance(f.type, mi.StructType):  # a sub-table: [algorithm.cispo]
            yield from _sections(f.type, f"{path}.{f.name}" if path else f.name)
        inner = _inner(f.type)
        if isinstance(inner, mi.ListType) and isinstance(inner.item_type, mi.StructType):  # [[cluster.slurm.layout]]
            yield from _sections(inner.item_type, f"{path}.{f.name}[]")


def _doc(cls: type) -> str:
    """The section's docstring as one paragraph, without its ``[table]`` label and code markup."""
    doc = inspect.cleandoc(cls.__doc__ or "") if "__doc__" in vars(cls) else ""
    text = " ".join(doc.split()).replace("``", "`")
    text = re.sub(r"^`?\[[^\]]*\]`?[:.]\s*", "", text)
    return text[:1].upper() + text[1:]


def reference_markdown() -> str:
    """docs/configuration.md: every key of ``Config`` with type, default, bounds and meaning."""
    lines = [HEADER]
    for path, cls, fields in _sections(mi.type_info(Config), ""):  # type: ignore[arg-type]
        table = path.replace("[]", "")
        lines.append(f"## [[{table}]]" if path.endswith("[]") else f"## [{table}]")
        lines.append("")
        doc = _doc(cls)
        if doc:
            lines += [doc, ""]
        lines.append("| key | type | default | bounds | meaning |")
        lines.append("|---|---|---|---|---|")
        for f in fields:
            bounds = ", ".join(_bounds(f.type)) or "-"
            lines.append(f"| `{path}.{f.name}` | {_type_name(f.type)} | `{_cell(_default(f))}` | {_cell(bounds)} "
                         f"| {_cell(_description(f.type)).replace('<', '&lt;')} |")
        lines.append("")
    return "\n".join(lines)


def undescribed() -> list[str]:
    """Dotted keys whose field has no ``Meta(description=...)`` (the reference would leave them blank)."""
    return [f"{path}.{f.name}" for path, _, fields in _sections(mi.type_info(Config), "")  # type: ignore[arg-type]
            for f in fields if not _description(f.type).strip()]
