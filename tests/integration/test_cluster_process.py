"""flashrl/launch (the launchers): per-run CURVE keys and the local launcher, with real files and real processes.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_cluster.py."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from flashrl.config import load
from flashrl.launch import LaunchError, Proc
from flashrl.launch.base import interface_host, primary_address
from flashrl.launch.local import LocalLauncher
from tests.helpers import first_json_line, process_gone

ROOT = Path(__file__).resolve().parents[2]
PYPATH = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}

# A supervised child that starts a grandchild (like vLLM's EngineCore) and reports what it was given.
CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from flashrl.procs import child_init
    child_init("test child")
    grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(json.dumps({"child": os.getpid(), "grand": grand.pid, "extra": os.environ.get("EXTRA"),
                      "keys": os.environ.get("FLASHRL_CURVE_KEYS"), "argv": sys.argv[1:]}), flush=True)
    time.sleep(600)
    """
)


def non_loopback_ip() -> str:
    try:
        return primary_address()
    except LaunchError as e:
        pytest.skip(f"this machine has no non-loopback address: {e}")


# ---------------------------------------------------------------------------- local launcher
async def test_local_launcher_spawns_stops_and_leaves_nothing(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path)
    launcher.preflight()
    await launcher.start()
    assert launcher.curve is None and launcher.trainer_master() == "127.0.0.1"
    ep = await launcher.endpoint("engine", 0)
    assert ep.bind == ep.connect and ep.bind.startswith("ipc://") and ep.host == "127.0.0.1"
    assert (await launcher.endpoint("engine", 0)).bind != ep.bind  # a fresh socket per start
    port = await launcher.trainer_port()
    assert 0 < port < 65536

    procs: list[Proc] = []
    for i in range(2):
        procs.append(await launcher.spawn("engine", i, ["python", "-c", CHILD, "a", str(i)], dict(PYPATH, EXTRA=f"x{i}"),
                                          tmp_path / "logs" / f"e{i}.log"))
    assert all(isinstance(p, Proc) for p in procs)
    assert [p.name for p in procs] == ["engine engine0", "engine engine1"]
    reports = [first_json_line(tmp_path / "logs" / f"e{i}.log", 30.0) for i in range(2)]
    assert [r["extra"] for r in reports] == ["x0", "x1"] and reports[1]["argv"] == ["a", "1"]
    assert reports[0]["keys"] is None  # loopback: no keys handed out
    assert launcher.leftovers() == {"processes": 2}

    # stop one the orderly way (its owner does this); the launcher forgets it
    code = await procs[0].stop(2.0)
    assert code is not None and not procs[0].alive and process_gone(reports[0]["grand"])
    assert launcher.leftovers() == {"processes": 1}
    # restart = spawn again with the same (role, index)
    again = await launcher.spawn("engine", 0, ["python", "-c", CHILD, "b"], PYPATH, tmp_path / "logs" / "e0b.log")
    r_again = first_json_line(tmp_path / "logs" / "e0b.log", 30.0)
    assert again.alive and launcher.leftovers() == {"processes": 2}

    # close: everything it started is gone, grandchildren included
    await launcher.close()
    assert launcher.leftovers() == {"processes": 0}
    for pid in (reports[1]["child"], reports[1]["grand"], r_again["child"], r_again["grand"]):
        assert process_gone(pid), pid
    with pytest.raises(LaunchError, match="closed"):
        await launcher.spawn("engine", 3, ["python", "-c", "pass"], {}, tmp_path / "x.log")


async def test_local_launcher_off_loopback_hands_keys_by_file_path_only(tmp_path: Path) -> None:
    ip = non_loopback_ip()
    launcher = LocalLauncher(tmp_path, ip)
    launcher.preflight()
    await launcher.start()
    try:
        keys = launcher.curve
        assert keys is not None and keys.path is not None and keys.path.is_relative_to(tmp_path)
        assert stat.S_IMODE(keys.path.stat().st_mode) == 0o600
        ep = await launcher.endpoint("trainer", 0)
        assert ep.bind.startswith(f"tcp://{ip}:") and ep.connect == ep.bind and ep.host == ip
        assert launcher.trainer_master() == ip
        p = await launcher.spawn("trainer", 0, ["python", "-c", CHILD], PYPATH, tmp_path / "t.log")
        r = first_json_line(tmp_path / "t.log", 30.0)
        assert p.name == "trainer rank 0"
        assert r["keys"] == str(keys.path)
        # the secret is in no argv and no log
        for secret in (keys.server_secret, keys.client_secret):
            assert secret.decode() not in " ".join(psutil.Process(r["child"]).cmdline())
            assert secret.decode() not in (tmp_path / "t.log").read_text()
    finally:
        await launcher.close()
    assert not keys.path.exists()  # per run: gone with the launcher
    assert launcher.leftovers() == {"processes": 0}


def test_interface_that_is_not_this_node_fails_before_anything_starts(tmp_path: Path) -> None:
    for iface, what in (("0.0.0.0", "every interface"), ("203.0.113.77", "cannot bind 203.0.113.77")):
        launcher = LocalLauncher(tmp_path, iface)
        with pytest.raises(LaunchError, match=f"cluster.interface = '{iface}'.*{what}"):
            launcher.preflight()
    assert interface_host("loopback") == "127.0.0.1"
    assert not (tmp_path / "secrets").exists()


def test_flashrl_run_with_an_interface_not_on_this_node_exits_2_starting_nothing(tmp_path: Path) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"), "--set",
           f"run.output_dir={tmp_path}", "--set", "run.dashboard=plain", "--set", "cluster.interface=203.0.113.77"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid())))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "launch error: cluster.interface = '203.0.113.77': cannot bind 203.0.113.77" in p.stderr
    logs = tmp_path / "tiny" / "logs"
    assert sorted(x.name for x in logs.iterdir()) == ["controller.log"]  # no engine, no trainer started
    assert "preparing model" not in p.stdout  # refused before the model is prepared (built, on a first run)


def test_device_auto_without_a_gpu_driver_is_cpu_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.device auto: no GPU device file -> cpu at once (the controller spawns its children 1.5 s
    sooner); with one, torch.cuda decides (here: no CUDA -> cpu); an explicit device is kept."""
    import subprocess

    code = ("import sys\nfrom flashrl.launch import processes\nfrom flashrl.config import Config\n"
            "processes._gpu_device_nodes = lambda: []\n"
            "print(processes.resolve_device(Config()), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **PYPATH}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["cpu", "False"]
    from flashrl.launch import processes

    cfg = load(ROOT / "configs" / "tiny.toml")
    monkeypatch.setattr(processes, "_gpu_device_nodes", lambda: ["/dev/nvidiactl"])
    import torch

    assert processes.resolve_device(cfg) == ("cuda" if torch.cuda.is_available() else "cpu")
    cfg.engine.device = "cuda"
    assert processes.resolve_device(cfg) == "cuda"
