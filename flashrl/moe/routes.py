"""Routes: the experts a MoE policy sent a token to, one row per sampled token, packed small for the wire.

A token's route is its top-k expert ids in every MoE layer, sorted ascending within each layer (replay uses
the set: the combine weights come from the router, flashrl/moe/replay.py): ``layers x k`` ids, one byte
each (uint8) when the model has at most 256 experts, else two (int16, little-endian). ``Generated.routes``
is the rows of its tokens back to back; ``Trajectory.routes`` one ``bytes`` row per response token (``b""``
on an observation token, and on every token when the run captures none).

The route of a sampled token is the one its logits were computed with: the forward over the position
before it (the prompt's last token for the first one, then the previous sampled token): the row the
trainer's forward over that same position must replay (flashrl/moe/replay.py shifts it by one).

``check_routes`` is the run's guard against routes that look plausible and are not (never silent zeros):
the right byte count, every id below the expert count, no id twice in one layer's top-k, and not all zero
when the model has more than one expert (an engine that filled nothing). A bad one raises ``RoutesError``
naming the engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RouteShape", "RoutesError", "capture_routes", "check_routes", "pack_routes", "moe_problem", "route_rows", "route_shape", "stand_in_routes", "unpack_routes"]


class RoutesError(RuntimeError):
    """An engine's routes are missing or malformed; the message names the engine and what is wrong."""


class RouteShape(tuple):
    """(layers, experts, top_k) of a MoE model."""

    __slots__ = ()

    def __new__(cls, layers: int, experts: int, top_k: int) -> RouteShape:
        return super().__new__(cls, (int(layers), int(experts), int(top_k)))

    @property
    def layers(self) -> int:
        return self[0]

    @property
    def experts(self) -> int:
        return self[1]

    @property
    def top_k(self) -> int:
        return self[2]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.experts <= 256 else np.dtype("<i2")

    @property
    def row_bytes(self) -> int:
        return self.layers * self.top_k * self.dtype.itemsize


def pack_routes(ids: np.ndarray, shape: RouteShape) -> bytes:
    """``ids`` [tokens, layers, k] (any integer dtype) -> the packed rows (each layer's ids sorted)."""
    a = np.sort(np.asarray(ids).reshape(-1, shape.layers, shape.top_k), axis=-1)
    return a.astype(shape.dtype).tobytes()


def unpack_routes(data: bytes | Sequence[bytes], shape: RouteShape) -> np.ndarray:
    """Packed rows (one ``bytes`` of many rows, or a list of one row each) -> int64 [tokens, layers, k]."""
    blob = data if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)
    return np.frombuffer(blob, dtype=shape.dtype).astype(np.int64).reshape(-1, shape.layers, shape.top_k)


def check_routes(data: bytes, tokens: int, shape: RouteShape, engine: str) -> None:
    """Raise RoutesError (naming ``engine``) unless ``data`` holds ``tokens`` well-formed rows (module docstring)."""
    want = tokens * shape.row_bytes
    if len(data) != want:
        raise RoutesError(f"engine {engine}: routes of {len(data)} bytes for {tokens} tokens, expected {want} "
                          f"({shape.layers} layers x top-{shape.top_k} x {shape.dtype.itemsize} byte(s) per token); "
                          "the engine's route capture (flashrl/moe/capture.py) lost or mis-sized rows")
    if not tokens:
        return
    ids = unpack_routes(data, shape)
    if ids.min() < 0 or ids.max() >= shape.experts:
        raise RoutesError(f"engine {engine}: route ids span {ids.min()}..{ids.max()}, outside the model's "
                          f"{shape.experts} experts")
    if shape.experts > 1 and not ids.any():
        raise RoutesError(f"engine {engine}: every route id of {tokens} tokens is 0 (all-zero routes: the engine "
                          "captured nothing); check its route capture (flashrl/moe/capture.py)")
    if shape.top_k > 1 and (np.diff(ids, axis=-1) == 0).any():
        raise RoutesError(f"engine {engine}: a token's top-{shape.top_k} routes name one expert twice in a layer")


def route_shape(model_dir: str | Path) -> RouteShape | None:
    """The routes' shape of the model folder ``model_dir`` (its config.json), None for a dense model."""
    from flashrl.moe.model import moe_shape

    f = Path(model_dir) / "config.json"
    if not f.is_file():
        return None
    shape = moe_shape(json.loads(f.read_text()))
    return None if shape is None else RouteShape(*shape)


def capture_routes(cfg: Any, model_dir: str | Path) -> bool:
    """Whether the run's engines capture routes: ``[moe] capture`` auto = for a MoE model, on = required (a
    dense model is an error naming the fix), off = never; r3 replay needs them. RoutesError: ``moe_problem``'s."""
    problem = moe_problem(cfg, route_shape(model_dir) is not None, str(model_dir))
    if problem:
        raise RoutesError(problem)
    return cfg.moe.capture != "off" and route_shape(model_dir) is not None


def moe_problem(cfg: Any, moe: bool | None, model: str) -> str:
    """What is wrong with ``[moe]`` for a model that is a MoE (``moe``; None: not known yet), or ""."""
    from flashrl.moe.model import MoeSpec

    mode, replay = cfg.moe.capture, cfg.moe.replay
    if cfg.moe.builtin != MoeSpec() and cfg.model.path != "builtin:moe":
        return (f"[moe.builtin] sets the shape of builtin:moe, but model.path = {cfg.model.path!r}; remove "
                "[moe.builtin] (a model folder's shape is its config.json's) or set model.path = \"builtin:moe\"")
    if cfg.moe.capture_source == "vllm" and cfg.engine.device == "cpu":
        return ('[moe] capture_source = "vllm": vLLM\'s own route capture needs Model Runner V2 (a GPU with Triton), '
                'but engine.device = "cpu"; set capture_source = "auto" (flashrl/moe/source.py)')
    if mode == "off" and replay == "r3":
        return ('[moe] replay = "r3" replays the engines\' routes, but [moe] capture = "off"; set capture = "auto" '
                '(or replay = "r2" / "off")')
    if moe is False and (mode == "on" or replay != "off"):
        return (f"[moe]: {model} is not a Mixture-of-Experts model (no num_experts / num_experts_per_tok in its "
                f"config), but capture = {mode!r}, replay = {replay!r}; remove [moe] for a dense model (or use "
                "model.path = \"builtin:moe\")")
    return ""


def route_rows(data: bytes, tokens: int, shape: RouteShape, engine: str) -> list[bytes]:
    """An engine answer's packed routes, checked (``check_routes``), as one row per token (Trajectory.routes)."""
    check_routes(data, tokens, shape, engine)
    n = shape.row_bytes
    return [data[i * n:(i + 1) * n] for i in range(tokens)]


def stand_in_routes(shape: RouteShape, seed: int = 0) -> Any:
    """For fakes (flashrl/sim/fake.py FakeEngine(routes=...)): tokens -> well-formed packed routes of ``shape``,
    each token's top-k drawn at random (distinct experts per layer), deterministic per ``seed`` and call."""
    rng = np.random.default_rng(seed)

    def routes(tokens: int) -> bytes:  # k distinct experts per layer: the first k of a random permutation
        ids = np.argsort(rng.random((tokens, shape.layers, shape.experts)), axis=-1)[..., : shape.top_k]
        return pack_routes(ids, shape)

    return routes
