"""Deadlines that grow with the model: a floor plus the bytes involved over a conservative rate.

Waits whose work is proportional to the model's size (a weight sync moves every weight, a start-up reads
and builds them, a checkpoint writes the weights and AdamW's two moments) get, unless the config sets
them (a value > 0 is used as is, an override):

    weight_sync.timeout_s        SYNC_FLOOR_S       + weight bytes              / SYNC_RATE
    engine.startup_timeout_s     STARTUP_FLOOR_S    + weight bytes              / LOAD_RATE   (engines and trainer ranks)
    trainer.checkpoint_timeout_s CHECKPOINT_FLOOR_S + 3 x weight bytes (+ AdamW) / CHECKPOINT_RATE

"weight bytes" are float32 bytes (the trainer's master weights; an upper bound for what a sync moves) of
the parameters counted in the model folder's safetensors headers (``model_params``: no weights read).
The floors are the constant deadlines flashrl had before (a tiny model's deadlines are unchanged), and
the rates are conservative: at 0.27B parameters on a 2-core CPU shared with other jobs (bench/results/
realsize) the slowest full sync moved 46 MB/s and the slowest DCP checkpoint wrote 110 MB/s, so 25 MB/s
leaves 2-4x of margin there and far more on a GPU machine. A 7B model (28 GB in float32) thereby gets a
weight-sync deadline of 300 + 1120 s. These bound failures (a stuck peer), never normal waits.

``resolve(cfg, model_path)`` fills the auto (0) fields once the model is known (launch/driver.py,
launch/processes.py); the accessors below give the floor for a config never resolved (the simulator,
unit tests), so no reader ever sees 0.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import msgspec

from flashrl.config import Config

log = logging.getLogger(__name__)

SYNC_FLOOR_S = 300.0
STARTUP_FLOOR_S = 600.0
CHECKPOINT_FLOOR_S = 300.0
SYNC_RATE = 25e6  # bytes/s
LOAD_RATE = 25e6
CHECKPOINT_RATE = 25e6
FLOAT32 = 4
CHECKPOINT_COPIES = 3  # weights + AdamW's exp_avg and exp_avg_sq, float32 each


def model_params(path: str | Path) -> int:
    """Parameters in the model folder ``path``, from its safetensors headers (0: not a local folder or no
    safetensors, e.g. a hub id not yet downloaded; the deadlines then take their floors)."""
    p = Path(path)
    if not p.is_dir():
        return 0
    n = 0
    for f in sorted(p.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (OSError, ValueError) as e:
            log.warning("%s: safetensors header unreadable (%s); deadlines ignore this file", f, e)
            continue
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                n += math.prod(int(d) for d in info.get("shape", []))
    return n


def scaled(floor_s: float, nbytes: float, rate: float) -> float:
    """``floor_s + nbytes / rate``: a deadline for work proportional to ``nbytes``."""
    return floor_s + max(0.0, nbytes) / rate


def weight_sync_timeout_s(cfg: Config, params: int = 0) -> float:
    """weight_sync.timeout_s: the config's value if set (> 0), else scaled by ``params`` (0: the floor)."""
    v = cfg.weight_sync.timeout_s
    return v if v > 0 else scaled(SYNC_FLOOR_S, FLOAT32 * params, SYNC_RATE)


def startup_timeout_s(cfg: Config, params: int = 0) -> float:
    """engine.startup_timeout_s (engines and trainer ranks coming up): the config's value, else scaled."""
    v = cfg.engine.startup_timeout_s
    return v if v > 0 else scaled(STARTUP_FLOOR_S, FLOAT32 * params, LOAD_RATE)


def checkpoint_timeout_s(cfg: Config, params: int = 0) -> float:
    """trainer.checkpoint_timeout_s (one checkpoint's write, and the wait for it at shutdown): the config's
    value, else scaled by the checkpoint's bytes."""
    v = cfg.trainer.checkpoint_timeout_s
    return v if v > 0 else scaled(CHECKPOINT_FLOOR_S, CHECKPOINT_COPIES * FLOAT32 * params, CHECKPOINT_RATE)


def resolve(cfg: Config, model_path: str | Path) -> Config:
    """``cfg`` with every auto (0) deadline above filled in for the model at ``model_path`` (a copy; the
    values the user set stay). Logged once, so a run's log says what each deadline was."""
    if cfg.weight_sync.timeout_s > 0 and cfg.engine.startup_timeout_s > 0 and cfg.trainer.checkpoint_timeout_s > 0:
        return cfg  # every deadline set (or resolved already)
    params = model_params(model_path)
    out = msgspec.structs.replace(
        cfg,
        weight_sync=msgspec.structs.replace(cfg.weight_sync, timeout_s=weight_sync_timeout_s(cfg, params)),
        engine=msgspec.structs.replace(cfg.engine, startup_timeout_s=startup_timeout_s(cfg, params)),
        trainer=msgspec.structs.replace(cfg.trainer, checkpoint_timeout_s=checkpoint_timeout_s(cfg, params)),
    )
    log.info("deadlines for %s (%d parameters): weight sync %.0f s, start-up %.0f s, checkpoint write %.0f s",
             model_path, params, out.weight_sync.timeout_s, out.engine.startup_timeout_s, out.trainer.checkpoint_timeout_s)
    return out
