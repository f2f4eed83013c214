"""What one trainer rank is started with (flashrl/wire/spec.py: JSON in ``FLASHRL_SPEC``).

    TrainerGroup.spawn (trainer/client.py)  spec_env(TrainerSpec(cfg, address, model, resume)) + torchrun's variables
    python -m flashrl.trainer.worker        read_spec(TrainerSpec); RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun sets them

Every rank gets the same spec; which rank it is comes from torchrun's variables, so torchrun (or any
launcher that sets them) can start the ranks with ``FLASHRL_SPEC`` in their environment.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from flashrl.config import Config


class TrainerSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a trainer rank needs beyond torchrun's variables."""

    cfg: Annotated[Config, Meta(description="the run's resolved config")]
    address: Annotated[str, Meta(min_length=1, description="rank 0's ZeroMQ address to bind, e.g. tcp://127.0.0.1:5555")]
    model: Annotated[str, Meta(min_length=1, description="Hugging Face model folder the ranks load")]
    resume: Annotated[str | None, Meta(description="checkpoint folder written by SaveCheckpoint")] = None
