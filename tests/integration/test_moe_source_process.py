"""The premise of flashrl's route-source choice (flashrl/moe/source.py), on this CPU host with the installed vLLM:
vLLM finds no usable Triton, refuses its own routed-experts capture without Model Runner V2, and the choice falls
back to flashrl's hooks; and vLLM's output format (its own CompletionOutput, its scheduler connector's row
arithmetic) turned into flashrl's checked routes (importing vLLM starts its platform probe, a process: not a unit
test). vLLM's capture itself needs a GPU with Model Runner V2: it has never run (docs/limits.md)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flashrl.moe.routes import RoutesError, RouteShape, pack_routes
from flashrl.moe.source import choose_route_source, prompt_start, vllm_routes

SHAPE = RouteShape(2, 8, 2)


def test_this_cpu_host_takes_the_hooks_and_vllm_refuses_its_capture(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from flashrl.models.moe import build_untrained_moe
    from flashrl.moe.model import MoeSpec

    # vLLM's own HAS_TRITON is False here (no CPU backend in the installed Triton), even for a cuda claim
    assert choose_route_source("cuda")[0] == "hooks" and choose_route_source("cpu")[0] == "hooks"
    folder = build_untrained_moe(tmp_path / "m", spec=MoeSpec(layers=1, experts=4))
    args = EngineArgs(model=str(folder), enforce_eager=True, max_model_len=64, enable_return_routed_experts=True,
                      enable_prefix_caching=True, kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="requires Model Runner V2"):
        args.create_engine_config()


def test_vllms_connector_hands_out_one_row_per_generated_token_from_prompt_start() -> None:
    """vLLM's scheduler-side AuxOutput connector (its take_output, the row arithmetic) with the start flashrl asks
    for: the rows are the positions the sampled tokens' logits came from, which vllm_routes packs as flashrl's."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector, AuxRequestOutput
    from vllm.outputs import CompletionOutput

    shape, prompt, tokens = RouteShape(2, 8, 2), 6, 4
    rng = np.random.default_rng(0)
    forwarded = np.stack([np.stack([rng.permutation(8)[:2] for _ in range(2)]) for _ in range(prompt + tokens)])
    start = prompt_start(prompt)
    request = SimpleNamespace(request_id="r", num_tokens=prompt + tokens, is_finished=lambda: True)
    rows = AuxOutputSchedulerConnector().take_output(
        request, {"r": AuxRequestOutput(token_start=start, rows=forwarded[start:].astype(np.uint8))})  # type: ignore[arg-type]
    assert rows is not None and len(rows) == tokens
    comp = CompletionOutput(index=0, text="", token_ids=list(range(tokens)), cumulative_logprob=None, logprobs=None,
                            routed_experts=rows, finish_reason="length")
    assert vllm_routes(comp, tokens, shape, "engine0") == pack_routes(forwarded[prompt - 1: prompt - 1 + tokens], shape)


def _completion(rows: np.ndarray | None, tokens: int) -> object:
    from vllm.outputs import CompletionOutput

    return CompletionOutput(index=0, text="", token_ids=list(range(5, 5 + tokens)), cumulative_logprob=None,
                            logprobs=None, routed_experts=rows, finish_reason="length")


def test_vllms_routed_experts_become_flashrls_routes_one_row_per_generated_token() -> None:
    # vLLM returns the rows of positions [routed_experts_prompt_start, num_tokens - 1) (its scheduler connector's
    # arithmetic, run in tests/integration/test_moe_source_process.py): from prompt_start, one per sampled token
    prompt, tokens = 6, 4
    rng = np.random.default_rng(0)
    forwarded = np.stack([np.stack([rng.permutation(8)[:2] for _ in range(2)]) for _ in range(prompt + tokens)])
    rows = forwarded[prompt_start(prompt): prompt + tokens - 1].astype(np.uint8)
    assert len(rows) == tokens
    got = vllm_routes(_completion(rows, tokens), tokens, SHAPE, "engine0")
    assert got == pack_routes(forwarded[prompt - 1: prompt - 1 + tokens], SHAPE)  # sorted per layer, uint8
    assert vllm_routes(_completion(None, 0), 0, SHAPE, "engine0") == b""  # aborted before its first token
    big = RouteShape(1, 300, 2)  # > 256 experts: vLLM's uint16, flashrl's int16
    wide = np.array([[[299, 3]], [[7, 280]]], dtype=np.uint16)
    assert np.frombuffer(vllm_routes(_completion(wide, 2), 2, big, "e"), dtype="<i2").tolist() == [3, 299, 7, 280]


@pytest.mark.parametrize("rows, what", [
    (None, "no routed experts"),
    (np.zeros((3, 2, 2), dtype=np.uint8), "rows of routed experts for 4"),  # the prompt's rows included / cut
    (np.zeros((4, 3, 2), dtype=np.uint8), "expected \\[tokens, 2 layers, top-2\\]"),
    (np.zeros((4, 2, 2), dtype=np.uint8) + np.array([0, 1], dtype=np.uint8) * 0, "all-zero"),
    (np.tile(np.array([[3, 3], [1, 2]], dtype=np.uint8), (4, 1, 1)), "one expert twice"),
    (np.tile(np.array([[3, 9], [1, 2]], dtype=np.uint8), (4, 1, 1)), "outside the model's 8 experts"),
])
def test_missing_or_malformed_vllm_routes_are_a_named_error(rows: np.ndarray | None, what: str) -> None:
    with pytest.raises(RoutesError, match=f"engine engine3: .*{what}"):
        vllm_routes(_completion(rows, 4), 4, SHAPE, "engine3")


