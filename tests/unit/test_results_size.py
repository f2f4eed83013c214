"""bench/results stays within the size budget docs/benchmarks.md states ("How results are kept"): raw runs are
committed compressed, duplicates and redundant derived files are not, so the repository does not grow by a
measurement's uncompressed output."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def budget_bytes() -> int:
    """The budget as docs/benchmarks.md states it: "**size budget: N MB**" (MB = 2**20 bytes)."""
    m = re.search(r"\*\*size budget: (\d+) MB\*\*", (ROOT / "docs/benchmarks.md").read_text())
    assert m, "docs/benchmarks.md states no `**size budget: N MB**` for bench/results"
    return int(m.group(1)) * 2**20


def tree_bytes(root: Path) -> tuple[int, list[tuple[int, str]]]:
    """Total bytes of the files under ``root`` (links counted as links), and the ten largest."""
    sizes = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            sizes.append((p.lstat().st_size, str(p.relative_to(ROOT))))
    return sum(s for s, _ in sizes), sorted(sizes, reverse=True)[:10]


def test_bench_results_within_its_size_budget() -> None:
    total, largest = tree_bytes(ROOT / "bench" / "results")
    assert total <= budget_bytes(), (
        f"bench/results holds {total / 2**20:.1f} MB, over its budget of {budget_bytes() / 2**20:.0f} MB "
        f"(docs/benchmarks.md): compress raw runs (xz), drop duplicates and derived files. Largest: {largest}")


def test_no_uncompressed_raw_runs() -> None:
    """A run's metrics/samples (.jsonl) are committed compressed (.jsonl.xz or .jsonl.gz)."""
    plain = [str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*.jsonl")]
    assert not plain, f"compress these with `xz` (docs/benchmarks.md, How results are kept): {plain[:10]}"
