"""The scenario sweeps of ``flashrl bench``: one scenario file, or every shipped one of a mode, to results files.

A scenario runs in its own mode (``Scenario.mode``) unless ``--mode`` says otherwise (``check_mode``
refuses a sim-sized scenario in real mode): sim points go to simulate.py (overhead scenarios to
overhead.py), real ones to real.py, which keeps one process pool for every scenario of the sweep.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from flashrl.bench.overhead import run_overhead
from flashrl.bench.real import run_real_scenarios
from flashrl.bench.scenario import (
    BenchError,
    check_mode,
    find_scenario,
    load_scenario,
    shipped_scenarios,
)
from flashrl.bench.simulate import run_sim_scenario
from flashrl.config import ConfigError


def run_scenario(path: str | Path, out_dir: str | Path, mode: Literal["sim", "real"] | None = None, quiet: bool = False,
                 steps: int | None = None) -> list[Any]:
    """Run every point of one scenario; write results.json, results.csv and a PNG under ``out_dir/<name>/``.

    ``mode`` None runs the scenario in its own mode (``Scenario.mode``); ``steps`` overrides its step count
    (steady-state checks: compare the ratios at N and 2N steps).
    """
    scn = load_scenario(path)
    if steps is not None:
        if steps <= scn.warmup:
            raise BenchError(f"--steps {steps} must be > the scenario's warmup ({scn.warmup})")
        scn = msgspec.structs.replace(scn, steps=steps)
    if check_mode(scn, mode, path) == "real":
        return run_real_scenarios([(path, scn)], out_dir, quiet=quiet)[0]
    out = Path(out_dir) / scn.name
    out.mkdir(parents=True, exist_ok=True)
    if scn.kind == "overhead":
        return run_overhead(scn, out, quiet=quiet)
    return run_sim_scenario(scn, path, out, quiet=quiet)


def run_sweep(scenario: str, out: str | Path = "bench/results", mode: str | None = None, steps: int | None = None) -> int:
    """``flashrl bench SCENARIO`` / ``flashrl bench all``: run one scenario (a shipped name or a .toml path), or
    with ``all`` every shipped scenario of ``mode`` (default sim). Exit code: 0; 1 when a point missed its bar;
    2 on a scenario or config problem (the message on stderr). ``steps`` applies in sim mode only."""
    t0 = time.perf_counter()
    try:
        if scenario == "all":
            mode = mode or "sim"
            paths = shipped_scenarios(mode)  # type: ignore[arg-type]
        else:
            paths = [find_scenario(scenario)]
            mode = check_mode(load_scenario(paths[0]), mode, paths[0])
        if mode == "real":  # one process pool for every scenario: a cluster is reused while its config allows
            all_results = run_real_scenarios([(p, load_scenario(p)) for p in paths], out)
        else:
            all_results = [run_scenario(p, out, "sim", steps=steps) for p in paths]
    except (BenchError, ConfigError) as e:
        print(f"flashrl bench: {e}", file=sys.stderr)
        return 2
    failed = sum(1 for results in all_results for r in results if getattr(r, "passed", None) is False)
    print(f"bench: {len(paths)} scenario(s) in {time.perf_counter() - t0:.1f}s wall; results under {out}/")
    return 1 if failed else 0
