"""The SLURM launcher end to end, without SLURM: the rendered job script's per-node commands
(`bash job.sbatch --node`, what srun runs on every node) started here as if on 2 nodes — SLURM_JOB_NODELIST
= 127.0.0.[1-2], SLURM_NODEID 0 and 1, both "nodes" this machine, each node's agent on its own port —
run the embedded default (few steps) to completion over TCP + CURVE: node 0 runs the controller and the
trainer, node 1 the two engines. And when the controller is killed, nothing is left on either node.

Slow (real vLLM engines and trainer); CI runs them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from flashrl.config import load
from flashrl.engine.server import EngineSpec
from flashrl.launch import slurm_job
from flashrl.wire.spec import spec_in
from tests.helpers import agent_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def render(tmp_path: Path, *overrides: str, config: str = "tiny.toml") -> tuple[Path, Path]:
    """`flashrl run configs/tiny.toml --launcher slurm --dry-run ...` as a user runs it; then the keys, as
    the submit path writes them before sbatch. Returns (script, run dir)."""
    sets = [f"run.output_dir={tmp_path}/runs", "run.name=two", "run.dashboard=plain", "cluster.interface=auto",
            "cluster.slurm.nodes=2", f"cluster.slurm.port={agent_port(2)}", "cluster.slurm.heartbeat_timeout_s=10",
            "engine.count=2",
            *overrides]
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / config), "--launcher", "slurm", "--dry-run"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    run_dir = tmp_path / "runs" / "two"
    slurm_job.write_keys(load(run_dir / "slurm" / "config.toml"))
    return run_dir / "slurm" / "job.sbatch", run_dir


def start_nodes(script: Path, tmp_path: Path) -> list[subprocess.Popen[bytes]]:
    nodes = []
    for n in range(2):
        env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_NNODES="2",
                   SLURM_NODEID=str(n), SLURM_PROCID=str(n), SLURM_LOCALID="0", OMP_NUM_THREADS="1")
        env.pop("FLASHRL_CURVE_KEYS", None)
        with open(tmp_path / f"node{n}.out", "wb") as out:
            nodes.append(subprocess.Popen(["bash", str(script), "--node"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    return nodes


class Descendants:
    """Every process the node commands start (sampled), to check none outlives them."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.seen: dict[int, float] = {}  # pid -> create_time
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for r in self.roots:
                try:
                    for p in [psutil.Process(r), *psutil.Process(r).children(recursive=True)]:
                        self.seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    pass
            time.sleep(0.2)

    def alive(self, within_s: float = 15.0) -> list[str]:
        self._stop.set()
        self._t.join()
        end = time.monotonic() + within_s
        while True:
            left = []
            for pid, created in self.seen.items():
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
                except psutil.Error:
                    pass
            if not left or time.monotonic() > end:
                return left
            time.sleep(0.2)


def _stop(nodes: list[subprocess.Popen[bytes]]) -> None:
    for p in nodes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_nodes(script: Path, tmp_path: Path, timeout: float) -> tuple[list[str], Descendants]:
    """Both nodes' per-node commands to their end (each within ``timeout`` s, both stopped in any case); their
    consoles, and the processes they started (to check that none is left). Both must exit 0."""
    nodes = start_nodes(script, tmp_path)
    procs = Descendants([p.pid for p in nodes])
    try:
        codes = [p.wait(timeout=timeout) for p in nodes]
    finally:
        _stop(nodes)
    out = [(tmp_path / f"node{n}.out").read_text(errors="replace") for n in range(2)]
    assert codes == [0, 0], f"node exits {codes}\nnode 0:\n{out[0][-4000:]}\nnode 1:\n{out[1][-3000:]}"
    return out, procs


def test_script_per_node_commands_run_the_embedded_default_on_two_nodes(tmp_path: Path) -> None:
    script, run_dir = render(tmp_path, "run.steps=6", "run.eval_every=3", "run.max_time_s=0")
    t0 = time.monotonic()
    out, procs = run_nodes(script, tmp_path, 240)
    # node 0: the controller and the trainer; node 1: both engines (started there by its agent)
    assert "node 0: 2 node agent(s) up; starting the controller" in out[0]
    assert "node 0: started trainer rank 0" in out[0] and "node 0: started engine" not in out[0]
    assert "node 1: started engine engine0" in out[1] and "node 1: started engine engine1" in out[1]
    assert "node 1: started trainer" not in out[1]
    assert "done: two 6 steps" in out[0] and "node 0: controller exited with code 0" in out[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval_last"] is not None
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "slurm: engine engine1 on node 1 (127.0.0.2)" in controller_log
    assert "tcp://" in controller_log  # engine sockets on the node's address (CURVE), not ipc
    assert not procs.alive(), "left behind"
    assert not (run_dir / "secrets" / "curve-keys.json").exists()  # removed by node 0 at the end
    print(f"2-node run: {time.monotonic() - t0:.0f} s")


def test_a_judge_engine_runs_on_the_node_the_layout_gives_it(tmp_path: Path) -> None:
    """configs/judge.toml on the two "nodes": the judge's engine is started by node 1's agent (the automatic CPU
    layout puts judge engines after the engines, off node 0), its verdicts train the policy, and nothing is left."""
    from flashrl.models.tiny import build_untrained

    judge = build_untrained(tmp_path / "judge", seed=3)  # untrained: its verdicts mostly do not parse (defaulted)
    script, run_dir = render(tmp_path, "run.steps=4", "run.eval_every=0", "run.max_time_s=0", "env.eval_size=16",
                             "run.checkpoint_every=0", f'judge.model="{judge}"', 'judge.on_unparsable="default"',
                             "rollout.turn_timeout_s=300", config="judge.toml")
    out, procs = run_nodes(script, tmp_path, 400)
    assert "node 1: started judge engine judge0" in out[1] and "started judge engine" not in out[0]
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "slurm: judge engine judge0 on node 1 (127.0.0.2)" in controller_log and "(slurm launcher)" in controller_log
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 4 and last["env/judge_verdicts"] > 0 and last["env/judge_engines_started"] == 1
    assert not procs.alive(), "left behind"


def test_engine_restarts_on_its_node_and_a_killed_controller_leaves_nothing(tmp_path: Path) -> None:
    """Engine restart through the SLURM launcher (another spawn on node 1), then `kill -9` of the controller:
    node 0 shuts node 1 down, and no process of either node is left."""
    script, run_dir = render(tmp_path, "run.steps=100000", "run.max_time_s=0", "run.eval_every=0")
    nodes = start_nodes(script, tmp_path)
    procs = Descendants([p.pid for p in nodes])
    log = run_dir / "logs" / "controller.log"

    def wait_for(what: str, cond: object, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not cond():  # type: ignore[operator]
            assert time.monotonic() < end, f"no {what} within {timeout:.0f} s\n" + (tmp_path / "node0.out").read_text()[-3000:]
            assert all(p.poll() is None for p in nodes), (tmp_path / "node0.out").read_text()[-3000:]
            time.sleep(0.5)

    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for("training", lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 240)
        engine0 = [c for c in psutil.Process(nodes[1].pid).children()
                   if (spec := spec_in(c.environ(), EngineSpec)) is not None and spec.name == "engine0"]
        assert len(engine0) == 1
        engine0[0].kill()
        wait_for("restart", lambda: "engine engine0 is back at version" in log.read_text(), 300)  # 50-130 s measured
        assert (tmp_path / "node1.out").read_text().count("node 1: started engine engine0") == 2
        controller = [c for c in psutil.Process(nodes[0].pid).children() if "run" in c.cmdline()]
        assert len(controller) == 1
        controller[0].kill()
        codes = [p.wait(timeout=60) for p in nodes]
    finally:
        _stop(nodes)
    out0 = (tmp_path / "node0.out").read_text(errors="replace")
    assert codes[0] == 128 + 9 and "node 0: controller was killed by SIGKILL" in out0, out0[-3000:]
    assert codes[1] == 0  # shut down by node 0
    assert not procs.alive(), "left behind"
