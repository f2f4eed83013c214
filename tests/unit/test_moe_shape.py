"""builtin:moe's shape from a config file (``[moe.builtin]``, flashrl/moe/config.py): the model it builds, its cache
key, and the shapes refused (vLLM's CPU MoE kernel's widths, a shape for a model that is not builtin:moe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrl.config import ConfigError, load
from flashrl.moe.model import MoeSpec

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["moe.builtin.layers=3", "moe.builtin.experts=16", "moe.builtin.top_k=4", "moe.builtin.expert_width=64"]


def _cfg(tmp_path: Path, *sets: str):
    return load(ROOT / "configs" / "moe.toml", [f"model.cache_dir={tmp_path / 'cache'}", "env.eval_size=8", *sets])


def test_the_config_files_shape_builds_its_own_cached_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flashrl.models as models
    from flashrl.bench.simulate import moe_routes
    from flashrl.moe.routes import route_shape

    # the warm-start (minutes) is builtin:tiny's, tested elsewhere: here only which folder is built, and its shape
    monkeypatch.setattr(models, "warm_start", lambda *a, **k: {"eval_accuracy": 0.0, "seconds": 0.0})
    default, shaped = _cfg(tmp_path), _cfg(tmp_path, *SHAPE)
    assert default.moe.builtin == MoeSpec()
    assert shaped.moe.builtin == MoeSpec(layers=3, experts=16, top_k=4, expert_width=64)
    built = models.ensure_model(shaped)
    other = models.ensure_model(default)
    assert built != other and built.name.startswith("moe-") and other.name.startswith("moe-")  # another key
    assert models.ensure_model(shaped) == built  # cached: the same shape finds its folder
    assert route_shape(built) == (3, 16, 4) and route_shape(other) == (2, 8, 2)
    config = json.loads((built / "config.json").read_text())
    assert config["moe_intermediate_size"] == 64 and config["num_hidden_layers"] == 3
    report = json.loads((built / "flashrl_warmstart.json").read_text())
    assert report["spec"]["experts"] == 16 and report["key"] in built.name
    assert moe_routes(shaped) == (3, 16, 4)  # the simulator's engines answer with routes of that shape


@pytest.mark.parametrize("sets, fix", [
    (["moe.builtin.expert_width=48"], "set expert_width = 64"),
    (["moe.builtin.hidden=80", "moe.builtin.heads=1", "moe.builtin.kv_heads=1"], "set hidden = 96"),
    (["moe.builtin.top_k=9"], "lower top_k or raise experts"),
    (["moe.builtin.hidden=96"], "change hidden or heads"),  # head size 24: vLLM's CPU attention
])
def test_a_shape_vllms_cpu_kernels_cannot_take_is_a_config_error_naming_the_fix(tmp_path: Path, sets: list[str],
                                                                               fix: str) -> None:
    with pytest.raises(ConfigError, match="moe.builtin") as e:
        _cfg(tmp_path, *sets)
    assert fix in str(e.value)


def test_a_shape_for_another_model_is_refused_naming_the_fix(tmp_path: Path) -> None:
    from flashrl.moe.routes import moe_problem

    cfg = _cfg(tmp_path, "model.path=builtin:tiny", "moe.replay=off", "moe.builtin.experts=16")
    assert "remove [moe.builtin]" in moe_problem(cfg, False, cfg.model.path)
    assert moe_problem(_cfg(tmp_path, "moe.builtin.experts=16"), True, "builtin:moe") == ""


def test_validate_refuses_a_kernel_shape_with_exit_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flashrl.cli import app

    res = CliRunner().invoke(app, ["validate", str(ROOT / "configs" / "moe.toml"), "--set", "moe.builtin.expert_width=40"])
    assert res.exit_code == 2 and "set expert_width = 64" in res.output, res.output
