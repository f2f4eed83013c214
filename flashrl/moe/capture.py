"""Route capture inside a vLLM engine: forward hooks on the MoE routers, read through flashrl's worker extension.

vLLM's own capture (``enable_return_routed_experts``) needs Model Runner V2, which vLLM refuses on the CPU
(it is built on Triton). This module does it through vLLM's supported extension points instead: the
worker extension class (``worker_extension_cls``, flashrl/engine/weights.py ``WORKER_EXTENSION`` mixes
``RouteCaptureExtension`` in) whose methods the engine calls with ``collective_rpc``, and torch forward
hooks (``register_forward_hook``) on the model's modules. Nothing of vLLM is replaced.

What it reads, exactly:

- the model: ``self.model_runner.get_model()``; its routers are the modules named ``...layers.<i>.mlp.gate``
  whose parent has ``experts`` (vLLM's ``GateLinear`` in ``Qwen3MoeSparseMoeBlock``; the MoE runner calls
  it as a module, ``router_logits, _ = self.gate(hidden_states)``, so a forward hook sees its output);
- the batch layout of the forward being run, at hook time: ``self.model_runner.input_batch.num_reqs``,
  ``self.model_runner.input_batch.req_ids`` (the scheduled requests in the order their tokens are laid
  out) and ``self.model_runner.query_start_loc.np`` (the cumulative token counts, the same order). vLLM
  samples request j's next token from the logits of row ``query_start_loc[j + 1] - 1`` (whole prefills
  on the CPU: flashrl turns chunked prefill off), so that row's router logits give the route of the token
  sampled for j in this step;
- the model config: ``num_experts_per_tok`` (top-k), the expert count (the router's output width).

Per router call the hook takes those rows' top-k (``torch.topk`` of the logits: the softmax keeps the
order, as vLLM's router does) and keeps them per request (vLLM's internal request id) until
``flashrl_take_routes`` hands them out, packed (flashrl/moe/routes.py), when the request finishes or is
aborted (engine/inproc.py calls it on the engine thread, right after the step that finished it). A
forward with no request laid out (vLLM's warm-up and profile runs) is not recorded.

Cost: one top-k over a few rows per MoE layer per step, and the hook's Python call.

Limits (GPU engines, untested): CUDA graphs replay without calling Python hooks, and a chunked prefill's
partial chunk samples no token though its last row is recorded; both leave a request with missing or extra
rows, which the controller's check (flashrl/moe/routes.py ``check_routes``) refuses, naming the engine.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from flashrl.moe.routes import RouteShape, pack_routes

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.mlp\.gate$")


def router_modules(model: Any) -> list[tuple[int, Any]]:
    """(layer index, router module) of every MoE layer of a vLLM (or transformers) model, in layer order."""
    found = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        m = _LAYER.search(name)
        if m is None:
            continue
        parent = modules.get(name.rsplit(".", 1)[0])
        if parent is not None and hasattr(parent, "experts"):
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda x: x[0])


class _Recorder:
    """The hooks' state: per vLLM request id, per step, the [layers, k] routes of its sampled token."""

    def __init__(self, runner: Any, layers: list[int], shape: RouteShape) -> None:
        self.runner = runner
        self.shape = shape
        self.position = {layer: i for i, layer in enumerate(layers)}
        self.step: np.ndarray | None = None  # [requests, layers, k] of the forward being run
        self.step_ids: list[str] = []
        self.rows: dict[str, list[np.ndarray]] = {}

    def hook(self, layer: int):
        import torch

        def record(module: Any, args: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            batch = self.runner.input_batch
            n = int(batch.num_reqs)
            if n == 0:
                return
            ends = self.runner.query_start_loc.np[1 : n + 1]
            if int(ends[-1]) > logits.shape[0]:  # not this step's layout (a dummy run)
                return
            pos = self.position[layer]
            if pos == 0:
                self.step = np.zeros((n, self.shape.layers, self.shape.top_k), dtype=np.int64)
                self.step_ids = list(batch.req_ids[:n])
            if self.step is None or self.step.shape[0] != n:
                return
            rows = logits[torch.as_tensor(ends - 1, dtype=torch.long, device=logits.device)]
            self.step[:, pos] = torch.topk(rows.float(), self.shape.top_k, dim=-1).indices.cpu().numpy()
            if pos == self.shape.layers - 1:
                for j, rid in enumerate(self.step_ids):
                    self.rows.setdefault(rid, []).append(self.step[j])
                self.step = None

        return record

    def take(self, request_ids: list[str]) -> dict[str, bytes]:
        out = {}
        for rid in request_ids:
            rows = self.rows.pop(rid, [])
            out[rid] = pack_routes(np.stack(rows), self.shape) if rows else b""
        return out


class RouteCaptureExtension:
    """Mixed into vLLM's worker class (``self`` is the worker): start the capture, take a request's routes."""

    _flashrl_routes: _Recorder | None = None

    def flashrl_start_routes(self) -> list[int]:
        """Hook every MoE router of the served model; return [layers, experts, top_k]. A model without
        MoE layers raises (the engine server starts the capture only for a MoE model)."""
        if self._flashrl_routes is not None:
            return list(self._flashrl_routes.shape)
        runner: Any = self.model_runner  # type: ignore[attr-defined]  # vLLM's worker
        model = runner.get_model()
        routers = router_modules(model)
        if not routers:
            raise RuntimeError(f"route capture: {type(model).__name__} has no MoE router modules (layers.<i>.mlp.gate "
                               "beside experts); set [moe] capture = \"off\" for a dense model")
        hf = runner.model_config.hf_text_config
        top_k = int(hf.num_experts_per_tok)
        experts = int(getattr(routers[0][1], "output_size", 0) or getattr(hf, "num_experts", 0))
        shape = RouteShape(len(routers), experts, top_k)
        rec = _Recorder(runner, [layer for layer, _ in routers], shape)
        for layer, module in routers:
            module.register_forward_hook(rec.hook(layer))
        self._flashrl_routes = rec
        log.info("route capture: hooks on %d MoE routers (%d experts, top-%d)", len(routers), experts, top_k)
        return list(shape)

    def flashrl_take_routes(self, request_ids: list[str]) -> dict[str, bytes]:
        """The packed routes (flashrl/moe/routes.py) of each of vLLM's ``request_ids`` since the last take, one
        row per token sampled for it; b"" for one with none (or when no capture runs)."""
        rec = self._flashrl_routes
        if rec is None:
            return {rid: b"" for rid in request_ids}
        return rec.take(request_ids)
