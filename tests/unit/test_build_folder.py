"""models.build_folder: the one way flashrl builds a cached folder (the built-in policy, reward model and
judge): once, under a lock, in a temporary folder renamed into place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flashrl.config import from_dict
from flashrl.models import build_folder


def _built(folder: Path) -> bool:
    return (folder / "done").is_file()


def test_builds_once_renames_into_place_and_replaces_a_half_built_folder(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "thing"
    final.mkdir(parents=True)
    (final / "half").write_text("a killed older build's")  # there, not built: replaced
    calls: list[Path] = []

    def fill(tmp: Path) -> None:
        calls.append(tmp)
        assert tmp.parent == final.parent and tmp.name.startswith(".build-") and not _built(final)
        (tmp / "done").write_text("ok")

    assert build_folder(final, _built, fill) == final
    assert _built(final) and not (final / "half").exists() and len(calls) == 1
    assert build_folder(final, _built, fill) == final and len(calls) == 1  # built: not again
    assert sorted(p.name for p in final.parent.iterdir()) == ["thing", "thing.lock"]


def test_a_failed_build_leaves_nothing_but_the_lock(tmp_path: Path) -> None:
    final = tmp_path / "thing"

    def fill(tmp: Path) -> None:
        (tmp / "part").write_text("x")
        raise RuntimeError("out of memory (fake)")

    with pytest.raises(RuntimeError, match="out of memory"):
        build_folder(final, _built, fill)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing.lock"]


def test_the_builtin_reward_model_and_judge_build_through_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ensure_reward_model / ensure_judge_model with their (minutes-long) training replaced: the folder is
    built once, where the config's cache says, with its report; a second call finds it."""
    import flashrl.judge.build as jb
    import flashrl.rewardmodel.build as rb

    trained: list[str] = []

    def fake_rm(out: Path, suite: Any, spec: Any, seed: int = 0, progress: Any = None) -> dict[str, Any]:
        trained.append("rm")
        (out / "config.json").write_text("{}")
        return {"eval_pair_accuracy": 0.5}

    def fake_judge(out: Path, train: list[Any], held: list[Any], seed: int, progress: Any, **kw: Any) -> dict[str, Any]:
        trained.append("judge")
        assert train and held and (out / "config.json").is_file()  # the untrained judge was built first
        return {"eval_accuracy": 0.5}

    monkeypatch.setattr(rb, "train_rm", fake_rm)
    monkeypatch.setattr(jb, "train_judge", fake_judge)
    cache = str(tmp_path / "cache")
    env = {"name": "arithmetic", "eval_size": 20, "params": {"digits": 2, "ops": ["+"]}}
    rm_cfg = from_dict({"model": {"cache_dir": cache}, "env": env, "reward": {"model": "builtin:rm"}})
    folder = rb.ensure_reward_model(rm_cfg)
    assert folder.parent == Path(cache) and json.loads((folder / rb.RM_REPORT).read_text())["eval_pair_accuracy"] == 0.5
    assert rb.ensure_reward_model(rm_cfg) == folder and trained == ["rm"]
    judge_cfg = from_dict({"model": {"cache_dir": cache}, "env": env, "judge": {"model": "builtin:judge"}})
    folder = jb.ensure_judge_model(judge_cfg)
    assert (folder / "config.json").is_file() and jb.ensure_judge_model(judge_cfg) == folder
    assert trained == ["rm", "judge"]
    assert not [p for p in Path(cache).iterdir() if p.name.startswith(".build-")]
