"""Where routes come from (flashrl/moe/source.py): the choice between vLLM's own capture and flashrl's hooks, and
the engine's arguments that follow from it. vLLM's output format turned into flashrl's checked routes, with vLLM's
own types (importing them starts vLLM's platform probe, a process): tests/integration/test_moe_source_process.py.
vLLM's capture itself needs a GPU (Model Runner V2): it has never run here (docs/limits.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashrl.moe.routes import RoutesError
from flashrl.moe.source import choose_route_source


def test_vllms_capture_is_chosen_on_a_cuda_engine_with_triton_and_hooks_elsewhere_with_the_reason() -> None:
    assert choose_route_source("cuda", triton=True, v2_env="")[0] == "vllm"
    source, why = choose_route_source("cpu", triton=True, v2_env="")
    assert source == "hooks" and "Model Runner V2" in why and "cpu" in why
    source, why = choose_route_source("cuda", triton=False, v2_env="")
    assert source == "hooks" and "Triton" in why
    source, why = choose_route_source("cuda", triton=True, v2_env="0")
    assert source == "hooks" and "VLLM_USE_V2_MODEL_RUNNER=0" in why
    assert choose_route_source("cuda", "hooks", triton=True, v2_env="")[0] == "hooks"  # forced


def test_requiring_vllms_capture_where_it_cannot_run_names_the_fix() -> None:
    with pytest.raises(RoutesError, match='capture_source = "auto"'):
        choose_route_source("cpu", "vllm")
    with pytest.raises(RoutesError, match="Triton"):
        choose_route_source("cuda", "vllm", triton=False, v2_env="")


def test_the_engine_asks_vllm_for_its_capture_only_where_it_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashrl.moe.source as source
    from flashrl.engine.server import EngineSpec, engine_kwargs
    from flashrl.launch.base import LaunchError
    from flashrl.launch.processes import route_source_for

    spec = EngineSpec(address="tcp://127.0.0.1:1", model="/m", routes=True)
    assert "enable_return_routed_experts" not in engine_kwargs(spec)  # cpu: flashrl's hooks
    monkeypatch.setattr(source, "_has_triton", lambda: True)
    on_gpu = engine_kwargs(EngineSpec(address="tcp://127.0.0.1:1", model="/m", routes=True, device="cuda"))
    assert on_gpu["enable_return_routed_experts"] is True and on_gpu["enable_prefix_caching"] is True
    hooks = EngineSpec(address="tcp://127.0.0.1:1", model="/m", routes=True, device="cuda", route_source="hooks")
    assert "enable_return_routed_experts" not in engine_kwargs(hooks)
    dense = EngineSpec(address="tcp://127.0.0.1:1", model="/m", routes=False, device="cuda")
    assert "enable_return_routed_experts" not in engine_kwargs(dense)
    with pytest.raises(LaunchError, match="capture_source"):  # refused before an engine starts, in one line
        route_source_for(SimpleNamespace(moe=SimpleNamespace(capture_source="vllm")), "cpu")  # type: ignore[arg-type]


def test_validate_refuses_vllms_capture_on_a_cpu_engine() -> None:
    import msgspec

    from flashrl.config import Config
    from flashrl.moe.routes import moe_problem

    cpu = msgspec.convert({"model": {"path": "builtin:moe"}, "engine": {"device": "cpu"},
                           "moe": {"capture_source": "vllm"}}, Config)
    assert 'set capture_source = "auto"' in moe_problem(cpu, True, "builtin:moe")
    auto = msgspec.convert({"model": {"path": "builtin:moe"}, "engine": {"device": "cpu"}}, Config)
    assert moe_problem(auto, True, "builtin:moe") == ""
