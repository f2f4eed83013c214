"""The Ray launcher, the parts that need no Ray cluster: bundles, requests and config errors.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_ray_process.py."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from flashrl.config import Config
from flashrl.launch import make_launcher
from flashrl.launch.ray import RayLauncher

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- without a cluster
def test_bundles_and_requests_follow_the_config(tmp_path: Path) -> None:
    cfg = msgspec.convert({"engine": {"count": 3}, "trainer": {"ranks": 5},
                           "cluster": {"launcher": "ray", "ray": {"engine_cpus": 2, "engine_gpus": 1,
                                                                  "trainer_gpus": 1, "trainer_ranks_per_node": 2,
                                                                  "trainer_resources": {"trainer": 1}}}}, Config)
    launcher = make_launcher(cfg, tmp_path)
    assert isinstance(launcher, RayLauncher)
    assert launcher.engine_bundle() == {"CPU": 2, "GPU": 1}
    # ranks packed 2 per node: 3 node bundles (2, 2, 1 ranks)
    assert launcher.trainer_bundles() == [{"CPU": 2, "GPU": 2, "trainer": 2}, {"CPU": 2, "GPU": 2, "trainer": 2},
                                          {"CPU": 1, "GPU": 1, "trainer": 1}]
    assert launcher.requested() == {"CPU": 11, "GPU": 8, "trainer": 5}
    # CPU engines ask for no GPU unless told
    cpu = RayLauncher(msgspec.convert({"engine": {"device": "cpu"}, "trainer": {"backend": "gloo"}}, Config), tmp_path)
    assert cpu.engine_bundle() == {"CPU": 1} and cpu.trainer_bundles() == [{"CPU": 1}]


def test_judge_engines_get_bundles_of_their_own_only_with_a_judge(tmp_path: Path) -> None:
    base = {"engine": {"count": 2, "device": "cuda"},
            "cluster": {"launcher": "ray", "ray": {"judge_cpus": 3, "judge_resources": {"judges": 1}}}}
    no_judge = RayLauncher(msgspec.convert(base, Config), tmp_path)
    assert no_judge.judges() == 0 and no_judge.requested() == {"CPU": 3, "GPU": 3}  # judge.engines alone asks nothing
    judged = RayLauncher(msgspec.convert({**base, "judge": {"model": "builtin:judge", "engines": 2}}, Config), tmp_path)
    assert judged.judges() == 2
    assert judged.judge_bundle() == {"CPU": 3, "GPU": 1, "judges": 1}  # judge_gpus "auto": as the engines (cuda)
    assert judged.requested() == {"CPU": 9, "GPU": 5, "judges": 2}
    cpu = RayLauncher(msgspec.convert({**base, "engine": {"device": "cpu"}, "trainer": {"backend": "gloo"},
                                       "judge": {"model": "x"}}, Config), tmp_path)
    assert cpu.judge_bundle() == {"CPU": 3, "judges": 1}


def test_ray_config_errors_name_the_key(tmp_path: Path) -> None:
    from flashrl.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"cluster\.ray\.engine_gpus"):
        load(ROOT / "configs" / "tiny.toml", ["cluster.ray.engine_gpus=-1"])
    with pytest.raises(ConfigError, match=r"cluster\.ray"):
        load(ROOT / "configs" / "tiny.toml", ["cluster.ray.adress=auto"])
