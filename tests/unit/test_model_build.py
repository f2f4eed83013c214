"""`flashrl init-model CONFIG` builds the model of every shipped config (issue 39): builtin:tiny by its
warm-start, a missing folder by its [model.build] recipe (realsize's 0.27B chat model, chat-multiturn's), and
a model the user brings (a downloaded Qwen) is a clear error saying so."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import ConfigError, ModelBuildConfig, load
from flashrl.models import (
    BUILTIN_MODELS,
    ModelNotBuilt,
    ModelPathError,
    chat_model,
    ensure_model,
    load_tokenizer,
)
from flashrl.vision.build import BUILTIN_VLM

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.fixture
def fake_builder(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """chat_model.build_chat_model replaced by one that records its arguments and writes a config.json."""
    calls: list[dict] = []

    def build(path, **kw):
        calls.append({"path": Path(path), **kw})
        (Path(path) / "config.json").write_text("{}")
        return Path(path)

    monkeypatch.setattr(chat_model, "build_chat_model", build)
    return calls


def test_init_model_builds_realsize_with_its_recipe(tmp_path: Path, fake_builder: list[dict]) -> None:
    """configs/realsize.toml as shipped (but its folder): init-model runs the 0.25b chat recipe once, aside and
    renamed into place; validate notes the missing folder without building it."""
    folder = tmp_path / "realsize" / "model"
    (folder.parent / ".model.build-killed").mkdir(parents=True)  # what a build killed by SIGKILL/SIGTERM leaves
    args = ["configs/realsize.toml", "--set", f"model.path={folder}"]
    r = CliRunner().invoke(app, ["validate", str(ROOT / args[0]), *args[1:]])
    assert r.exit_code == 0 and "is not built yet; `flashrl init-model CONFIG`" in r.output and fake_builder == [], r.output
    r = CliRunner().invoke(app, ["init-model", str(ROOT / args[0]), *args[1:]])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == str(folder) and (folder / "config.json").is_file()
    (call,) = fake_builder
    assert call["size"] == "0.25b" and call["arch"] == "qwen3" and call["template"] == "chatml" and call["seed"] == 0
    assert call["path"].parent == folder.parent and call["path"] != folder  # built aside, then renamed
    assert sorted(p.name for p in folder.parent.iterdir()) == [".model.lock", "model"]
    r = CliRunner().invoke(app, ["init-model", str(ROOT / args[0]), *args[1:]])
    assert r.exit_code == 0 and len(fake_builder) == 1  # built once


def test_a_failed_build_leaves_nothing_half_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path, **kw):
        (Path(path) / "model.safetensors").write_text("half")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(chat_model, "build_chat_model", broken)
    cfg = load(ROOT / "configs" / "realsize.toml", [f"model.path={tmp_path / 'm'}"])
    with pytest.raises(RuntimeError, match="killed mid-build"):
        ensure_model(cfg)
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def test_init_model_really_builds_chat_multiturns_model(tmp_path: Path) -> None:
    """The small recipe for real (seconds): a chat model folder with the qwen3 template, as the config wants."""
    cfg = load(ROOT / "configs" / "chat-multiturn.toml", [f"model.path={tmp_path / 'chat'}"])
    path = ensure_model(cfg)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    tok = load_tokenizer(path, cfg.model.chat_template, cfg.model.system_prompt)
    assert tok.chat is not None and "<think>" in tok.decode(tok.encode_prompt("Guess 0-9:\n"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_names_a_model_init_model_builds_or_says_whose_it_is(path: Path, tmp_path: Path) -> None:
    cfg = load(path)
    if cfg.model.path in (*BUILTIN_MODELS, BUILTIN_VLM):
        return  # built and warm-started by ensure_model / ensure_vlm (tests/unit/test_models.py, test_vision.py)
    if cfg.model.build.recipe != "none":
        with pytest.raises(ModelNotBuilt, match=r"`flashrl init-model CONFIG`"):
            ensure_model(load(path, [f"model.path={tmp_path / 'm'}"]), build=False)
        return
    if Path(cfg.model.path).exists():
        pytest.skip(f"{cfg.model.path} exists on this machine")
    with pytest.raises(ModelPathError, match=r"this model is yours to provide: download it \(e\.g\. `hf download"):
        ensure_model(cfg)
    r = CliRunner().invoke(app, ["init-model", str(path)])
    assert r.exit_code == 2 and "yours to provide" in r.output, r.output


def test_the_build_sizes_are_the_builders() -> None:
    size = next(f.type for f in msgspec.structs.fields(ModelBuildConfig) if f.name == "size")
    assert set(typing.get_args(typing.get_args(size)[0])) == set(chat_model.SIZES)
    template = next(f.type for f in msgspec.structs.fields(ModelBuildConfig) if f.name == "template")
    assert set(typing.get_args(typing.get_args(template)[0])) == set(chat_model.TEMPLATES)


def test_build_options_without_a_recipe_or_for_the_builtin_model_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"model\.build: options of a build recipe, but model\.build\.recipe = \"none\""):
        load(None, ["model.path=/tmp/x", "model.build.size=0.25b"])
    with pytest.raises(ConfigError, match=r"model\.build\.recipe: 'chat' builds a model folder, but model\.path is"):
        load(None, ["model.build.recipe=chat"])
