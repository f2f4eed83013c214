"""Where an engine's routes come from: vLLM's own capture where the device runs it, flashrl's hooks elsewhere.

Two sources, chosen per engine at its start (``choose_route_source``), logged with the reason:

    vllm   vLLM's routed-experts capture (``EngineArgs(enable_return_routed_experts=True)``, vLLM PR #28284): the
           worker's ``RoutedExpertsCapturer`` records every MoE layer's top-k per position, the scheduler's
           ``AuxOutputSchedulerConnector.take_output`` hands out the rows of positions
           ``[routed_experts_prompt_start, num_tokens - 1)`` (the last sampled token is never forwarded), and the
           output processor concatenates them, on a finished (or aborted) request only, into
           ``CompletionOutput.routed_experts`` ([rows, layers, top_k], uint8 up to 256 experts, else uint16).
           flashrl asks for ``routed_experts_prompt_start = len(prompt) - 1`` (``prompt_start``): the rows are then
           the positions each sampled token's logits came from, one per generated token, flashrl's own layout
           (flashrl/moe/routes.py); ``vllm_routes`` checks and packs them.
    hooks  flashrl's worker-extension forward hooks on the routers (flashrl/moe/capture.py).

vLLM 0.32 runs its capture only under Model Runner V2 ("AuxOutput Connector requires Model Runner V2",
vllm/config/vllm.py ``_verify_aux_output_compatibility``), which needs Triton (``use_v2_model_runner``: "Model
Runner V2 requires Triton"), absent from the CPU build; it also needs prefix caching (flashrl turns it on then).
So: cuda with Triton and V2 not turned off -> vllm; anything else -> hooks; ``[moe] capture_source`` forces one,
and forcing vllm where it cannot run is an error naming the fix. Either source's routes pass the same check
(``check_routes``: right size, ids in range, no expert twice, not all zero).

The vllm source has never run: no GPU with vLLM has been available to this project (docs/limits.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from flashrl.moe.routes import RoutesError, RouteShape, check_routes, pack_routes, route_shape

__all__ = ["choose_route_source", "prompt_start", "start_routes", "vllm_routes"]

log = logging.getLogger("flashrl.engine")


def _has_triton() -> bool:
    """vLLM's own answer (``vllm.triton_utils.HAS_TRITON``: Triton importable with an active backend; False on this
    CPU host although the package is installed), the one ``use_v2_model_runner`` reads."""
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def choose_route_source(device: str, want: str = "auto", *, triton: bool | None = None,
                        v2_env: str | None = None) -> tuple[str, str]:
    """("vllm" | "hooks", why) for an engine on ``device`` ("cpu" | "cuda"); ``want``: ``[moe] capture_source``.
    ``triton``: whether vLLM finds Triton (None: ask it); ``v2_env``: VLLM_USE_V2_MODEL_RUNNER (None: read it).
    RoutesError when ``want`` is "vllm" and vLLM's capture cannot run there."""
    if want == "hooks":
        return "hooks", '[moe] capture_source = "hooks"'
    v2_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "") if v2_env is None else v2_env
    if device == "cuda" and triton is None:
        triton = _has_triton()
    if device != "cuda":
        why = (f"vLLM's capture needs Model Runner V2, which needs Triton and a GPU; this engine runs on {device} "
               "(vLLM refuses: \"AuxOutput Connector requires Model Runner V2\")")
    elif not triton:
        why = "vLLM's capture needs Model Runner V2, which needs Triton; vLLM finds no usable Triton"
    elif v2_env.strip().lower() in ("0", "false"):
        why = f"VLLM_USE_V2_MODEL_RUNNER={v2_env} turns Model Runner V2 off, and vLLM's capture needs it"
    else:
        return "vllm", "a cuda engine with Triton: vLLM's own routed-experts capture (Model Runner V2)"
    if want == "vllm":
        raise RoutesError(f'[moe] capture_source = "vllm", but {why}; set capture_source = "auto" (or "hooks")')
    return "hooks", why


def prompt_start(prompt_len: int) -> int:
    """``SamplingParams.routed_experts_prompt_start`` for a prompt of ``prompt_len`` tokens: the rows vLLM returns
    are then one per generated token, each the position its logits came from (module docstring)."""
    return max(prompt_len - 1, 0)


def vllm_routes(comp: Any, tokens: int, shape: RouteShape, engine: str) -> bytes:
    """vLLM's ``CompletionOutput.routed_experts`` of a request with ``tokens`` generated tokens (asked with
    ``prompt_start``) -> flashrl's packed routes, checked (``check_routes``). RoutesError naming ``engine`` when
    they are missing, of another shape or count, or malformed."""
    rows = getattr(comp, "routed_experts", None)
    if rows is None:
        if tokens == 0:
            return b""
        raise RoutesError(f"engine {engine}: vLLM returned no routed experts for a request of {tokens} tokens; "
                          "is enable_return_routed_experts on (flashrl/moe/source.py)?")
    a = np.asarray(rows)
    if a.ndim != 3 or a.shape[1:] != (shape.layers, shape.top_k):
        raise RoutesError(f"engine {engine}: vLLM's routed experts have shape {a.shape}, expected "
                          f"[tokens, {shape.layers} layers, top-{shape.top_k}]")
    if a.shape[0] != tokens:
        raise RoutesError(f"engine {engine}: vLLM returned {a.shape[0]} rows of routed experts for {tokens} "
                          "generated tokens; routed_experts_prompt_start must be the prompt's length - 1 "
                          "(flashrl/moe/source.py prompt_start)")
    ids = a.astype(np.int64)
    if tokens and (ids.min() < 0 or ids.max() >= shape.experts):  # before packing narrows them
        raise RoutesError(f"engine {engine}: route ids span {ids.min()}..{ids.max()}, outside the model's "
                          f"{shape.experts} experts")
    data = pack_routes(ids, shape)
    check_routes(data, tokens, shape, engine)
    return data


async def start_routes(opts: Any, engine: Any, server: Any) -> None:
    """An engine's (flashrl/engine/server.py: its EngineSpec ``opts``, InprocEngine, EngineServer): capture the MoE
    model's routes from the source ``choose_route_source`` picks, logged with the reason: vLLM's own (the engine
    was built with it) or flashrl's hooks (flashrl/moe/capture.py)."""
    source, why = choose_route_source(opts.device, opts.route_source)
    if source == "vllm":
        server.vllm_routes = route_shape(opts.model)
        shape = tuple(server.vllm_routes or ())
    else:
        shape = await engine.call(lambda llm: llm.collective_rpc("flashrl_start_routes")[0])
        engine.route_capture = True
    log.info("%s: capturing MoE routes (%d layers, %d experts, top-%d) from %s: %s", opts.name, *shape,
             "vLLM's enable_return_routed_experts" if source == "vllm" else "flashrl's hooks (flashrl/moe/capture.py)", why)
