"""The policy losses, the parts that need no process group: the loss list is the config's literal.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_trainer_algorithms_process.py."""

from __future__ import annotations

import typing

from flashrl.config import AlgorithmConfig

LOSSES = typing.get_args(typing.get_args(typing.get_type_hints(AlgorithmConfig, include_extras=True)["loss"])[0])


# ---------------------------------------------------------------------- every loss
def test_the_loss_list_is_the_config_literal() -> None:
    assert set(LOSSES) == {"ppo", "grpo", "decoupled_ppo", "tis", "topr", "cispo", "gspo", "asyppo"}
