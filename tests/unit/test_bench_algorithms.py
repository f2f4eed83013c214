"""flashrl/bench/algorithms.py (`flashrl bench algorithms`): summary, table, CSV/JSON and plot on synthetic runs; CLI driving with a stand-in CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from flashrl.bench.algorithms import (
    Point,
    markdown_table,
    read_curve,
    summarize,
    write_results,
)


def _write_metrics(path: Path, rewards: list[float], evals: dict[int, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, r in enumerate(rewards, start=1):
        rec: dict[str, float | int] = {"step": step, "reward/mean": r, "time/step_s": 0.1}
        if step in evals:
            rec["eval/accuracy"] = evals[step]
        lines.append(json.dumps(rec))
    lines.insert(0, json.dumps({"step": 0, "eval/accuracy": 0.1}))  # eval before training, no reward
    path.write_text("\n".join(lines) + "\n\n")


def test_read_curve_and_summary(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "a.jsonl", [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], {4: 0.3, 7: 0.5})
    _write_metrics(tmp_path / "b.jsonl", [0.0, 0.2, 0.2, 0.4, 0.4, 0.4, 0.4], {4: 0.2, 7: 0.45})
    ca, cb = read_curve(tmp_path / "a.jsonl"), read_curve(tmp_path / "b.jsonl")
    assert ca.steps == [1, 2, 3, 4, 5, 6, 7] and ca.eval_steps == [0, 4, 7] and ca.accuracy == [0.1, 0.3, 0.5]
    sync = Point(loss="ppo", ratio=0, run_name="s", curve=ca, returncode=0)
    async2 = Point(loss="ppo", ratio=2, run_name="a", curve=cb, returncode=0)
    lonely = Point(loss="tis", ratio=2, run_name="t", curve=cb, returncode=0)  # no sync run for tis
    summarize([sync, async2, lonely])
    assert sync.final_accuracy == 0.5 and async2.final_accuracy == 0.45
    assert sync.final_reward == pytest.approx((0.2 + 0.3 + 0.4 + 0.5 + 0.6) / 5)  # last 5 steps
    assert async2.final_reward == pytest.approx((0.2 + 0.4 * 4) / 5)
    assert async2.acc_vs_sync == pytest.approx(-0.05) and sync.acc_vs_sync == 0.0
    assert async2.reward_vs_sync == pytest.approx(0.36 - 0.4)
    assert lonely.acc_vs_sync is None
    table = markdown_table([async2, lonely, sync])
    rows = table.strip().splitlines()
    assert rows[2].startswith("| ppo | 0 | 0.500 | +0.000 | 0.400 | +0.000 |")
    assert rows[3].startswith("| ppo | 2 | 0.450 | -0.050 | 0.360 | -0.040 |")
    assert rows[4].startswith("| tis | 2 | 0.450 | n/a | 0.360 | n/a |")


def test_write_results_files(tmp_path: Path) -> None:
    points = []
    for loss, ratio, rew in (("ppo", 0, 0.5), ("ppo", 2, 0.4), ("topr", 0, 0.3), ("topr", 2, 0.35)):
        m = tmp_path / f"{loss}{ratio}.jsonl"
        _write_metrics(m, [rew] * 10, {5: rew, 10: rew + 0.1})
        points.append(Point(loss=loss, ratio=ratio, run_name=f"{loss}{ratio}", curve=read_curve(m), returncode=0))
    points.append(Point(loss="gspo", ratio=0, run_name="g", returncode=1, log="logs/g.log"))  # failed run
    paths = write_results(points, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert [(d["loss"], d["ratio"]) for d in data] == [("ppo", 0), ("ppo", 2), ("topr", 0), ("topr", 2), ("gspo", 0)]
    assert data[3]["reward_vs_sync"] == pytest.approx(0.05) and data[3]["curve"]["accuracy"] == pytest.approx([0.1, 0.35, 0.45])
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert float(rows[1]["acc_vs_sync"]) == pytest.approx(-0.1) and rows[4]["final_accuracy"] == ""
    md = paths["md"].read_text()
    assert "| gspo | 0 | n/a | n/a | n/a | n/a | n/a | failed (rc 1, see logs/g.log) |" in md
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
