"""The one way a parent hands a child its configuration (flashrl/wire/spec.py): a typed msgspec struct as
JSON in FLASHRL_SPEC, for engines (EngineSpec), trainer ranks (TrainerSpec) and env workers (EnvWorkerSpec).

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_spec.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from envs.remote import EnvWorkerSpec
from flashrl.engine.server import EngineSpec
from flashrl.wire.spec import (
    SPEC_ENV,
    spec_env,
    spec_in,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["flashrl.engine.server", "flashrl.trainer.worker", "envs.remote"])
def test_each_child_exits_2_on_a_bad_spec(module: str) -> None:
    """The real entry points: a malformed spec ends the child at once with exit code 2 and the reason."""
    env = {k: v for k, v in os.environ.items() if k != SPEC_ENV}
    env.update({"PYTHONPATH": str(ROOT), SPEC_ENV: '{"address": 5}', "RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    r = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "FLASHRL_SPEC: not a valid" in r.stderr and "Expected `str`, got `int` - at `$.address`" in r.stderr


def test_a_child_reads_its_spec_once_and_tools_still_find_it() -> None:
    """read_spec removes FLASHRL_SPEC from the child's os.environ (its own children do not inherit it);
    spec_in still reads the kernel's copy (/proc/<pid>/environ), as the chaos bench and tests do."""
    import psutil

    spec = EngineSpec(address="tcp://127.0.0.1:5", model="/m", name="engine7")
    code = ("import os, sys; from flashrl.wire.spec import read_spec; from flashrl.engine.server import EngineSpec; "
            "s = read_spec(EngineSpec); print(s.name, 'FLASHRL_SPEC' in os.environ, flush=True); sys.stdin.read()")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **spec_env(spec))
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, cwd=ROOT) as p:
        try:
            assert p.stdout is not None and p.stdout.readline().split() == ["engine7", "False"]
            assert spec_in(psutil.Process(p.pid).environ(), EngineSpec) == spec
            assert spec_in(psutil.Process(p.pid).environ(), EnvWorkerSpec) is None  # another kind
            assert spec_in(psutil.Process(os.getpid()).environ(), EngineSpec) is None  # none at all
        finally:
            p.communicate("", timeout=30)
