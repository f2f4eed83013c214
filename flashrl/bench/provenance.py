"""Where and at what code a result was measured: the record every bench writes beside its results.

A number means little without the host (the CPU kind moves speed ratios and even a seeded warm-start) and the
code that produced it. ``host_record`` reads both at the start of a measurement; ``append_record`` adds it to
``<out>/host.json`` (a list: one entry per invocation that wrote into the folder, so a bench assembled from
several invocations keeps each one's host, commit and load). README's results tables name these
(flashrl/bench/readme.py), so a table row always says where its numbers came from.

Reading it starts one ``git`` process (the commit, and whether the tree had uncommitted changes).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# the flags that change float32 kernels (and so speed and a seeded warm-start) on the hosts seen so far
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16")


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.machine(), list[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags":
            have = set(value.split())
            flags = [f for f in _FLAGS if f in have]
            break
    return model, flags


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None  # not lstrip: porcelain lines start with a space


def host_record(repo: str | Path = ".") -> dict[str, Any]:
    """The host and code of a measurement starting now. ``dirty`` lists changed tracked paths (up to 20):
    a result measured on a dirty tree says so."""
    repo = Path(repo)
    model, flags = _cpuinfo()
    changed = _git(repo, "status", "--porcelain", "--untracked-files=no")
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": (_git(repo, "rev-parse", "--short=7", "HEAD") or "unknown"),
        "dirty": [line[3:] for line in (changed or "").splitlines()][:20],
        "cpu": model,
        "flags": flags,
        "cores": os.cpu_count(),
        "mem_gib": mem,
        "load_avg": load,
    }


def append_record(out: str | Path, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add ``record`` (default: ``host_record()`` now) to ``out/host.json``; returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = record if record is not None else host_record()
    path = out / "host.json"
    records = read_records(out)
    records.append(record)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return record


def read_records(out: str | Path) -> list[dict[str, Any]]:
    """Every record in ``out/host.json`` ([] when there is none)."""
    path = Path(out) / "host.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of host records (flashrl/bench/provenance.py)")
    return data


def describe(record: dict[str, Any]) -> str:
    """One line for a table: ``Intel Xeon (avx512f, amx_tile), 2 cores, commit abc1234, 2026-11-28``."""
    flags = ", ".join(record.get("flags") or []) or "no AVX-512"
    dirty = " + uncommitted changes" if record.get("dirty") else ""
    return (f"{record.get('cpu', '?')} ({flags}), {record.get('cores', '?')} cores, "
            f"commit {record.get('commit', '?')}{dirty}, {str(record.get('date', '?'))[:10]}")
