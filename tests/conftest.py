"""Fixtures several test modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, untrained (seed 0), built once per test module."""
    from flashrl.models.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    """A world-1 gloo process group in this process (the real Trainer on one rank), for the module."""
    import torch
    import torch.distributed as dist

    from flashrl.wire.transport import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.set_num_threads(1)
    yield
    dist.destroy_process_group()
