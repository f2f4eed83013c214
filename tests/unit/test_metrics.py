"""RateMeter on a fake clock, summaries, metrics.jsonl, and per-process logging."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import warnings
from pathlib import Path

import pytest

from flashrl.core.meters import RateMeter
from flashrl.logging_setup import setup_logging
from flashrl.metrics import MetricsWriter, Snapshot, Summary, _scalars, read_jsonl, summarize


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------------------------- RateMeter


def test_rate_meter_before_window_is_full_uses_elapsed_time() -> None:
    clock = FakeClock()
    meter = RateMeter(clock=clock, window_s=10)
    assert meter.rate() == 0.0  # no time has passed: no division by zero
    clock.t += 2
    meter.add(30)  # 30 tokens in the first 2 s
    assert meter.rate() == pytest.approx(15.0)
    clock.t += 2
    assert meter.rate() == pytest.approx(7.5)  # 30 over 4 s


def test_rate_meter_sliding_window() -> None:
    clock = FakeClock()
    meter = RateMeter(clock=clock, window_s=10)
    for _ in range(20):  # one sample every 0.5 s: events at t = 100.5 .. 110.0
        clock.t += 0.5
        meter.add()
    assert meter.rate() == pytest.approx(2.0)  # 20 in the last 10 s
    clock.t += 5  # t = 115: events at 100.5 .. 105.0 have left the window, 10 remain
    assert meter.rate() == pytest.approx(1.0)
    clock.t += 5  # t = 120: the last event (110.0) is exactly 10 s old and has left too
    assert meter.rate() == 0.0
    assert meter.total == 20


def test_rate_meter_event_exactly_window_old_has_left() -> None:
    clock = FakeClock(0.0)
    meter = RateMeter(clock=clock, window_s=4)
    clock.t = 1.0
    meter.add(8)
    clock.t = 4.9
    assert meter.rate() == pytest.approx(2.0)
    clock.t = 5.0
    assert meter.rate() == 0.0


def test_rate_meter_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="window_s must be a finite number > 0 seconds, got 0"):
        RateMeter(clock=FakeClock(), window_s=0)
    meter = RateMeter(clock=FakeClock())
    with pytest.raises(ValueError, match="amount must be >= 0, got -1"):
        meter.add(-1)


# ---------------------------------------------------------------------------------------------- summarize


def test_summarize() -> None:
    s = summarize([0, 1, 1, 2])
    assert s == Summary(count=4, mean=1.0, std=pytest.approx(0.5 ** 0.5), min=0.0, max=2.0)
    assert s.as_dict("staleness") == {
        "staleness/mean": 1.0, "staleness/std": pytest.approx(0.7071067811865476),
        "staleness/min": 0.0, "staleness/max": 2.0,
    }
    assert summarize([]) == Summary(count=0, mean=0.0, std=0.0, min=0.0, max=0.0)
    assert summarize(iter([3.5])) == Summary(count=1, mean=3.5, std=0.0, min=3.5, max=3.5)


# ---------------------------------------------------------------------------------------------- MetricsWriter


def test_metrics_writer_round_trip_one_line_per_record(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"  # parent made on demand
    records = [
        {"step": 1, "reward/mean": 0.25, "time/step_s": 1.5, "staleness/mean": 0.0, "note": "a\nb"},
        {"step": 2, "reward/mean": 0.5, "time/step_s": 1.25, "staleness/mean": 0.5, "eval/accuracy": 0.375},
    ]
    with MetricsWriter(path) as w:
        for r in records:
            w.write(r)
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # the newline inside a string value is escaped, not a new line
    assert [json.loads(ln) for ln in lines] == records
    assert read_jsonl(path) == records


def test_metrics_writer_flushes_each_line_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.write({"step": 1})
    # read while the writer is still open: a crash right now must not lose step 1
    assert path.read_text() == '{"step":1}\n'
    w.write({"step": 2})
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    w.close()
    w.close()  # idempotent
    with MetricsWriter(path) as w2:  # a resumed run appends
        w2.write({"step": 3})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


def test_snapshot_encodes_as_json() -> None:
    # the controller may log or ship a Snapshot; it must survive msgspec JSON
    import msgspec

    snap = Snapshot(step=3, reward_history=[(1, 0.5)], counters={"failed/env_error": 2})
    assert msgspec.json.decode(msgspec.json.encode(snap), type=Snapshot) == snap


def test_tensorboard_scalars_and_skip_when_missing(tmp_path: Path) -> None:
    rec = {"step": 3, "reward/mean": 0.5, "ok": True, "name": "x", "bad": float("nan"), "n": 2}
    assert _scalars(rec) == {"step": 3.0, "reward/mean": 0.5, "n": 2.0}
    w = MetricsWriter(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    try:
        w.write(rec)
        installed = importlib.util.find_spec("tensorboard") is not None
        assert w.tensorboard_enabled is installed
        if installed:
            w.close()
            assert any((tmp_path / "tb").iterdir())
    finally:
        w.close()


# ---------------------------------------------------------------------------------------------- logging


@pytest.fixture
def clean_root_logger():
    root = logging.getLogger()
    before_handlers, before_level = list(root.handlers), root.level
    yield
    for h in root.handlers:
        if h not in before_handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(before_level)
    logging.captureWarnings(False)


def test_setup_logging_file_and_stderr_levels(tmp_path: Path, capsys, clean_root_logger) -> None:
    path = setup_logging(tmp_path, "engine-0", "INFO")
    assert path == tmp_path / "logs" / "engine-0.log"
    log = logging.getLogger("flashrl.test")
    log.debug("debug-hidden")
    log.info("info-in-file")
    log.warning("warn-both")
    for h in logging.getLogger().handlers:
        h.flush()
    text = path.read_text()
    assert "info-in-file" in text and "warn-both" in text and "debug-hidden" not in text
    assert "engine-0[" in text and "flashrl.test: info-in-file" in text
    err = capsys.readouterr().err
    assert "warn-both" in err and "info-in-file" not in err


def test_setup_logging_twice_does_not_stack_handlers(tmp_path: Path, clean_root_logger) -> None:
    setup_logging(tmp_path, "controller", "DEBUG")
    n = len(logging.getLogger().handlers)
    path = setup_logging(tmp_path, "controller", "DEBUG")
    assert len(logging.getLogger().handlers) == n
    logging.getLogger("x").debug("once")
    assert path is not None and path.read_text().count("once") == 1


def test_setup_logging_stderr_follows_sys_stderr(tmp_path: Path, monkeypatch, clean_root_logger) -> None:
    # rich's Live swaps sys.stderr; warnings must go to the swapped stream, above the dashboard
    import io

    setup_logging(None, "controller", "INFO")
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)
    logging.getLogger("x").warning("shown-above-dashboard")
    logging.getLogger("x").info("not-on-stderr")
    assert "shown-above-dashboard" in swapped.getvalue()
    assert "not-on-stderr" not in swapped.getvalue()


def test_setup_logging_captures_warnings(tmp_path: Path, clean_root_logger) -> None:
    path = setup_logging(tmp_path, "trainer-rank1", "WARNING")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("library-warning", UserWarning, stacklevel=1)
    assert path is not None and "library-warning" in path.read_text()


def test_setup_logging_rejects_bad_arguments(tmp_path: Path, clean_root_logger) -> None:
    with pytest.raises(ValueError, match=r"log level must be one of DEBUG, INFO, WARNING, ERROR \(run.log_level\), got 'LOUD'"):
        setup_logging(tmp_path, "controller", "LOUD")
    with pytest.raises(ValueError, match="is used as a log file name"):
        setup_logging(tmp_path, "../escape", "INFO")
