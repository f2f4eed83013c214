"""docs/configuration.md is generated from the config structs and must be current; every key is described.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_configref.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flashrl.configref import reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_writes_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    r = subprocess.run([sys.executable, "-m", "flashrl.cli", "config-reference", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == reference_markdown()
