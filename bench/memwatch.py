"""Run a command and record the peak memory of it and every process it starts (Linux /proc).

    python bench/memwatch.py OUT.json -- flashrl run configs/realsize.toml

Every ``period`` seconds it walks the command's process tree and reads each process's VmHWM (the
kernel's own peak resident set, so a peak between two samples is not missed) and VmRSS; OUT.json gets,
per process (pid, a short name from its command line), the peak RSS in GiB, and the largest sum of
the tree's current RSS seen in one sample (the whole run's peak, to within the sampling period).
The command's exit code is this script's exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 1 << 30


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _tree(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _status(pid: int) -> dict[str, int]:
    vals = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS"):
                    vals[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return vals


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    for a in argv:
        if a.startswith("flashrl.") or a in ("run", "export", "engine", "trainer"):
            return " ".join(argv[argv.index(a):][:2])
    return " ".join(os.path.basename(a) for a in argv[:3])


def main() -> int:
    out, cmd = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    period = float(os.environ.get("MEMWATCH_PERIOD", "0.5"))
    proc = subprocess.Popen(cmd)
    peaks: dict[int, dict[str, object]] = {}
    total_peak = 0
    t0 = time.monotonic()
    while proc.poll() is None:
        total = 0
        for pid in _tree(proc.pid):
            st = _status(pid)
            if not st:
                continue
            total += st.get("VmRSS", 0)
            rec = peaks.setdefault(pid, {"name": _name(pid), "peak_gib": 0.0})
            rec["peak_gib"] = max(float(rec["peak_gib"]), st.get("VmHWM", 0) / GIB)  # type: ignore[arg-type]
        total_peak = max(total_peak, total)
        time.sleep(period)
    procs = sorted(({"pid": p, **r} for p, r in peaks.items() if float(r["peak_gib"]) > 0.05),  # type: ignore[arg-type]
                   key=lambda r: -float(r["peak_gib"]))
    out.write_text(json.dumps({"command": cmd, "rc": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
                               "tree_peak_gib": round(total_peak / GIB, 2),
                               "processes": [{**r, "peak_gib": round(float(r["peak_gib"]), 2)} for r in procs]},
                              indent=1) + "\n")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
