"""What a run leaves to read: samples.jsonl and `flashrl samples`, TensorBoard event files and an
offline W&B run from the same records as metrics.jsonl, and the [log] keys.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_run_logs.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flashrl.metrics import MetricsWriter, open_wandb

RECORDS = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5, "reward/parsed": 1.0, "note": "text"},
           {"step": 2, "reward/mean": 0.75, "reward/parsed": 0.5, "eval/accuracy": 0.5}]


def test_wandb_offline_writes_a_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")  # installed by `make test` (the log extra); works with no network
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = open_wandb(tmp_path, "byod-test", "flashrl-test", "offline", {"run": {"name": "byod-test"}})
    with MetricsWriter(tmp_path / "metrics.jsonl", wandb_run=run) as w:
        for r in RECORDS:
            w.write(r)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    files = list(runs[0].glob("run-*.wandb"))
    assert files and files[0].stat().st_size > 0
    # Protobuf records, the metric names in there as text. wandb-core (its own process) may still be
    # writing the file when finish() returns: wait for it, with a deadline.
    deadline = time.monotonic() + 30
    while b"reward/parsed" not in (data := files[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b"reward/parsed" in data and b"eval/accuracy" in data
