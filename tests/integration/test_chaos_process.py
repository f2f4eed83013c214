"""The chaos report's bookkeeping (flashrl/bench/chaos_report.py) on hand-made records: it must catch a
repeated prompt, a lost one, a broken step sequence, and price failures as documented.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_chaos.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_run_short(tmp_path: Path) -> None:
    """`flashrl bench chaos-scripted`, cut down: one engine SIGKILLed inside a weight sync, then (once it is back)
    `flashrl run` SIGKILLed and resumed. The promises: every process of the killed run gone within 30 s,
    the engine counted dead and back, metrics.jsonl steps once each, no prompt trained twice or lost
    (every uid handed out is trained or outstanding at the end), exit 0."""
    out = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "flashrl.cli", "bench", "chaos-scripted", str(ROOT / "configs" / "tiny.toml"), "--out", str(out),
           "--kill-every", "15", "--engine-kills", "1", "--sync-kill", "0", "--controller-kill-after", "20",
           "--min-gain", "-100", "--end-after", "5", "--timeout-s", "500",
           "--set", "run.max_time_s=0", "--set", "run.steps=100000", "--set", "run.checkpoint_every=5",
           "--set", "run.eval_every=50", "--set", "engine.count=2",
           # env.eval_size stays the default: it is part of the built-in model's cache key (another would build one)
           "--set", "rollout.batch_prompts=4", "--set", "rollout.group_size=4"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=560,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["pass"] and all(rep["checks"].values()), rep["checks"]
    assert rep["engine_kills"] == rep["engine_kills_in_sync"] == rep["engines_back"] == 1
    assert rep["stopped_by_bench"] and rep["exit_code"] == 130  # --end-after: SIGTERM, checkpoint, exit 130
    total = rep["counted"]["total"]
    assert total["engine/deaths"] == 1 and total["engine/restarts"] == 1 and total["weight_sync/engine_died"] == 1
    (ctl,) = rep["controller_failures"]
    assert ctl["survivors_after_30s"] == 0 and ctl["resumed_from_step"] is not None
    assert ctl["resumed_from_step"] <= ctl["step"] and "lost_s" in ctl
    pr = rep["prompts"]
    assert pr["ok"] and pr["repeated"] == [] and pr["lost"] == []
    assert pr["trained_prompts"] + pr["outstanding_at_end"] + pr["dropped"] == pr["handed_out"] > 0
    # the records: metrics.jsonl of the whole run (segment 1's kept up to the checkpoint) and segment 1's own
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    assert (out / "run" / "metrics.segment1.jsonl").exists() and (out / "report.md").exists()
    assert not (out / "run" / "checkpoints").exists()  # the weights are not kept
