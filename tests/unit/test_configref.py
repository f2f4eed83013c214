"""docs/configuration.md is generated from the config structs and must be current; every key is described."""

from __future__ import annotations

from pathlib import Path

import msgspec.inspect as mi

from flashrl.config import Config
from flashrl.configref import reference_markdown, undescribed

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def _keys(st: mi.StructType, path: str = "") -> list[str]:
    """Every value key of the config as ``section.key`` (independent of the generator's walk)."""
    out: list[str] = []
    for f in st.fields:
        name = f"{path}.{f.name}" if path else f.name
        inner = f.type.type if isinstance(f.type, mi.Metadata) else f.type
        if isinstance(f.type, mi.StructType):
            out += _keys(f.type, name)
        elif isinstance(inner, mi.ListType) and isinstance(inner.item_type, mi.StructType):
            out.append(name)
            out += _keys(inner.item_type, name + "[]")
        else:
            out.append(name)
    return out


def test_configuration_md_is_current() -> None:
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: regenerate it with `flashrl config-reference --out docs/configuration.md`")


def test_every_key_is_described() -> None:
    assert undescribed() == [], "config fields without Meta(description=...) in flashrl/config.py"


def test_every_key_is_in_the_reference_with_its_default() -> None:
    text = reference_markdown()
    keys = _keys(mi.type_info(Config))  # type: ignore[arg-type]
    assert len(keys) > 100
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert missing == []
    # one known row in full: type, default, bounds and meaning
    assert "| `rollout.group_size` | int | `4` | >= 1, <= 4096 | samples per prompt (GRPO group) |" in text
    assert '| `engine.device` | "auto" \\| "cpu" \\| "cuda" | `"auto"` | - |' in text
