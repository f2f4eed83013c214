"""flashrl/launch (the launchers): per-run CURVE keys and the local launcher, with real files and real processes."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from flashrl import launch
from flashrl.config import ConfigError, load
from flashrl.launch import LaunchError, make_launcher
from flashrl.launch.local import LocalLauncher
from flashrl.wire.keys import KEYS_ENV, CurveKeys, KeyFileError

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- keys
def test_keys_file_is_private_round_trips_and_never_shows_secrets(tmp_path: Path) -> None:
    keys = CurveKeys.generate(tmp_path / "run" / "secrets" / "k.json")
    assert keys.path is not None
    assert stat.S_IMODE(keys.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.path.parent.stat().st_mode) == 0o700
    back = CurveKeys.load(keys.path)
    assert back == keys and back.server() == keys.server() and back.client() == keys.client()
    assert keys.server_public != keys.client_public and len(keys.server_secret) == 40
    text = repr(keys)
    assert keys.server_secret.decode() not in text and keys.client_secret.decode() not in text
    assert keys.server_public.decode() in text
    # the child's side: only the path travels, in the environment
    assert keys.env() == {KEYS_ENV: str(keys.path)}
    # a second run gets other keys in the same place
    again = CurveKeys.generate(keys.path)
    assert again.server_secret != keys.server_secret and CurveKeys.load(keys.path) == again


def test_keys_file_readable_by_others_or_malformed_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = CurveKeys.generate(tmp_path / "k.json")
    assert keys.path is not None
    os.chmod(keys.path, 0o644)
    with pytest.raises(KeyFileError, match="mode 644.*0600"):
        CurveKeys.load(keys.path)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    os.chmod(bad, 0o600)
    with pytest.raises(KeyFileError, match="malformed"):
        CurveKeys.load(bad)
    with pytest.raises(KeyFileError, match="cannot read"):
        CurveKeys.load(tmp_path / "missing.json")
    monkeypatch.delenv(KEYS_ENV, raising=False)
    assert CurveKeys.from_env() is None
    os.chmod(keys.path, 0o600)
    monkeypatch.setenv(KEYS_ENV, str(keys.path))
    assert CurveKeys.from_env() == keys


def test_cluster_config_and_make_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load(None)
    assert (cfg.cluster.launcher, cfg.cluster.interface) == ("local", "loopback")
    assert isinstance(make_launcher(cfg, tmp_path), LocalLauncher)
    with pytest.raises(ConfigError, match=r"cluster.interface: 'eth0' is not an IP address"):
        load(None, ["cluster.interface=eth0"])
    with pytest.raises(ConfigError, match=r"cluster.launcher: invalid value 'k8s'.*'local', 'ray', 'slurm'"):
        load(None, ["cluster.launcher=k8s"])
    # a launcher whose module is not there (yet): a LaunchError naming it, nothing started
    monkeypatch.setitem(launch._REMOTE, "slurm", ("flashrl.launch.no_such_launcher", "X", ""))
    with pytest.raises(LaunchError, match="no slurm launcher yet.*no_such_launcher"):
        make_launcher(load(None, ["cluster.launcher=slurm"]), tmp_path)
    # a launcher whose optional package is missing: the extra to install
    fake = tmp_path / "fakepkg"
    fake.mkdir()
    (fake / "fake_launcher_mod.py").write_text("import no_such_package_for_flashrl\n")
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setitem(launch._REMOTE, "ray", ("fake_launcher_mod", "X", "ray"))
    with pytest.raises(LaunchError, match=r"needs the no_such_package_for_flashrl package: pip install 'flashrl\[ray\]'"):
        make_launcher(load(None, ["cluster.launcher=ray"]), tmp_path)
    sys.modules.pop("fake_launcher_mod", None)


async def test_run_closes_the_launcher_when_the_model_cannot_be_prepared(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher is preflighted (e.g. a private Ray instance started) before the model is prepared: a failure
    in between still closes it."""
    from flashrl import models
    from flashrl.launch import driver

    closed: list[bool] = []

    class Recording(LocalLauncher):
        async def close(self) -> None:
            closed.append(True)
            await super().close()

    def no_model(cfg: object, **kw: object) -> str:
        raise RuntimeError("no model here")

    monkeypatch.setattr(driver, "make_launcher", lambda cfg, run_dir: Recording(run_dir))
    monkeypatch.setattr(models, "ensure_model", no_model)
    cfg = load(None, [f"run.output_dir={tmp_path}", "run.dashboard=off"])
    with pytest.raises(RuntimeError, match="no model here"):
        await driver.run_local(cfg)
    assert closed == [True]


def test_a_private_ray_head_needs_a_ray_with_token_auth() -> None:
    """cluster.ray.address = "": the private head runs with RAY_AUTH_MODE=token (Ray >= 2.52); an older Ray
    is refused at start with the version to install, as pyproject's floor says."""
    import re

    from flashrl.launch.ray_head import MIN_RAY, check_version

    assert MIN_RAY == (2, 52)
    assert check_version("2.52.0") is None and check_version("2.60.0") is None and check_version("3.0.0rc1") is None
    why = check_version("2.51.1")
    assert why is not None and "Ray >= 2.52" in why and "Ray 2.51.1" in why and "pip install" in why
    assert check_version("2.40.0") is not None
    floor = re.search(r'ray\[default\]>=([\d.]+)', (ROOT / "pyproject.toml").read_text())
    assert floor is not None and tuple(int(x) for x in floor.group(1).split(".")) == MIN_RAY
