"""Deadlines that scale with the model's size (flashrl/deadlines.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from flashrl import deadlines
from flashrl.config import Config, from_dict


def _model(folder: Path, shapes: dict[str, list[int]], files: int = 1) -> Path:
    """A model folder whose safetensors files hold only a header (model_params reads nothing else)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(shapes)
    for i in range(files):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        for n in names[i::files]:
            header[n] = {"dtype": "F32", "shape": shapes[n], "data_offsets": [0, 0]}
        raw = json.dumps(header).encode()
        (folder / f"model-{i:05d}-of-{files:05d}.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    return folder


def test_model_params_counts_every_shard_from_the_headers(tmp_path: Path) -> None:
    m = _model(tmp_path / "m", {"a": [1024, 32768], "b": [1024], "c": [3, 4, 5]}, files=2)
    assert deadlines.model_params(m) == 1024 * 32768 + 1024 + 60
    assert deadlines.model_params(tmp_path / "absent") == 0  # a hub id not downloaded: floors
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"\x05\x00")  # torn header: skipped, not fatal
    assert deadlines.model_params(tmp_path / "bad") == 0


def test_auto_deadlines_are_a_floor_plus_bytes_over_a_rate_and_a_set_value_wins(tmp_path: Path) -> None:
    cfg = from_dict({})
    assert cfg.weight_sync.timeout_s == cfg.engine.startup_timeout_s == cfg.trainer.checkpoint_timeout_s == 0  # auto
    # never resolved (the simulator, unit tests): the floors, never 0
    assert deadlines.weight_sync_timeout_s(cfg) == deadlines.SYNC_FLOOR_S == 300.0
    assert deadlines.startup_timeout_s(cfg) == deadlines.STARTUP_FLOOR_S == 600.0
    assert deadlines.checkpoint_timeout_s(cfg) == deadlines.CHECKPOINT_FLOOR_S == 300.0
    n = 268_471_296  # the real-size 0.27B model (bench/results/realsize)
    assert deadlines.weight_sync_timeout_s(cfg, n) == pytest.approx(300 + 4 * n / 25e6)  # 343 s
    assert deadlines.startup_timeout_s(cfg, n) == pytest.approx(600 + 4 * n / 25e6)
    assert deadlines.checkpoint_timeout_s(cfg, n) == pytest.approx(300 + 12 * n / 25e6)  # 429 s for its 3.2 GB
    seven_b = 7_000_000_000
    assert deadlines.weight_sync_timeout_s(cfg, seven_b) == pytest.approx(1420.0)  # 28 GB at 25 MB/s + 300
    # grows linearly with the model, and a value in the config is used as is
    assert deadlines.weight_sync_timeout_s(cfg, 2 * n) - 300 == pytest.approx(2 * (deadlines.weight_sync_timeout_s(cfg, n) - 300))
    set_ = from_dict({"weight_sync": {"timeout_s": 30}, "engine": {"startup_timeout_s": 5}, "trainer": {"checkpoint_timeout_s": 7}})
    assert (deadlines.weight_sync_timeout_s(set_, seven_b), deadlines.startup_timeout_s(set_, seven_b),
            deadlines.checkpoint_timeout_s(set_, seven_b)) == (30, 5, 7)


def test_resolve_fills_only_the_auto_deadlines_for_the_model(tmp_path: Path) -> None:
    m = _model(tmp_path / "m", {"w": [10_000, 10_000]})  # 1e8 parameters: 400 MB in float32
    cfg: Config = from_dict({"engine": {"startup_timeout_s": 42}})
    r = deadlines.resolve(cfg, m)
    assert r.weight_sync.timeout_s == pytest.approx(300 + 4e8 / 25e6)
    assert r.engine.startup_timeout_s == 42  # the user's
    assert r.trainer.checkpoint_timeout_s == pytest.approx(300 + 12e8 / 25e6)
    assert cfg.weight_sync.timeout_s == 0  # a copy: the config given is unchanged
    assert deadlines.resolve(r, tmp_path / "other") is r  # nothing auto left: unchanged
    assert msgspec.to_builtins(r)["model"] == msgspec.to_builtins(cfg)["model"]
