"""Config loading: every problem is one ConfigError naming the key path; the CLI exits 2.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_config.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.unit.test_config import write

ROOT = Path(__file__).resolve().parents[2]


def test_cli_validate_exit_codes(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "flashrl.cli", "validate", str(ROOT / "configs" / "tiny.toml")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok:")
    bad = subprocess.run(
        [sys.executable, "-m", "flashrl.cli", "validate", str(write(tmp_path, "[rollout]\ngroup_size = 0\n"))],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "rollout.group_size" in bad.stderr


def test_cli_run_bad_config_exits_2_before_starting(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "flashrl.cli", "run", str(tmp_path / "missing.toml")], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert "config file not found" in bad.stderr


def test_cli_validate_rejects_bad_env_params() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "flashrl.cli", "validate", str(ROOT / "configs" / "tiny.toml"), "--set", "env.params.digitz=2"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "env.params.digitz: unknown key for env 'arithmetic'" in bad.stderr
