"""The embedded default on a 2-node Ray test cluster (two raylets on this machine): node A {CPU 2, engines 2}
runs both engines, node B {CPU 1, trainer 1} the trainer; then counts what is left (ProcActors, placement groups).

    OMP_NUM_THREADS=1 python bench/ray_2node.py OUT_DIR [--set key=value ...]   -> OUT_DIR/ray-2node/
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors


def main() -> int:
    out, extra = sys.argv[1], sys.argv[2:]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"engines": 2},
                                                     "include_dashboard": True})
    b = c.add_node(num_cpus=1, resources={"trainer": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    print("node A", c.head_node.node_id, "node B", b.node_id, flush=True)
    cmd = [sys.executable, "-m", "flashrl.cli", "run", "configs/tiny.toml", "--set", f"run.output_dir={out}",
           "--set", "run.name=ray-2node", "--set", "run.dashboard=plain", "--set", "cluster.launcher=ray",
           "--set", "cluster.interface=auto", "--set", f"cluster.ray.address={c.address}",
           "--set", "cluster.ray.engine_resources={engines = 1}", "--set", "cluster.ray.trainer_resources={trainer = 1}",
           *extra]
    print(" ".join(cmd), flush=True)
    t = time.time()
    rc = subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    print("rc", rc, "wall", round(time.time() - t, 1), flush=True)
    time.sleep(3)
    alive = list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "ProcActor")])
    pgs = sum(1 for v in ray.util.placement_group_table().values() if v["state"] != "REMOVED")
    print("alive ProcActors after the run:", len(alive), "placement groups not removed:", pgs)
    ray.shutdown()
    c.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
