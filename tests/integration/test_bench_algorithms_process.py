"""flashrl/bench/algorithms.py (`flashrl bench algorithms`): summary, table, CSV/JSON and plot on synthetic runs; CLI driving with a stand-in CLI.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_bench_algorithms.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashrl.bench.algorithms import (
    run_algorithms_bench,
)

FAKE_CLI = r'''
import json, sys
from pathlib import Path
args = sys.argv[1:]
assert args[0] == "run" and args[1].endswith(".toml"), args
sets = dict(a.split("=", 1) for a in args[3::2])
assert all(flag == "--set" for flag in args[2::2]), args
if sets["algorithm.loss"] == "cispo":
    print("boom"); sys.exit(3)
run = Path(sets["run.output_dir"]) / sets["run.name"]
run.mkdir(parents=True)
ratio = int(sets["scheduler.async_ratio"])
with (run / "metrics.jsonl").open("w") as f:
    for s in range(1, int(sets["run.steps"]) + 1):
        f.write(json.dumps({"step": s, "reward/mean": 0.1 * ratio, "eval/accuracy": 0.5 - 0.1 * ratio}) + "\n")
(run / "summary.json").write_text(json.dumps({"steps": int(sets["run.steps"]), "wall_s": 1.5}))
'''


def test_run_algorithms_bench_drives_the_cli(tmp_path: Path) -> None:
    fake = tmp_path / "fake_flashrl.py"
    fake.write_text(FAKE_CLI)
    points = run_algorithms_bench(["ppo", "cispo"], [2], 3, tmp_path / "out", "configs/tiny.toml",
                                  flashrl_cmd=[sys.executable, str(fake)])
    # ratio 0 (sync) is added as the baseline; every run is kept, the failed ones too
    assert [(p.loss, p.ratio, p.returncode) for p in points] == [("ppo", 0, 0), ("ppo", 2, 0), ("cispo", 0, 3), ("cispo", 2, 3)]
    ppo2 = points[1]
    assert ppo2.curve.steps == [1, 2, 3] and ppo2.final_accuracy == pytest.approx(0.3)
    assert ppo2.acc_vs_sync == pytest.approx(-0.2) and ppo2.reward_vs_sync == pytest.approx(0.2)
    assert "boom" in Path(points[2].log).read_text()
    assert (tmp_path / "out" / "runs" / "alg-ppo-r2" / "metrics.jsonl").exists()
    assert (tmp_path / "out" / "results.png").exists()
    with pytest.raises(ValueError, match="losses is empty"):
        run_algorithms_bench([], [0], 3, tmp_path / "x")


def test_resume_keeps_completed_runs_and_reruns_the_rest(tmp_path: Path) -> None:
    fake = tmp_path / "fake_flashrl.py"
    fake.write_text(FAKE_CLI)
    cmd = [sys.executable, str(fake)]
    out = tmp_path / "out"
    run_algorithms_bench(["ppo"], [2], 3, out, flashrl_cmd=cmd)
    # a run cut short (its summary says 1 step) and a failed run (no summary) are run again, in a clean folder
    (out / "runs" / "alg-ppo-r2" / "summary.json").write_text(json.dumps({"steps": 1, "wall_s": 9.0}))
    (out / "runs" / "alg-topr-r0").mkdir(parents=True)
    (out / "runs" / "alg-topr-r0" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 9.0}) + "\n")
    points = run_algorithms_bench(["ppo", "topr"], [2], 3, out, flashrl_cmd=cmd, resume=True)
    assert [(p.run_name, p.returncode) for p in points] == [
        ("alg-ppo-r0", 0), ("alg-ppo-r2", 0), ("alg-topr-r0", 0), ("alg-topr-r2", 0)]
    assert points[0].wall_s == 1.5 and "kept" not in Path(points[0].log).read_text()  # kept: its log untouched
    assert points[1].wall_s != 9.0 and points[1].curve.steps == [1, 2, 3]  # re-run (the fake's mkdir needs a clean dir)
    assert points[2].curve.reward == [0.0, 0.0, 0.0]  # the stale 9.0 was not mixed in
