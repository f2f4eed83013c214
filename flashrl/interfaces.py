"""What the controller depends on: ``EngineClient`` and ``TrainerClient`` (and flashrl.env: EnvSuite, Env).

The real implementations talk ZeroMQ to processes (engine/client.py, trainer/client.py); the
simulated ones (sim/) run on a virtual clock. The scheduling code is the same for both, so what the
bench measures is what runs. Inside the controller, time comes from the event loop
(``asyncio.get_running_loop().time()``), never ``time.time()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from flashrl.wire.protocol import (
    Generate,
    Generated,
    LoadReport,
    TrainBatch,
    TrainResult,
    WeightManifest,
    WeightsUpdated,
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the controller needs from a tokenizer (the built-in one, a Hugging Face one, the simulator's)."""

    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer that renders turns itself (models/tokenizer.py HFTokenizer: a chat template, or none):
    rollouts encode the prompt and each observation with it, and send its stop tokens with every request.
    A plain ``Tokenizer`` gets ``encode(text)`` for both and no stop tokens beyond the engine's EOS."""

    stop_token_ids: list[int]  # the model's stop tokens (generation_config.json's eos list)

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_observation(self, text: str, generated: list[int]) -> list[int]:
        """Ids appended after the generated turn ``generated`` for the env's next observation ``text``."""
        ...

    def template_mismatch(self, prompt: str, turns: Sequence[tuple[Sequence[int], str | None]],
                          trained: Sequence[int]) -> tuple[int, int] | None:
        """A finished multi-turn trajectory against its text re-rendering: (tokens the template's
        re-rendering differs by, tokens that decoding and re-encoding the generated turns changes);
        None when there is no template (models/chat.py ChatFormat.template_mismatch)."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """One inference engine as the controller sees it."""

    name: str

    @property
    def inflight(self) -> int:
        """Requests sent and not yet answered (the controller's own count; used for routing)."""
        ...

    @property
    def dead(self) -> object:
        """Why the engine is known to be gone (transport.PeerDead: its process died, its heartbeat
        stopped), else a falsy value (None). Before a weight sync the controller marks such an
        engine dead and skips it, instead of failing the whole sync on it."""
        ...

    async def generate(self, req: Generate) -> Generated:
        """Generate one sample. An aborted request returns finish_reason "abort" with the tokens so far.

        Raises transport.PeerDead when the engine process is gone.
        """
        ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def update_weights(self, manifest: WeightManifest) -> WeightsUpdated:
        """Pause (keep in-flight requests), receive the broadcast, verify checksums, load, resume."""
        ...

    async def load(self) -> LoadReport: ...

    async def close(self) -> None: ...


@runtime_checkable
class TrainerClient(Protocol):
    """The trainer group (R ranks) as the controller sees it: rank 0 answers for all."""

    @property
    def dead(self) -> BaseException | None:
        """Why the trainer group is known to be gone (trainer.client.TrainerDied: a rank exited, naming it),
        else None (always None for a trainer that cannot die on its own, the simulated ones). The
        controller's watcher stops the run with it while no trainer call is waiting."""
        ...

    async def train_step(self, batch: TrainBatch) -> TrainResult: ...

    async def prepare_weights(self, version: int) -> WeightManifest:
        """Gather the full weights for ``version``; return the manifest (buckets, checksums)."""
        ...

    async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
        """Broadcast ``version`` (just prepared, or the last one sent: a catch-up) to ``peers``, the engine
        names (None: every engine). Engines receive concurrently (their update_weights); a peer that
        fails does not fail the call (its own update_weights reply says so)."""
        ...

    async def drop_weight_peer(self, peer: str) -> None:
        """Engine ``peer`` is dead: a send waiting on it stops waiting (answered at once, beside any command)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class EngineRestarter(Protocol):
    """Restarts engine processes (the launcher's side; launch.processes.EnginePool for a local run)."""

    async def restart(self, i: int) -> EngineClient:
        """Replace dead engine ``i``: kill what is left of it, back off, start a new process, wait until it
        answers and has joined its weight-sync group. Returns its client (still holding the model's
        initial weights: the controller sends it the current ones). Raises when it gives up
        (``engine.max_restarts``)."""
        ...
