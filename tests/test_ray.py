"""The Ray launcher on Ray's own multi-node test cluster (ray.cluster_utils.Cluster: two raylets on this
machine with different resources, so placement across "nodes" is real):

    node A (head): {CPU: 2, engines: 2}        node B: {CPU: 1, trainer: 1}

- preflight: what the cluster cannot hold is a LaunchError naming the resource and the numbers, before
  anything starts (also through `flashrl run`: exit 2, no actor created);
- placement, restart in the same bundle, exit codes and log tails, teardown leaving nothing (actors,
  placement groups, processes), with processes that start like the real entry points (procs.child_init);
- a SIGKILLed driver: Ray kills the actors it owned and removes its placement groups, and their
  processes die with the actors, all within 30 s;
- `flashrl run` (the embedded default, a few steps) with both engines on node A and the trainer on node B,
  over TCP with CURVE (cluster.interface = "auto"), leaving nothing behind.

The full embedded default on this layout (+20 points held-out) is measured in README "On a Ray cluster".
(This commit holds the tests that need no cluster; the cluster tests follow.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from flashrl.cluster import make_launcher
from flashrl.cluster.ray import RayLauncher
from flashrl.config import Config

ROOT = Path(__file__).resolve().parents[1]

# a process that starts like flashrl's entry points: dies with its parent (the actor) and takes its group along
SLEEPER = ["python", "-c", "import time; from flashrl.procs import child_init; child_init('sleeper'); "
           "print('sleeper up', flush=True); time.sleep(600)"]


def ray_cfg(address: str, **ray_opts: Any) -> Config:
    opts = {"address": address, "engine_resources": {"engines": 1}, "trainer_resources": {"trainer": 1},
            "placement_timeout_s": 60.0, **ray_opts}
    return msgspec.convert({"cluster": {"launcher": "ray", "ray": opts}}, Config)


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


def test_ray_config_errors_name_the_key(tmp_path: Path) -> None:
    from flashrl.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"cluster\.ray\.engine_gpus"):
        load(ROOT / "configs" / "tiny.toml", ["cluster.ray.engine_gpus=-1"])
    with pytest.raises(ConfigError, match=r"cluster\.ray"):
        load(ROOT / "configs" / "tiny.toml", ["cluster.ray.adress=auto"])
