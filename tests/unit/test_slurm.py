"""The SLURM launcher (issue 11, item 3), the parts that need no process: host lists, the layout and its
errors, the rendered script (snapshot). The 2-node run of the embedded default from the script's own
per-node commands is tests/integration/test_slurm_run.py (slow).

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_slurm_process.py."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from flashrl.config import Config, load
from flashrl.launch import LaunchError, slurm, slurm_job

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "tests" / "snapshots" / "slurm_4node_gpu.sbatch"

GPU_4NODE = """
[run]
name = "qwen-4node"
[model]
path = "/models/Qwen2.5-7B-Instruct"
dtype = "bfloat16"
[engine]
count = 16
device = "cuda"
[trainer]
ranks = 16
backend = "nccl"
[cluster]
launcher = "slurm"
interface = "auto"
[cluster.slurm]
nodes = 4
gpus_per_node = 8
partition = "gpu"
account = "rl-team"
time = "12:00:00"
sbatch = ["--qos=high", "--constraint=h100"]
setup = ["module load cuda/12.4"]
"""


def cfg_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load(p, overrides or [])


def render_4node(tmp_path: Path) -> str:
    cfg = cfg_of(tmp_path, GPU_4NODE)
    return slurm_job.render_script(cfg, slurm_job.plan(cfg), config_path="/shared/flashrl/runs/qwen-4node/slurm/config.toml",
                               run_dir="/shared/flashrl/runs/qwen-4node", workdir="/shared/flashrl",
                               python="/shared/flashrl/.venv/bin/python")


def _agent_cfg(tmp_path: Path, port: int, nodes: int = 2, extra: list[str] | None = None) -> Config:
    return load(ROOT / "configs" / "tiny.toml", [
        f"run.output_dir={tmp_path}", "run.name=agents", "cluster.launcher=slurm", "cluster.interface=auto",
        f"cluster.slurm.nodes={nodes}", f"cluster.slurm.port={port}", "cluster.slurm.heartbeat_timeout_s=4",
        "trainer.ranks=2", "engine.count=2", *(extra or []),
    ])


# ---------------------------------------------------------------------------- (c) host lists
@pytest.mark.parametrize(("spec", "hosts"), [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu-[1,3]-ib,login", ["gpu-1-ib", "gpu-3-ib", "login"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ("", []),
])
def test_hostlist_expands(spec: str, hosts: list[str]) -> None:
    assert slurm_job.expand_hostlist(spec) == hosts


@pytest.mark.parametrize(("spec", "why"), [
    ("node[01-03", "'[' without ']'"),
    ("node01]", "']' without '['"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "is not a number"),
    ("node[[1]]", "nested"),
    ("a,,b", "stray comma"),
])
def test_hostlist_errors_name_the_problem(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=r"host list .*" + why.replace("[", r"\[").replace("]", r"\]")):
        slurm_job.expand_hostlist(spec)


def test_node_hosts_from_env_without_scontrol() -> None:
    assert slurm_job.node_hosts({"SLURM_JOB_NODELIST": "n[1-2]"}, scontrol=False) == ["n1", "n2"]
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST is not set"):
        slurm_job.node_hosts({}, scontrol=False)
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST: host list"):
        slurm_job.node_hosts({"SLURM_JOB_NODELIST": "n[1-"}, scontrol=False)


# ---------------------------------------------------------------------------- layout
def test_auto_gpu_layout_packs_trainer_ranks_then_engines(tmp_path: Path) -> None:
    p = slurm_job.plan(cfg_of(tmp_path, GPU_4NODE))
    assert p.ranks == [list(range(8)), list(range(8, 16)), [], []]
    assert p.engines == [[], [], list(range(8)), list(range(8, 16))]
    r9 = p.place("trainer", 9)
    assert (r9.node, r9.gpus, r9.local_rank, r9.local_world, r9.group_rank) == (1, tuple(range(8)), 1, 8, 1)
    assert p.place("engine", 10).node == 3 and p.place("engine", 10).gpus == (2,)
    assert p.describe(0) == "controller (rendezvous); trainer ranks 0-7 on GPUs 0-7"


def test_explicit_layout_shares_a_node(tmp_path: Path) -> None:
    text = GPU_4NODE.replace("nodes = 4", "nodes = 2").replace("count = 16", "count = 4").replace("ranks = 16", "ranks = 4")
    text += """
[[cluster.slurm.layout]]
trainer_ranks = [0, 1, 2, 3]
engines = [3]
[[cluster.slurm.layout]]
engines = [0, 1, 2]
"""
    p = slurm_job.plan(cfg_of(tmp_path, text))
    assert p.place("engine", 3).node == 0 and p.place("engine", 3).gpus == (4,)  # after the 4 trainer GPUs
    assert p.place("trainer", 2).gpus == (0, 1, 2, 3) and p.place("trainer", 2).local_rank == 2
    assert p.place("engine", 1).node == 1 and p.place("engine", 1).gpus == (1,)
    assert p.describe(1) == "engines 0-2 on GPUs 0-2"


def test_cpu_layout_puts_engines_off_node_0(tmp_path: Path) -> None:
    cfg = load(ROOT / "configs" / "tiny.toml", ["cluster.launcher=slurm", "cluster.slurm.nodes=2", "cluster.interface=auto",
                                               "engine.count=2"])
    p = slurm_job.plan(cfg)
    assert p.ranks == [[0], []] and p.engines == [[], [0, 1]]
    assert p.describe(0) == "controller (rendezvous); trainer rank 0"


def test_judge_engines_are_placed_after_the_engines(tmp_path: Path) -> None:
    judged = ["judge.model=builtin:judge", "judge.engines=3"]
    p = slurm_job.plan(cfg_of(tmp_path, GPU_4NODE, [*judged, "cluster.slurm.nodes=5"]))  # 16 + 16 + 3 GPUs: 5 nodes
    assert p.judges == [[], [], [], [], [0, 1, 2]]
    assert p.place("judge", 2).node == 4 and p.place("judge", 2).gpus == (2,)
    assert p.describe(4) == "judge engines 0-2 on GPUs 0-2"
    # CPU nodes: round-robin over the nodes besides node 0, on from where the engines stopped
    cpu = load(ROOT / "configs" / "tiny.toml", ["cluster.launcher=slurm", "cluster.slurm.nodes=3",
                                               "cluster.interface=auto", "engine.count=3", *judged])
    assert slurm_job.plan(cpu).judges == [[], [1], [0, 2]]
    # a layout table places them; without a judge none is placed, and none may be asked for
    text = GPU_4NODE.replace("nodes = 4", "nodes = 2").replace("count = 16", "count = 4").replace("ranks = 16", "ranks = 4")
    text += "[[cluster.slurm.layout]]\ntrainer_ranks = [0, 1, 2, 3]\njudges = [0]\n[[cluster.slurm.layout]]\nengines = [0, 1, 2, 3]\n"
    p = slurm_job.plan(cfg_of(tmp_path, text, ["judge.model=j", "judge.engines=1"]))
    assert p.place("judge", 0).node == 0 and p.place("judge", 0).gpus == (4,)
    with pytest.raises(LaunchError, match=r"layout\[0\]\.judges places judge engine 0, but judge\.model is empty"):
        slurm_job.plan(cfg_of(tmp_path, text))
    with pytest.raises(LaunchError, match=r"places no node for judge engine 1 \(judge\.engines = 2\)"):
        slurm_job.plan(cfg_of(tmp_path, text, ["judge.model=j", "judge.engines=2"]))
    with pytest.raises(LaunchError, match=r"judge\.engines = 3 need 35 GPUs"):
        slurm_job.plan(cfg_of(tmp_path, GPU_4NODE, judged))
    assert slurm_job.plan(cfg_of(tmp_path, GPU_4NODE)).judges == [[], [], [], []]


# ---------------------------------------------------------------------------- (d) errors before anything starts
@pytest.mark.parametrize(("overrides", "extra", "message"), [
    (["cluster.slurm.nodes=1"], "",
     "trainer.ranks = 16 + engine.count = 16 need 32 GPUs (one each), but cluster.slurm.nodes = 1 x "
     "cluster.slurm.gpus_per_node = 8 gives 8: set cluster.slurm.nodes = 4"),
    (["cluster.slurm.gpus_per_node=4"], "",
     "need 32 GPUs (one each), but cluster.slurm.nodes = 4 x cluster.slurm.gpus_per_node = 4 gives 16"),
    (["cluster.slurm.nodes=6"], "", "cluster.slurm.nodes = 6, but trainer.ranks = 16 + engine.count = 16 fill only 4 node(s)"),
    (["cluster.slurm.gpus_per_node=0"], "", 'engine.device = "cuda" but cluster.slurm.gpus_per_node = 0'),
    (["cluster.interface=loopback"], "", 'cluster.interface = \'loopback\' cannot be reached from other nodes'),
    ([], "[[cluster.slurm.layout]]\ntrainer_ranks = [0]\n",
     "cluster.slurm.layout has 1 node table(s) but cluster.slurm.nodes = 4"),
    (["cluster.slurm.nodes=2", "engine.count=2", "trainer.ranks=2"],
     "[[cluster.slurm.layout]]\ntrainer_ranks = [0, 1]\n[[cluster.slurm.layout]]\nengines = [0, 5]\n",
     "cluster.slurm.layout[1].engines: engine 5 does not exist (engine.count = 2: engines 0-1)"),
    (["cluster.slurm.nodes=2", "engine.count=3", "trainer.ranks=2"],
     "[[cluster.slurm.layout]]\ntrainer_ranks = [0, 1]\n[[cluster.slurm.layout]]\nengines = [0]\n",
     "cluster.slurm.layout places no node for engines 1-2 (engine.count = 3)"),
    (["cluster.slurm.nodes=2", "engine.count=2", "trainer.ranks=2"],
     "[[cluster.slurm.layout]]\ntrainer_ranks = [0, 1]\nengines = [0]\n[[cluster.slurm.layout]]\nengines = [0, 1]\n",
     "engine 0 is placed twice (nodes 0 and 1)"),
    (["cluster.slurm.nodes=2", "engine.count=8", "trainer.ranks=2", "cluster.slurm.gpus_per_node=8"],
     "[[cluster.slurm.layout]]\ntrainer_ranks = [0, 1]\nengines = [0, 1, 2, 3, 4, 5, 6]\n[[cluster.slurm.layout]]\nengines = [7]\n",
     "cluster.slurm.layout[0]: 7 engine(s) + 2 trainer rank(s) need 9 GPUs (one each), but cluster.slurm.gpus_per_node = 8"),
])
def test_layout_errors_name_keys_and_numbers(tmp_path: Path, overrides: list[str], extra: str, message: str) -> None:
    with pytest.raises(LaunchError) as e:
        slurm_job.plan(cfg_of(tmp_path, GPU_4NODE + extra, overrides))
    assert message in str(e.value)


def test_rendered_4node_script_matches_the_reviewed_snapshot(tmp_path: Path) -> None:
    text = render_4node(tmp_path)
    if os.environ.get("FLASHRL_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(text)
    want = SNAPSHOT.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(SNAPSHOT), "rendered"))
        pytest.fail(f"the rendered sbatch script differs from the reviewed snapshot (review it, then rerun with "
                    f"FLASHRL_UPDATE_SNAPSHOTS=1):\n{diff}")


def test_launcher_outside_a_job_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(slurm_job.HEAD_ENV, raising=False)
    with pytest.raises(LaunchError, match="not the controller of a flashrl SLURM job"):
        slurm.SlurmLauncher(_agent_cfg(tmp_path, 29400), tmp_path).preflight()
