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

The full embedded default on this layout (+20 points held-out) is measured in docs/clusters.md ("Ray").
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from flashrl.config import Config
from flashrl.launch import LaunchError
from flashrl.launch.ray import RayLauncher
from flashrl.metrics import read_jsonl
from tests.helpers import killed_on_exit

ROOT = Path(__file__).resolve().parents[2]

# a process that starts like flashrl's entry points: dies with its parent (the actor) and takes its group along
SLEEPER = ["python", "-c", "import time; from flashrl.procs import child_init; child_init('sleeper'); "
           "print('sleeper up', flush=True); time.sleep(600)"]


def ray_cfg(address: str, **ray_opts: Any) -> Config:
    opts = {"address": address, "engine_resources": {"engines": 1}, "trainer_resources": {"trainer": 1},
            "placement_timeout_s": 60.0, **ray_opts}
    # 2 engines + 1 trainer rank (the default is 1 engine): placement across both nodes of the test cluster
    return msgspec.convert({"cluster": {"launcher": "ray", "ray": opts}, "engine": {"count": 2}}, Config)


# --------------------------------------------------------------------------- on the test cluster
@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"engines": 2},
                                                     "include_dashboard": True})
    b = c.add_node(num_cpus=1, resources={"trainer": 1, "judges": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield {"address": c.address, "node_a": c.head_node.node_id, "node_b": b.node_id}
    finally:
        ray.shutdown()
        c.shutdown()


def _alive_proc_actors() -> int:
    return len(list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "ProcActor")]))


def _live_pgs() -> int:
    return sum(1 for v in ray.util.placement_group_table().values() if v["state"] != "REMOVED")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _settled(pids: list[int], timeout: float) -> dict[str, int]:
    """Leftover ProcActors / placement groups / processes, polled until all are 0 or ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        left = {"actors": _alive_proc_actors(), "placement_groups": _live_pgs(),
                "processes": sum(_pid_alive(p) for p in pids)}
        if not any(left.values()) or time.monotonic() > end:
            return left
        time.sleep(0.5)


@pytest.mark.slow
def test_preflight_names_the_resource_and_the_numbers(cluster: dict[str, Any], tmp_path: Path) -> None:
    addr = cluster["address"]
    cases = [
        (dict(engine_gpus=1, trainer_gpus=1),
         r"cluster: 3 GPUs requested \(engine\.count=2 x cluster\.ray\.engine_gpus=1 \+ trainer\.ranks=1 x "
         r"cluster\.ray\.trainer_gpus=1\), the Ray cluster has 0"),
        (dict(engine_cpus=2),
         r"cluster: 5 CPUs requested \(engine\.count=2 x cluster\.ray\.engine_cpus=2 \+ trainer\.ranks=1 x "
         r"cluster\.ray\.trainer_cpus=1\), the Ray cluster has 3"),
        (dict(engine_resources={"engines": 1, "fast_disk": 1}),
         r"2 of resource 'fast_disk' requested \(engine\.count=2 x cluster\.ray\.engine_resources\.fast_disk=1\), "
         r"the Ray cluster has 0"),
        # enough in total, but no single node holds one rank's bundle (node B has 1 CPU, node A no 'trainer')
        (dict(trainer_cpus=2, engine_cpus=0.5),
         r"trainer ranks packed 1 per node need \{CPU: 2, trainer: 1\} on one node .*the largest per resource: "
         r"CPU 2, trainer 1"),
    ]
    for opts, pattern in cases:
        launcher = RayLauncher(ray_cfg(addr, **opts), tmp_path)
        with pytest.raises(LaunchError, match=pattern):
            launcher.preflight()
    assert _alive_proc_actors() == 0 and _live_pgs() == 0  # nothing started

    # through the CLI: exit 2 with the message, before any process starts
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--set", "engine.count=2",
           "--set", f"run.output_dir={tmp_path}", "--set", "run.dashboard=plain", "--set", "cluster.launcher=ray",
           "--set", f"cluster.ray.address={addr}", "--set", "cluster.ray.engine_gpus=1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "launch error: cluster: 2 GPUs requested (engine.count=2 x cluster.ray.engine_gpus=1), the Ray cluster has 0" \
        in out.stderr
    assert not (tmp_path / "tiny" / "logs" / "engine0.log").exists()
    assert _alive_proc_actors() == 0 and _live_pgs() == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_placement_restart_and_teardown(cluster: dict[str, Any], tmp_path: Path) -> None:
    launcher = RayLauncher(ray_cfg(cluster["address"]), tmp_path)
    launcher.preflight()
    await launcher.start()
    try:
        ep = await launcher.endpoint("engine", 0)
        assert ep.bind.startswith("tcp://127.0.0.1:") and ep.host == "127.0.0.1"  # interface loopback: one machine
        assert launcher.trainer_master() == "127.0.0.1" and await launcher.trainer_port() > 0
        procs = {f"{r}{i}": await launcher.spawn(r, i, SLEEPER, {"FLASHRL_TEST": "1"}, tmp_path / "logs" / f"{r}{i}.log")
                 for r, i in (("engine", 0), ("engine", 1), ("trainer", 0))}
        where = launcher.placement()
        assert {k: v["node_id"] for k, v in where.items()} == {
            "engine0": cluster["node_a"], "engine1": cluster["node_a"], "trainer0": cluster["node_b"]}
        # the run directory records it too, and Ray agrees on where each actor lives
        assert json.loads((tmp_path / "cluster.json").read_text())["placement"] == where
        nodes = {a.node_id for a in list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "ProcActor")])}
        assert nodes == {cluster["node_a"], cluster["node_b"]}
        for p in procs.values():
            assert p.alive
        await asyncio.sleep(1.0)
        assert "sleeper up" in procs["engine1"].log_tail()

        # a dead process: its code, cached alive, the tail in describe(); restart = a new actor, same bundle
        first_pid = where["engine0"]["pid"]
        procs["engine0"].kill()
        assert await asyncio.wait_for(procs["engine0"].exited(), 30) == -signal.SIGKILL
        assert not procs["engine0"].alive and procs["engine0"].returncode == -9
        assert "was killed by SIGKILL" in procs["engine0"].describe() and "sleeper up" in procs["engine0"].describe()
        await launcher.endpoint("engine", 0)
        again = await launcher.spawn("engine", 0, SLEEPER, {}, tmp_path / "logs" / "engine0.log")
        moved = launcher.placement()["engine0"]
        assert moved["node_id"] == cluster["node_a"] and moved["generation"] == 2 and moved["pid"] != first_pid
        assert again.alive and not _pid_alive(first_pid)

        # an orderly stop of a process that ignores nothing: SIGTERM ends it
        assert await again.stop(1.0, term_s=5.0) == -signal.SIGTERM
        assert launcher.leftovers() == {"actors": 3, "placement_groups": 2, "processes": 2}
        pids = [first_pid] + [v["pid"] for v in launcher.placement().values()]
    finally:
        await launcher.close()
    assert launcher.leftovers() == {"actors": 0, "placement_groups": 0, "processes": 0}
    assert _settled(pids, 10) == {"actors": 0, "placement_groups": 0, "processes": 0}


DRIVER = """
import asyncio, json, sys
from pathlib import Path
import msgspec
from flashrl.launch.ray import RayLauncher
from flashrl.config import Config
run = Path(sys.argv[2])
cfg = msgspec.convert({"cluster": {"launcher": "ray", "ray": json.loads(sys.argv[1])}, "engine": {"count": 2}}, Config)
async def main():
    launcher = RayLauncher(cfg, run)
    launcher.preflight()
    await launcher.start()
    for role, i in (("engine", 0), ("engine", 1), ("trainer", 0)):
        await launcher.spawn(role, i, json.loads(sys.argv[3]), {}, run / "logs" / f"{role}{i}.log")
    print(json.dumps({"placement": launcher.placement(), "head": launcher._head_pid}), flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def _start_driver(ray_opts: dict[str, Any], run_dir: Path) -> tuple[subprocess.Popen[str], list[int], int]:
    """A driver process that places 2 engines + 1 trainer rank (sleepers); returns it, the sleepers' pids and
    the pid of its private instance's head child (0: it connected to a running cluster)."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(ray_opts), str(run_dir), json.dumps(SLEEPER)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid())))
    line = driver.stdout.readline() if driver.stdout else ""
    if not line:
        driver.kill()
        pytest.fail(f"the driver exited ({driver.wait()}) before placing its processes")
    out = json.loads(line)
    pids = [v["pid"] for v in out["placement"].values()]
    assert len(pids) == 3 and all(_pid_alive(p) for p in pids)
    return driver, pids, int(out["head"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_driver_leaves_nothing_behind(cluster: dict[str, Any], tmp_path: Path) -> None:
    opts = {"address": cluster["address"], "engine_resources": {"engines": 1}, "trainer_resources": {"trainer": 1}}
    driver, pids, head = _start_driver(opts, tmp_path)
    assert head == 0
    try:
        assert _alive_proc_actors() == 3 and _live_pgs() == 2
    finally:
        driver.kill()  # SIGKILL: no close(), no atexit
        driver.wait()
    t0 = time.monotonic()
    assert _settled(pids, 30) == {"actors": 0, "placement_groups": 0, "processes": 0}
    assert time.monotonic() - t0 < 30


def _instance_processes(head: int, gcs: str) -> list[str]:
    """Processes of a private Ray instance: its head child's session (Ray's daemons and workers stay in it;
    `ray start` only moves itself into a process group of its own) or a command line naming its GCS."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if stat[0] != b"Z" and (int(stat[3]) == head or gcs in cmdline):
            found.append(f"{entry} {cmdline[:120]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_driver_of_a_private_instance_leaves_nothing_behind(tmp_path: Path) -> None:
    """cluster.ray.address = "": the driver starts its own Ray (a supervised `ray start --head` child); SIGKILLed,
    every process of that instance (Ray's daemons, its workers, the sleepers) is gone within 30 s."""
    driver, pids, head = _start_driver({"address": ""}, tmp_path)
    try:
        gcs = json.loads((tmp_path / "cluster.json").read_text())["gcs_address"]
        before = _instance_processes(head, gcs)
        # the head child, `ray start`, gcs_server, raylet, the agents, 3 ProcActor workers at least
        assert head > 0 and len(before) >= 7, before
        assert any("gcs_server" in p for p in before) and any("raylet" in p for p in before), before
    finally:
        driver.kill()  # SIGKILL: no close(), no atexit
        driver.wait()
    t0 = time.monotonic()
    left = _instance_processes(head, gcs)
    while (left or any(_pid_alive(p) for p in pids)) and time.monotonic() - t0 < 30:
        time.sleep(0.5)
        left = _instance_processes(head, gcs)
    assert left == [] and not any(_pid_alive(p) for p in pids), left
    print(f"private instance: {len(before)} processes, all gone {time.monotonic() - t0:.1f} s after the driver's SIGKILL")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flashrl_run_two_engines_on_node_a_trainer_on_node_b(cluster: dict[str, Any], tmp_path: Path) -> None:
    steps = 4
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--set", "engine.count=2",
           "--set", f"run.output_dir={tmp_path}", "--set", "run.name=ray", "--set", f"run.steps={steps}",
           "--set", "run.eval_every=0", "--set", "env.eval_size=16", "--set", "run.dashboard=plain",
           "--set", "run.max_time_s=0", "--set", "cluster.launcher=ray", "--set", "cluster.interface=auto",
           "--set", f"cluster.ray.address={cluster['address']}",
           "--set", "cluster.ray.engine_resources={engines = 1}", "--set", "cluster.ray.trainer_resources={trainer = 1}"]
    env = dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid()))  # dies with this test
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, env=env)
    run_dir = tmp_path / "ray"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    placed = json.loads((run_dir / "cluster.json").read_text())["placement"]
    assert {k: v["node_id"] for k, v in placed.items()} == {
        "engine0": cluster["node_a"], "engine1": cluster["node_a"], "trainer0": cluster["node_b"]}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert max(r["step"] for r in rows) == steps and all(r["time/weight_sync_s"] > 0 for r in rows if r["step"] >= 1)
    # logs in the run directory; sockets on the node's address with CURVE keys (gone with the run)
    assert "serving" in (run_dir / "logs" / "engine1.log").read_text()
    assert not (run_dir / "secrets" / "curve-keys.json").exists()
    assert _settled([v["pid"] for v in placed.values()], 30) == {"actors": 0, "placement_groups": 0, "processes": 0}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_judge_engine_placed_by_ray_is_killed_and_restarted_in_its_bundle(cluster: dict[str, Any], tmp_path: Path) -> None:
    """`flashrl run configs/judge.toml` on the test cluster: the judge's engine goes where cluster.ray.judge_* put it
    (node B, beside the trainer), a SIGKILL of it is seen through Ray, it comes back in the same bundle, and the run
    finishes every step once with the retries counted; nothing is left."""
    from flashrl.models.tiny import build_untrained

    judge = build_untrained(tmp_path / "judge", seed=3)  # untrained: its verdicts mostly do not parse (counted)
    steps = 8
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "judge.toml"),
           "--set", f"run.output_dir={tmp_path}", "--set", "run.name=rayjudge", "--set", f"run.steps={steps}",
           "--set", "run.eval_every=0", "--set", "env.eval_size=16", "--set", "run.dashboard=plain",
           "--set", "run.max_time_s=0", "--set", "run.checkpoint_every=0", "--set", "rollout.turn_timeout_s=300",
           "--set", f'judge.model="{judge}"', "--set", 'judge.on_unparsable="default"',
           "--set", "cluster.launcher=ray", "--set", f"cluster.ray.address={cluster['address']}",
           "--set", "cluster.ray.engine_resources={engines = 1}", "--set", "cluster.ray.trainer_resources={trainer = 1}",
           "--set", "cluster.ray.trainer_cpus=0.5", "--set", "cluster.ray.judge_cpus=0.5",
           "--set", "cluster.ray.judge_resources={judges = 1}"]
    env = dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid()))
    run_dir = tmp_path / "rayjudge"
    out_file = (tmp_path / "out.txt").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    placed: dict[str, Any] = {}
    with killed_on_exit(proc):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # training step 2, with the judge up
            assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and any(r.get("step", 0) >= 2 for r in read_jsonl(metrics)):
                placed = json.loads((run_dir / "cluster.json").read_text())["placement"]
                if "judge0" in placed:
                    break
            time.sleep(0.2)
        assert placed.get("judge0", {}).get("node_id") == cluster["node_b"], placed
        first = placed["judge0"]["pid"]
        os.killpg(first, signal.SIGKILL)  # its whole group (vLLM's EngineCore too)
        proc.wait(timeout=600)
    out_file.close()
    assert proc.returncode == 0, (tmp_path / "out.txt").read_text()[-3000:]
    after = json.loads((run_dir / "cluster.json").read_text())["placement"]
    assert after["judge0"]["node_id"] == cluster["node_b"] and after["judge0"]["generation"] == 2, after
    assert after["judge0"]["pid"] != first and after["trainer0"]["node_id"] == cluster["node_b"]
    assert after["engine0"]["node_id"] == cluster["node_a"]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    last = rows[-1]
    assert last["env/judge_engine_died"] == 1 and last["env/judge_engine_restarts"] == 1, last
    assert last["env/judge_engines_started"] == 2 and last.get("env/judge_failed", 0) == 0
    assert "serving" in (run_dir / "logs" / "judge0-2.log").read_text()
    assert _settled([first] + [v["pid"] for v in after.values()], 30) == {"actors": 0, "placement_groups": 0,
                                                                          "processes": 0}
