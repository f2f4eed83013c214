"""`flashrl bench steptime`: phase statistics, start-up from the run's logs, the comparison table.

The profile itself is a real `flashrl run` (committed results under bench/results/steptime/); here the
parsing runs on a run folder written by hand, so every number checked is known.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from flashrl.bench.steptime import role_of, startup, step_stats, table


def _record(step: int, step_s: float, train_s: float, sync_s: float, trainer_s: float) -> dict[str, float]:
    return {"step": step, "time/step_s": step_s, "time/train_s": train_s, "time/weight_sync_s": sync_s,
            "step_time_s": trainer_s, "time/trainer/forward_s": trainer_s / 2, "time/trainer/backward_s": trainer_s / 4,
            "time/elapsed_s": step * step_s}


def test_step_stats_skip_warmup_and_derive_wait_and_other() -> None:
    recs = [{"step": 0, "eval/accuracy": 0.5}]
    recs += [_record(1, 9.0, 5.0, 1.0, 4.0)]  # a slow first step, skipped
    recs += [_record(s, 0.3, 0.2, 0.05, 0.16) for s in range(2, 7)]
    st = step_stats(recs, skip=1)
    assert st["time/step_s"]["n"] == 5
    assert st["time/step_s"]["median_ms"] == pytest.approx(300.0)
    assert st["derived/wait_s"]["median_ms"] == pytest.approx(50.0)  # 300 - 200 - 50
    assert st["derived/trainer_other_s"]["median_ms"] == pytest.approx(40.0)  # 160 - 80 - 40
    assert "time/trainer/credit_s" not in st  # a phase the run did not have gets no row
    assert "engine" not in st  # records without engine occupancy (an older run): no engine row
    for r, (stepping, commands) in zip(recs[2:], [(0.6, 0.3), (0.7, 0.2), (0.5, 0.3), (0.6, 0.3), (0.6, 0.4)]):
        r.update({"engine/stepping": stepping, "engine/commands": commands, "engine/busy": stepping + commands})
    busy = step_stats(recs, skip=1)["engine"]
    assert busy == pytest.approx({"stepping": 0.6, "commands": 0.3, "busy": 0.9})
    md = table([{"label": "x", "phases": {"engine": busy}, "startup_s": {}, "train_elapsed_s": 1.0, "evals": []}])
    assert "| engine thread busy, mean over steps: stepping + commands | 60% + 30% = 90% |" in md


def _log(path: Path, t: float, text: str) -> None:
    stamp = datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    with path.open("a") as f:
        f.write(f"{stamp} INFO    x[1] y: {text}\n")


def test_startup_reads_the_logs_against_the_launch_time(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    t0 = 1_800_000_000.0
    _log(logs / "trainer0.log", t0 + 4.0, "rank 0/1 ready: backend gloo")
    _log(logs / "engine0.log", t0 + 9.5, "engine0: serving m on ipc://x (ready in 8.0s)")
    _log(logs / "engine1.log", t0 + 11.25, "engine1: serving m on ipc://y (ready in 9.1s)")
    _log(logs / "controller.log", t0 + 11.5, "controller running: first rollouts requested")
    _log(logs / "engine1.log", t0 + 15.0, "engine1: weights v1 loaded in 0.04s")
    _log(logs / "engine0.log", t0 + 15.1, "engine0: weights v1 loaded in 0.04s")
    s = startup(tmp_path, t0, [])
    assert s == pytest.approx({"trainer_ready_s": 4.0, "engines_ready_s": 11.25, "first_rollout_s": 11.5,
                               "first_step_s": 15.0})


def test_table_compares_two_profiles_with_ratios() -> None:
    def profile(label: str, step_ms: float) -> dict[str, object]:
        return {"label": label, "phases": {"time/step_s": {"median_ms": step_ms, "mean_ms": step_ms, "n": 10}},
                "startup_s": {"engines_ready_s": step_ms / 10}, "train_elapsed_s": 1.0, "evals": [[10, 0.75]]}

    md = table([profile("before", 800.0), profile("after", 200.0)])
    row = next(line for line in md.splitlines() if line.startswith("| step"))
    assert row.split("|")[2:5] == [" 800.0 ", " 200.0 ", " 0.25 "]
    assert "| start-up: engines ready (s) | 80.0 | 20.0 | 0.25 |" in md
    json.dumps(profile("x", 1.0))  # profiles are plain JSON


def test_roles_come_from_command_lines_and_children_inherit_them() -> None:
    assert role_of(["python", "-m", "flashrl.engine.server", "--address", "x"], "python", "controller") == \
        "engine (server)"
    assert role_of(["VLLM::EngineCore"], "VLLM::EngineCore", "engine (server)") == "engine (EngineCore)"
    assert role_of(["python", "-c", "from multiprocessing.spawn import spawn_main"], "python",
                   "engine (server)") == "engine (EngineCore)"
    assert role_of(["python", "-m", "flashrl.trainer.worker"], "python", "controller") == "trainer"
    assert role_of([".venv/bin/flashrl", "run", "c.toml"], "flashrl", None) == "controller"
    assert role_of(["python", "-m", "envs.worker"], "python", "controller") == "controller child"
    assert role_of(["sleep", "1"], "sleep", None) == "other"
