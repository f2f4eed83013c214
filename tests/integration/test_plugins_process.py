"""Environments by built-in name, import path, file path and entry point (flashrl/plugins.py), and the
errors a user sees when one cannot be loaded (`flashrl validate` exits 2 naming env.name).

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_plugins.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_does_not_import_envs() -> None:
    code = "import sys, flashrl.config as c; c.load('configs/tiny.toml'); print(sorted(m for m in sys.modules if m == 'envs' or m.startswith('envs.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
