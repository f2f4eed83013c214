"""The SLURM launcher (issue 11, item 3): host lists, the layout and its errors, the rendered script
(snapshot), `flashrl run --launcher slurm` (dry run, no sbatch), and the node agent with the controller's
SlurmLauncher over real CURVE sockets and real processes. The 2-node run of the embedded default from
the script's own per-node commands is in tests/integration/test_slurm_run.py (slow)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashrl.config import load
from flashrl.launch import slurm, slurm_job, slurm_node
from flashrl.wire.keys import CurveKeys
from flashrl.wire.protocol import Msg, Spawn
from flashrl.wire.transport import RpcClient
from tests.helpers import agent_port
from tests.unit.test_slurm import GPU_4NODE, _agent_cfg, render_4node

ROOT = Path(__file__).resolve().parents[2]


def test_cli_refuses_a_layout_that_does_not_fit_and_writes_nothing(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(GPU_4NODE)
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(p), "--dry-run", "--set", "cluster.slurm.nodes=2",
                        "--set", f"run.output_dir={tmp_path}/runs"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "need 32 GPUs (one each), but cluster.slurm.nodes = 2 x cluster.slurm.gpus_per_node = 8 gives 16" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_without_sbatch_on_path_says_so(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(GPU_4NODE)
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))  # no sbatch there
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(p), "--set", f"run.output_dir={tmp_path}/runs"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "`sbatch` is not on PATH" in r.stderr and "--dry-run" in r.stderr
    assert (tmp_path / "runs" / "qwen-4node" / "slurm" / "job.sbatch").exists()
    assert not (tmp_path / "runs" / "qwen-4node" / "secrets").exists()  # keys only when submitting


def test_dry_run_needs_the_slurm_launcher(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--dry-run renders a SLURM job script" in r.stderr




def test_script_is_valid_bash_and_holds_no_secret(tmp_path: Path) -> None:
    text = render_4node(tmp_path)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True, timeout=30)
    keys = CurveKeys.generate(tmp_path / "k.json")
    for k in (keys.server_secret, keys.client_secret, keys.server_public, keys.client_public):
        assert k.decode() not in text
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    first_cmd = next(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    assert all(text.splitlines().index(s) < first_cmd for s in sbatch)  # sbatch stops reading at the first command


def test_cli_dry_run_prints_and_writes_the_script(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "slurm-gpu-2node.toml"),
                        "--dry-run", "--set", f"run.output_dir={tmp_path}/runs"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "runs" / "qwen-2node" / "slurm" / "job.sbatch"
    assert script.read_text() == r.stdout.rstrip("\n") + "\n"
    assert "#SBATCH --nodes=2" in r.stdout and "#SBATCH --gpus-per-node=8" in r.stdout
    assert f"cd {tmp_path}" in r.stdout
    assert load(script.parent / "config.toml") == load(ROOT / "configs" / "slurm-gpu-2node.toml",
                                                        [f"run.output_dir={tmp_path}/runs"])
    assert not (tmp_path / "runs" / "qwen-2node" / "secrets").exists()


def test_cli_launcher_flag_is_the_set_shorthand(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--launcher", "slurm",
                        "--dry-run", "--set", f"run.output_dir={tmp_path}", "--set", "cluster.slurm.nodes=2",
                        "--set", "cluster.interface=auto", "--set", "engine.count=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '1) exec "$PY" -m flashrl.cli node "$CONFIG" --node 1 ;;  # engines 0-1' in r.stdout
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--launcher", "pbs",
                        "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cluster.launcher" in r.stderr


# ---------------------------------------------------------------------------- the node agent + SlurmLauncher
SLEEPER = ["python", "-c", "import os, sys, time; print('up', os.environ.get('LOCAL_RANK'), os.environ.get('FLASHRL_CURVE_KEYS'), flush=True); time.sleep(60)"]




def test_launcher_spawns_polls_restarts_and_tears_down_through_node_agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two node agents (in this process's loop, real CURVE sockets) and the controller's launcher: a process
    placed on node 1 starts there with the run's key file and torchrun's per-node variables; a killed one is
    seen exited; a restart is a new spawn; a client without the run's keys is not answered; close() leaves nothing."""
    port = agent_port(2)
    cfg = _agent_cfg(tmp_path, port, extra=["judge.model=builtin:judge", "judge.engines=1"])
    keys = slurm_job.write_keys(cfg)
    monkeypatch.setenv(slurm_job.HEAD_ENV, "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "127.0.0.[1-2]")
    monkeypatch.delenv("FLASHRL_CURVE_KEYS", raising=False)

    async def main() -> None:
        from flashrl.wire.protocol import NODE_REQUESTS
        from flashrl.wire.transport import RpcServer

        agents = [slurm_node.NodeAgent(cfg, n, keys) for n in range(2)]
        servers = [RpcServer(f"tcp://0.0.0.0:{a.port}", NODE_REQUESTS, a.handle, name=f"a{n}", curve=keys.server())
                   for n, a in enumerate(agents)]
        serving = [asyncio.create_task(s.serve()) for s in servers]
        launcher = slurm.SlurmLauncher(cfg, cfg.run_dir)
        launcher.preflight()
        await launcher.start()
        try:
            ep = await launcher.endpoint("engine", 1)
            assert ep.host == agents[1].host and ep.bind.startswith(f"tcp://{ep.host}:")
            assert launcher.trainer_master() == agents[0].host
            e1 = await launcher.spawn("engine", 1, SLEEPER, {"X": "1"}, cfg.run_dir / "logs" / "engine1.log")
            t1 = await launcher.spawn("trainer", 1, SLEEPER, {"LOCAL_RANK": "7"}, cfg.run_dir / "logs" / "trainer1.log")
            assert [k for k in agents[1].children] == [e1.key] and [k for k in agents[0].children] == [t1.key]  # type: ignore[attr-defined]
            # the judge's engine goes where the plan puts it (CPU nodes: round-robin after the engines -> node 1)
            assert launcher.plan is not None and launcher.plan.node_of("judge", 0) == 1
            j0 = await launcher.spawn("judge", 0, SLEEPER, {}, cfg.run_dir / "logs" / "judge0-1.log")
            assert j0.key in agents[1].children and j0.name == "judge engine judge0"  # type: ignore[attr-defined]
            assert (await launcher.endpoint("judge", 0)).host == agents[1].host
            await asyncio.sleep(1.5)
            assert e1.alive and t1.alive
            assert f"up 1 {keys.path}" in t1.log_tail()  # LOCAL_RANK from the layout (ranks 0-1 on node 0); keys by path
            # a client without the run's keys gets no answer
            from flashrl.wire.protocol import NODE_REPLIES, NodeHello

            stranger = RpcClient(f"tcp://127.0.0.2:{port + 1}", NODE_REPLIES, name="stranger",
                                 curve=CurveKeys.new().client() | {"server_public": keys.server_public})
            with pytest.raises(TimeoutError):
                await stranger.request(NodeHello(), timeout=1.5)
            await stranger.close()
            # killed on its node -> seen exited by the poll, described with its node
            os.kill(agents[1].children[e1.key].pid, signal.SIGKILL)  # type: ignore[attr-defined]
            async with asyncio.timeout(5):
                assert await e1.exited() == -9
            assert "engine engine1 was killed by SIGKILL (node 1 127.0.0.2" in e1.describe()
            assert await e1.reap_group()
            e1b = await launcher.spawn("engine", 1, SLEEPER, {}, cfg.run_dir / "logs" / "engine1.log")  # the restart
            assert e1b.key != e1.key and e1b.alive  # type: ignore[attr-defined]
            assert await e1b.stop(1.0) == -15
            assert await j0.stop(1.0) == -15
            assert launcher.leftovers() == {"processes": 1}
        finally:
            await launcher.close()
        assert launcher.leftovers() == {"processes": 0}
        assert all(c.returncode is not None for a in agents for c in a.children.values())
        for t in serving:
            t.cancel()
        await asyncio.gather(*serving, return_exceptions=True)

    asyncio.run(main())


def _node_proc(cfg_path: Path, node: int, nodelist: str, out: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SLURM_JOB_ID="1", SLURM_JOB_NODELIST=nodelist, SLURM_NODEID=str(node), SLURM_PROCID=str(node))
    env.pop("FLASHRL_CURVE_KEYS", None)
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "flashrl.cli", "node", str(cfg_path), "--node", str(node)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)


async def _spawn_sleeper(c: RpcClient, log_path: Path) -> Msg:
    """Node 1's agent's reply to a Spawn of SLEEPER, asked again every second until the agent answers (30 s)."""
    async with asyncio.timeout(30):
        while True:
            try:
                return await c.request(Spawn(key="s", name="sleeper", argv=SLEEPER, log_path=str(log_path)), timeout=1.0)
            except TimeoutError:
                continue


def test_node_agent_without_node_0_stops_its_processes_and_exits(tmp_path: Path) -> None:
    """Node 0 gone (never came, or stopped heartbeating): a node's agent stops what it started and exits 1."""
    port = agent_port(2)
    cfg = _agent_cfg(tmp_path, port, extra=["cluster.slurm.connect_timeout_s=2"])
    keys = slurm_job.write_keys(cfg)
    cfg_path = tmp_path / "c.toml"
    from flashrl.config import to_toml

    cfg_path.write_text(to_toml(cfg))
    p = _node_proc(cfg_path, 1, "127.0.0.[1-2]", tmp_path / "n1.out")  # nobody ever calls
    t0 = time.monotonic()
    assert p.wait(timeout=60) == 1
    assert "nothing heard from node 0" in (tmp_path / "n1.out").read_text()
    assert "cluster.slurm.connect_timeout_s = 2" in (tmp_path / "n1.out").read_text()
    assert time.monotonic() - t0 < 30

    # heartbeats stop after a process was started: the process goes with the agent
    p = _node_proc(cfg_path, 1, "127.0.0.[1-2]", tmp_path / "n1b.out")

    async def start_one() -> int:
        from flashrl.wire.protocol import NODE_REPLIES, Spawned

        c = RpcClient(f"tcp://127.0.0.2:{port + 1}", NODE_REPLIES, name="n1", curve=keys.client())
        try:
            r = await _spawn_sleeper(c, tmp_path / "s.log")
        finally:
            await c.close()
        assert isinstance(r, Spawned)
        return r.pid

    pid = asyncio.run(start_one())
    assert p.wait(timeout=60) == 1  # heartbeat_timeout_s = 4 after the last request
    out = (tmp_path / "n1b.out").read_text()
    assert "started sleeper" in out and "cluster.slurm.heartbeat_timeout_s = 4" in out
    assert _gone(pid, 10)


def _gone(pid: int, within_s: float) -> bool:
    import psutil

    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_prepare_writes_missing_keys_and_keeps_present_ones(tmp_path: Path) -> None:
    """`flashrl node CONFIG --prepare` (the job's batch step): keys 0600 when missing (a script submitted by
    hand), kept when `flashrl run --launcher slurm` wrote them; no key material in its output."""
    model = tmp_path / "model"  # a model folder (builtin:tiny would be built here when not cached)
    cfg = _agent_cfg(tmp_path, 29400, extra=[f"model.path={model}"])
    from flashrl.config import to_toml

    (tmp_path / "c.toml").write_text(to_toml(cfg))
    cmd = [sys.executable, "-m", "flashrl.cli", "node", str(tmp_path / "c.toml"), "--prepare"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "model.path:" in r.stderr and "does not exist" in r.stderr  # before any job step
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"flashrl: model {model}" in r.stdout
    path = cfg.run_dir / "secrets" / "curve-keys.json"
    assert "(written, 0600)" in r.stdout and (path.stat().st_mode & 0o777) == 0o600
    keys = CurveKeys.load(path)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "(kept)" in r.stdout
    assert CurveKeys.load(path) == keys
    for k in (keys.server_secret, keys.client_secret):
        assert k.decode() not in r.stdout + r.stderr


def test_submit_writes_keys_then_calls_sbatch(tmp_path: Path) -> None:
    """Without --dry-run: the keys (0600) exist before `sbatch --parsable job.sbatch` runs; its job id is
    reported; a refusal is an error with sbatch's message. (SLURM is not installed here: a stand-in `sbatch`
    on PATH records what it was given; the script itself is what the 2-node test runs.)"""
    p = tmp_path / "c.toml"
    p.write_text(GPU_4NODE)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "sbatch"
    fake.write_text('#!/bin/bash\necho "$@" > "$SBATCH_ARGS"\nstat -c %a "$KEYS" >> "$SBATCH_ARGS"\n'
                    'if [ -n "$SBATCH_REFUSE" ]; then echo "sbatch: error: invalid partition" >&2; exit 1; fi\necho "4242;cluster"\n')
    fake.chmod(0o755)
    run_dir = tmp_path / "runs" / "qwen-4node"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SBATCH_ARGS=str(tmp_path / "args"),
               KEYS=str(run_dir / "secrets" / "curve-keys.json"))
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(p), "--set", f"run.output_dir={tmp_path}/runs"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "submitted job 4242" in r.stderr and "scancel 4242" in r.stderr
    args, mode = (tmp_path / "args").read_text().splitlines()
    assert args == f"--parsable {run_dir}/slurm/job.sbatch" and mode == "600"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(env, SBATCH_REFUSE="1"))
    assert r.returncode == 2 and "failed (exit 1): sbatch: error: invalid partition" in r.stderr


def test_resume_is_passed_to_node_0_only(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "slurm-gpu-2node.toml"),
                        "--resume", "--dry-run", "--set", f"run.output_dir={tmp_path}/runs"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '0) exec "$PY" -m flashrl.cli node "$CONFIG" --node 0 --resume ;;' in r.stdout
    assert '1) exec "$PY" -m flashrl.cli node "$CONFIG" --node 1 ;;' in r.stdout
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "slurm-gpu-2node.toml"),
                        "--resume", "some/ckpt", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "a PATH is not supported" in r.stderr


def test_node_0_without_the_other_agents_starts_no_controller(tmp_path: Path) -> None:
    """Node 1's agent never answers: node 0 says which node, host and port, starts no controller, exits 1."""
    port = agent_port(2)
    cfg = _agent_cfg(tmp_path, port, extra=["cluster.slurm.connect_timeout_s=3"])
    slurm_job.write_keys(cfg)
    from flashrl.config import to_toml

    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(to_toml(cfg))
    p = _node_proc(cfg_path, 0, "127.0.0.[1-2]", tmp_path / "n0.out")
    assert p.wait(timeout=60) == 1
    out = (tmp_path / "n0.out").read_text()
    assert f"node 0: node 1's agent (127.0.0.2:{port + 1}) did not answer within cluster.slurm.connect_timeout_s = 3 s" in out
    assert "starting the controller" not in out
    assert not (cfg.run_dir / "logs" / "controller.log").exists()


def test_validate_checks_the_slurm_layout(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "validate", str(ROOT / "configs" / "slurm-gpu-2node.toml"),
                        "--set", "engine.count=9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "cluster.slurm.layout places no node for engine 8 (engine.count = 9)" in r.stderr


def test_node_agent_on_sigterm_keeps_its_processes_until_node_0_shuts_it_down(tmp_path: Path) -> None:
    """scancel signals every node at once: a non-zero node keeps its processes (node 0's controller may be
    checkpointing with them) until node 0's NodeShutdown, then stops them and exits 0."""
    import psutil

    port = agent_port(2)
    cfg = _agent_cfg(tmp_path, port, extra=["judge.model=builtin:judge", "judge.engines=1"])
    keys = slurm_job.write_keys(cfg)
    from flashrl.config import to_toml
    from flashrl.wire.protocol import NODE_REPLIES, NodeShutdown, Ok, Spawned

    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(to_toml(cfg))
    p = _node_proc(cfg_path, 1, "127.0.0.[1-2]", tmp_path / "n1.out")

    async def main() -> int:
        c = RpcClient(f"tcp://127.0.0.2:{port + 1}", NODE_REPLIES, name="n1", curve=keys.client())
        try:
            r = await _spawn_sleeper(c, tmp_path / "s.log")
            assert isinstance(r, Spawned)
            p.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.5)
            assert p.poll() is None and psutil.Process(r.pid).is_running()
            assert isinstance(await c.request(NodeShutdown(), timeout=30), Ok)
            return r.pid
        finally:
            await c.close()

    pid = asyncio.run(main())
    assert p.wait(timeout=30) == 0
    assert "SIGTERM: waiting up to 45 s for node 0" in (tmp_path / "n1.out").read_text()
    assert _gone(pid, 10)
