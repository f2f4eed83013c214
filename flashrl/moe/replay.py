"""Routing replay in the trainer: every forward of a step sends each token to given experts (R2, R3).

A MoE trainer that routes tokens itself can pick other experts than the engine did for the same token (its
numerics differ: other kernels, other batch shapes), and the logprob the loss compares to the engine's then
comes from another network. Replay forces the routes instead (``[moe] replay``):

    off  the trainer routes every token itself (routes the engines captured are only compared: metrics)
    r2   a no-grad forward over the batch at the step's start records the trainer's own routes; every
         forward of the step (proximal, the updates of every mini-batch, the reference) replays them
    r3   every forward replays the routes the engine sampled each token with (rollout routing replay)

How: a forward hook on each router module of the Hugging Face model (``layers.<i>.mlp.gate`` beside
``experts``; transformers' ``Qwen3MoeTopKRouter`` returns ``(router_logits, top_k_weights, top_k_index)``)
replaces the router's choice, on the positions that have a route, by the replayed experts, and their
combine weights by the router's full softmax gathered at them, renormalized as the model does
(``norm_topk_prob``): w_e = softmax(logits)_e / sum over the replayed e' of softmax(logits)_e'. The router
logits keep their graph, so the router still learns: its gradient is the one of that expression
(tests/unit/test_moe_replay.py checks it against a reference computation). A position without a route
(prompt tokens, observation tokens) keeps the router's own choice.

Which positions: a generated token's route is the one of the forward over the position before it (the
engine sampled it from those logits; flashrl/moe/routes.py), so the route of response token k sits at
input position P + k - 1: the index ``PaddedBatch.routes`` keeps it at, aligned like ``behav_logp``.

Metrics (per step; ``moe/``), measured by one no-grad pass at the step's start (``prepare``) on the
on-policy tokens (sampled by the weights the step starts from, so engine and trainer hold the same
weights): ``disagree/layer<i>``, the share of them whose top-k set the trainer's own router picks differs
from the engine's in layer i, ``disagree`` over all layers, ``compared_tokens``; ``disagree_all`` the same
over every generated token of the batch (async: older ones were routed by older weights, which is what r3
replays and the trainer's own routing does not); ``replayed``, the share
of the routed positions of the step's forwards that were forced (1 under r2 and r3, 0 under off). Every
forced route is the one given, asserted in the hook (``RouteReplayError``): under r3 the experts the
trainer computes with are the engine's, so the logprobs the loss compares come from one network.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flashrl.moe.capture import router_modules
from flashrl.moe.model import moe_shape
from flashrl.moe.routes import RouteShape

__all__ = ["RouteReplay", "RouteReplayError", "combine_weights"]


class RouteReplayError(RuntimeError):
    """A replayed forward did not use the routes it was given (a bug, never data): the message says where."""


def combine_weights(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The combine weights of ``experts`` [N, k]: the router's softmax over all ``logits`` [N, E] gathered at
    them, renormalized over the k when ``normalize`` (norm_topk_prob), in the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, experts)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


class RouteReplay:
    """The trainer's routing hooks on one HF MoE model (built once; inert outside ``forcing``/``recording``)."""

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        config: Any = model.config
        shape = moe_shape(config)
        routers = router_modules(model)
        if shape is None or len(routers) != shape[0]:
            raise ValueError(f"{type(model).__name__}: {len(routers)} router modules (layers.<i>.mlp.gate beside "
                             f"experts) for the config's MoE shape {shape}; routing replay supports models with a "
                             "sparse block in every layer (Qwen3-MoE)")
        self.shape = RouteShape(*shape)
        self.mode = mode
        self.normalize = bool(getattr(config, "norm_topk_prob", True))
        self._forced: torch.Tensor | None = None  # [N, layers, k] long, -1 where the router routes itself
        self._record: torch.Tensor | None = None  # [N, layers, k]: the router's own choice, written by the hooks
        # per layer: on-policy tokens compared, of them disagreed; every generated token compared, of them disagreed
        self.counts = torch.zeros(4, self.shape.layers, dtype=torch.float64)
        self.forced_rows = 0.0  # routed positions of the step's forwards (all layers), and of them the forced ones
        self.routed_rows = 0.0
        self._compare: torch.Tensor | None = None  # [N] (prepare's pass): 2 on-policy token, 1 older one, 0 none
        for pos, (_, module) in enumerate(routers):
            module.register_forward_hook(self._hook(pos))

    @classmethod
    def of(cls, model: torch.nn.Module, mode: str) -> RouteReplay | None:
        """The replay of a MoE ``model`` (any mode: off still measures disagreement); None for a dense one."""
        return cls(model, mode) if moe_shape(model.config) is not None else None

    # ------------------------------------------------------------------ routes in a batch
    def decode(self, routes: torch.Tensor) -> torch.Tensor:
        """PaddedBatch.routes [B, T, W] (packed bytes, -1 none) -> expert ids [B, T, layers, k] (-1 none)."""
        b, t, w = routes.shape
        s = self.shape
        if w == 0:
            return torch.full((b, t, s.layers, s.top_k), -1, dtype=torch.long, device=routes.device)
        if w != s.row_bytes:
            raise ValueError(f"routes of {w} bytes per token for a model whose routes take {s.row_bytes} "
                             f"({s.layers} layers x top-{s.top_k}, {s.experts} experts)")
        r = routes.long()
        ids = r if s.dtype.itemsize == 1 else torch.where(r[..., 0::2] < 0, -1, r[..., 0::2] + 256 * r[..., 1::2])
        return ids.view(b, t, s.layers, s.top_k)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        """``decode``'s inverse: ids [B, T, layers, k] (-1 none) -> [B, T, W] packed bytes (-1 none)."""
        b, t = ids.shape[:2]
        flat = ids.reshape(b, t, -1)
        if self.shape.dtype.itemsize == 1:
            return flat.to(torch.int16)
        lo, hi = torch.where(flat < 0, -1, flat % 256), torch.where(flat < 0, -1, flat // 256)
        return torch.stack([lo, hi], dim=-1).reshape(b, t, -1).to(torch.int16)

    # ------------------------------------------------------------------ forwards
    @contextlib.contextmanager
    def forcing(self, routes: torch.Tensor, length: int) -> Iterator[None]:
        """In this block the model's forwards over a [B, ``length``] batch see ``routes`` (PaddedBatch.routes,
        [B, length - 1, W]): compared with the router's choice always, forced unless the mode is off."""
        ids = self.decode(routes)
        ids = torch.nn.functional.pad(ids, (0, 0, 0, 0, 0, length - ids.shape[1]), value=-1)  # the last position
        self._forced = ids.reshape(-1, self.shape.layers, self.shape.top_k)
        try:
            yield
        finally:
            self._forced = None

    def record(self, forward: Callable[[], Any], batch: int, length: int) -> torch.Tensor:
        """Run ``forward()`` (over a [``batch``, ``length``] batch) recording the router's own top-k of every
        position: [batch, length, layers, k], sorted within each layer."""
        self._record = torch.full((batch * length, self.shape.layers, self.shape.top_k), -1, dtype=torch.long)
        try:
            forward()
            return self._record.view(batch, length, self.shape.layers, self.shape.top_k)
        finally:
            self._record = None

    def _hook(self, pos: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._record is not None:
                self._record[:, pos] = output[2].detach().sort(dim=-1).values.to(self._record.device)
            if self._forced is None:
                return None
            logits, _, own = output
            forced = self._forced[:, pos].to(own.device)
            if forced.shape[0] != own.shape[0]:
                raise RouteReplayError(f"router of MoE layer {pos}: {own.shape[0]} rows for routes of "
                                       f"{forced.shape[0]} positions")
            have = forced[:, 0] >= 0
            n = int(have.sum())
            if n == 0:
                return None
            if self._compare is not None:
                with torch.no_grad():
                    kind = self._compare.to(have.device)
                    differ = (own.sort(dim=-1).values != forced).any(-1) & have
                    for row, mask in ((0, have & (kind == 2)), (2, have & (kind > 0))):
                        self.counts[row, pos] += float(mask.sum())
                        self.counts[row + 1, pos] += float((differ & mask).sum())
                return None  # prepare's pass: measured (and recorded), never forced
            self.routed_rows += n
            if self.mode == "off":
                return None
            use = torch.where(have[:, None], forced, own)
            if not torch.equal(use[have], forced[have]):
                raise RouteReplayError(f"router of MoE layer {pos}: the replayed forward does not use the given routes")
            self.forced_rows += n
            return logits, combine_weights(logits, use, self.normalize), use

        return hook

    def prepare(self, full: Any, forward: Callable[[Any], Any], chunk: int, version: int) -> Any:
        """The step's batch (a PaddedBatch) with the routes its forwards replay (r3 and off: the engines'; r2:
        the trainer's own, recorded here on its generated tokens), after one no-grad pass (``forward(part)``
        over ``chunk`` rows at a time) with the step's starting weights that measures the disagreement: the
        router's own top-k against the engines' routes on the on-policy tokens (sampled by ``version``, the
        weights the step starts from: the same weights on both sides), and on every generated token (the older
        ones were routed by older weights: ``moe/disagree_all``). The pass runs over every row for r2, over the
        rows with generated tokens otherwise, and not at all for a batch without routes (off). Under r3 a generated
        token without an engine route is a RouteReplayError: r3's disagreement is 0 by assertion, not by default."""
        import dataclasses

        self.reset()
        gen = full.loss_mask > 0
        if self.mode == "r3":  # every trained token replays the engine's route: none may lack one
            missing = int((gen & (self.decode(full.routes)[..., 0, 0] < 0)).sum())
            if missing:
                raise RouteReplayError(
                    f"r3: {missing} of {int(gen.sum())} generated tokens of step {version}'s batch have no engine "
                    "route, so the trainer would route them itself (engine/trainer disagreement not 0); the engines' "
                    "capture lost them, or a resumed checkpoint saved them without routes (resume with [moe] replay "
                    "= \"off\" or \"r2\")")
        kind = torch.where(gen & (full.versions == version), 2, torch.where(gen, 1, 0))
        rows = torch.arange(full.size) if self.mode == "r2" else torch.nonzero(gen.any(-1)).flatten()
        if full.routes.shape[-1] == 0 and self.mode != "r2":
            return full
        own = torch.full((full.size, full.loss_mask.shape[1], self.shape.layers, self.shape.top_k), -1, dtype=torch.long)
        with torch.no_grad():
            for start in range(0, len(rows), chunk):
                idx = rows[start:start + chunk]
                part = full.select(idx)
                length = part.input_ids.shape[1]
                compare = torch.nn.functional.pad(kind[idx, : length - 1], (0, 1), value=0)
                self._compare = compare.reshape(-1)
                try:
                    got = self.record(functools.partial(forward, part), part.size, length)
                finally:
                    self._compare = None
                own[idx, : length - 1] = got[:, : length - 1]
        if self.mode != "r2":
            return full
        own[full.loss_mask <= 0] = -1  # generated tokens only, as the engines' routes
        return dataclasses.replace(full, routes=self.encode(own))

    # ------------------------------------------------------------------ metrics
    def reset(self) -> None:
        self.counts.zero_()
        self.forced_rows = self.routed_rows = 0.0

    def metrics(self, comm: Any, device: torch.device) -> dict[str, float]:
        """This step's ``moe/*`` metrics, summed over the ranks (every rank calls it)."""
        counts = self.counts.clone()
        flat = torch.cat([counts.flatten(), torch.tensor([self.forced_rows, self.routed_rows], dtype=torch.float64)])
        if comm.world > 1:
            flat = flat.to(device)
            comm.all_reduce(flat)
            flat = flat.cpu()
        layers = self.shape.layers
        compared, disagreed = flat[:layers], flat[layers:2 * layers]
        every, every_disagreed = flat[2 * layers:3 * layers], flat[3 * layers:4 * layers]
        forced, routed = float(flat[-2]), float(flat[-1])
        out = {f"moe/disagree/layer{i}": float(d / c) for i, (c, d) in enumerate(zip(compared, disagreed)) if c > 0}
        if float(compared.sum()) > 0:
            out["moe/disagree"] = float(disagreed.sum() / compared.sum())
            out["moe/compared_tokens"] = float(compared.sum()) / layers
        if float(every.sum()) > 0:
            out["moe/disagree_all"] = float(every_disagreed.sum() / every.sum())
        if routed > 0:
            out["moe/replayed"] = forced / routed
        return out
