"""flashrl bench on the simulator: analytic times through the REAL controller, determinism, scenario files.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_bench.py."""

from __future__ import annotations

from pathlib import Path

from flashrl.bench.scenario import (
    scenario_dir,
)


def test_zmq_path_rate() -> None:
    from flashrl.bench.overhead import zmq_rate

    r = zmq_rate(300, concurrency=16)
    assert r["requests"] == 300 and r["requests_per_s"] > 100


def test_shipped_scenarios_are_package_data(tmp_path: Path) -> None:
    """A non-editable install finds the shipped scenarios and profiles: they are found with importlib.resources
    and the wheel built from this tree carries them (declared package data in pyproject.toml)."""
    import importlib.resources
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    shipped = scenario_dir()
    assert shipped == importlib.resources.files("flashrl.bench") / "scenarios"
    names = {p.relative_to(shipped).as_posix() for p in shipped.rglob("*.toml")}
    assert "queue_scheduling.toml" in names and "profiles/h100_qwen3_8b.toml" in names
    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"  # build from a copy: the checkout gets no build/ or egg-info
    for part in ("flashrl", "envs"):
        shutil.copytree(root / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(root / part, src / part)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    assert {n.removeprefix("flashrl/bench/scenarios/") for n in z.namelist() if "/scenarios/" in n} == names
    # The installed copy, run from elsewhere (no checkout on the path), finds a scenario by name and its profile.
    code = ("import flashrl, sys; from flashrl.bench.scenario import find_scenario, load_scenario; "
            "p = find_scenario('queue_scheduling'); s = load_scenario(find_scenario('whole_system')); "
            "print(flashrl.__file__, p, s.profile)")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mod, path, profile = out.stdout.split()
    assert mod.startswith(str(site)) and path.startswith(str(site)) and profile
