"""``flashrl bench``: the command. The bench code itself lives in flashrl/benchmarks/:

    scenario.py   scenario files (shipped ones are package data), their checks, each run's config
    simulate.py   simulator mode: the ROLL Flash ablations, each point async against the sync baseline,
                  through the REAL controller on virtual time (bounds, token ledger, plots)
    real.py       real mode (``mode = "real"`` scenarios, or ``--mode real``): real vLLM engines and the
                  real trainer on this machine, wall-clock time
    overhead.py   ``kind = "overhead"`` scenarios: the controller's CPU per sample against engines that
                  answer at once, and the ZeroMQ path in requests per second
    calibrate.py  ``flashrl bench calibrate RUN_DIR``: fit the simulator to a real run
    algorithms.py ``flashrl bench algorithms``: losses x async ratio (learning, not speed)

``flashrl bench all`` runs the shipped scenarios of one mode (``--mode``, default sim).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from flashrl.benchmarks.overhead import run_overhead
from flashrl.benchmarks.real import run_real_scenarios
from flashrl.benchmarks.scenario import (
    BenchError,
    check_mode,
    find_scenario,
    load_scenario,
    shipped_scenarios,
)
from flashrl.benchmarks.simulate import run_sim_scenario
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


# --------------------------------------------------------------------------- CLI
def main(argv: list[str]) -> int:
    """``flashrl bench SCENARIO|all [--out DIR] [--mode sim|real]``, ``flashrl bench calibrate RUN_DIR``,
    ``flashrl bench algorithms [--losses ...] [--ratios ...]`` (learning, not speed: flashrl/benchmarks/algorithms.py),
    ``flashrl bench chaos [CONFIG]`` (engines and the controller SIGKILLed during a run: flashrl/benchmarks/chaos.py),
    ``flashrl bench peers`` (flashrl async and sync against TRL's GRPOTrainer) and ``flashrl bench seeds``
    (the default over seeds 0, 1, 2): flashrl/benchmarks/peers.py, and ``flashrl bench steptime [--steps N]
    [--set K=V]`` (per-phase step profile: flashrl/benchmarks/steptime.py)."""
    if argv and argv[0] == "calibrate":
        from flashrl.benchmarks.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "steptime":
        from flashrl.benchmarks.steptime import main as steptime_main

        return steptime_main(argv[1:])
    if argv and argv[0] == "algorithms":
        from flashrl.benchmarks.algorithms import main as algorithms_main

        return algorithms_main(argv[1:])
    if argv and argv[0] == "chaos":
        from flashrl.benchmarks.chaos import main as chaos_main

        return chaos_main(argv[1:])
    if argv and argv[0] in ("peers", "seeds"):
        from flashrl.benchmarks.peers import main as peers_main

        return peers_main(argv[1:], seeds_mode=argv[0] == "seeds")
    ap = argparse.ArgumentParser(prog="flashrl bench", description=__doc__.split("\n")[0])
    ap.add_argument("scenario", help="a shipped scenario's name (e.g. queue_scheduling), a .toml path, or 'all'")
    ap.add_argument("--out", default="bench/results", help="output folder (one subfolder per scenario)")
    ap.add_argument("--mode", choices=["sim", "real"], default=None,
                    help="sim (virtual time) or real (vLLM engines + trainer here); default: the scenario's own mode, sim for 'all'")
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's step count (sim mode; steady-state checks)")
    args = ap.parse_args(argv)
    return bench_main(args.scenario, args.out, args.mode, args.steps)


def bench_main(scenario: str, out: str = "bench/results", mode: str | None = None, steps: int | None = None) -> int:
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
