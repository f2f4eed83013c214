"""Parts that answer at once, to measure what the controller itself costs per sample.

    Controller ──Generate──> InstantEngine   one loop turn (``asyncio.sleep(0)``), then a fixed
                                             token list; every token stamped with the loaded version
               ──TrainBatch─> InstantTrainer counts samples and tokens; weights "sync" at once
               ──reset/step─> InstantSuite   fixed prompt text; step ends the episode (or returns a
                                             fixed observation until ``turns``), reward alternating 0/1
    tokenizer: SimTokenizer(cache=True) (flashrl/sim/envs.py; the suite's texts repeat)

Nothing here models time: no latency, no batching, no virtual clock. With these behind the real
controller every CPU second of a run is the controller's, plus what these parts cost themselves
(measured apart by ``flashrl.bench.overhead.fixture_cost``). Use SimEngine
(flashrl/sim/engine.py) for anything that needs engine timing.

Why ``generate`` yields once instead of returning at once: a real engine client's reply always
arrives in a later loop turn (RpcClient's receive loop resolves a future), so the rollout task is
suspended and resumed once per request. Returning without suspending would measure a cheaper
path than the one that runs. ``yield_once=False`` gives that lower bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from flashrl.env import StepResult, Task
from flashrl.sim.engine import EOS_ID, FIRST_TEXT_ID, stand_in_top_logprobs
from flashrl.wire.protocol import (
    Generate,
    Generated,
    LoadReport,
    TrainBatch,
    TrainResult,
    WeightManifest,
    WeightsUpdated,
)

__all__ = ["InstantEngine", "InstantEnv", "InstantSuite", "InstantSuiteParams", "InstantTrainer"]


class InstantEngine:
    """An ``EngineClient`` that answers every request at once with ``tokens`` tokens (EOS last).

    A request with ``max_tokens < tokens`` gets ``max_tokens`` text tokens and finish_reason
    "length". ``versions`` carries the version loaded by the last ``update_weights``.
    """

    def __init__(self, name: str = "instant0", tokens: int = 16, *, yield_once: bool = True) -> None:
        if tokens < 1:
            raise ValueError(f"InstantEngine tokens must be >= 1, got {tokens}")
        self.name = name
        self.dead = None  # never dies (EngineClient.dead)
        self.tokens = tokens
        self.yield_once = yield_once
        self.version = 0
        self.requests = 0  # generate calls answered
        self.cancelled = 0  # generate calls cancelled during their one loop turn
        self.aborted = 0  # request ids named in abort() calls
        self.generated_tokens = 0
        self.updates: list[int] = []  # versions loaded, in order
        self.closed = False
        self._inflight = 0
        self._text = [FIRST_TEXT_ID + 1] * (tokens - 1)

    @property
    def inflight(self) -> int:
        return self._inflight

    async def generate(self, req: Generate) -> Generated:
        if self.closed:
            raise RuntimeError(f"{self.name}: generate on a closed engine")
        if self.yield_once:
            self._inflight += 1
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self._inflight -= 1
        if req.max_tokens >= self.tokens:
            ids = [*self._text, EOS_ID]
            reason = "stop"
        else:
            ids = self._text[: req.max_tokens]
            reason = "length"
        n = len(ids)
        self.requests += 1
        self.generated_tokens += n
        # Fresh lists per reply, as a decoded ZeroMQ reply would be (the GC sees the same objects).
        return Generated(
            request_id=req.request_id,
            token_ids=ids,
            logprobs=[-1.0] * n,
            top_logprobs=stand_in_top_logprobs(ids, [-1.0] * n, req.top_logprobs),
            versions=[self.version] * n,
            finish_reason=reason,
            engine=self.name,
        )

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += len(request_ids)

    async def update_weights(self, manifest: WeightManifest) -> WeightsUpdated:
        self.version = manifest.version
        self.updates.append(manifest.version)
        return WeightsUpdated(version=manifest.version, ok=True, seconds=0.0)

    async def load(self) -> LoadReport:
        return LoadReport(engine=self.name, version=self.version, running=self._inflight, generated_tokens=self.generated_tokens)

    async def close(self) -> None:
        self.closed = True


class InstantTrainer:
    """A ``TrainerClient`` that trains nothing: it counts what it was given and answers at once."""

    def __init__(self) -> None:
        self.version = 0
        self.steps = 0
        self.dead: BaseException | None = None  # never dies (TrainerClient.dead)
        self.samples = 0
        self.tokens = 0
        self.batch_sizes: list[int] = []
        self.closed = False

    async def train_step(self, batch: TrainBatch) -> TrainResult:
        n = len(batch.samples)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
        self.steps += 1
        self.samples += n
        self.tokens += tokens
        self.batch_sizes.append(n)
        self.version += 1
        return TrainResult(step=batch.step, metrics={"loss": 0.0, "tokens": float(tokens)})

    async def prepare_weights(self, version: int) -> WeightManifest:
        return WeightManifest(version=version, buckets=[])

    async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
        return None

    async def drop_weight_peer(self, peer: str) -> None:
        return None

    async def close(self) -> None:
        self.closed = True


class InstantSuiteParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Options of ``InstantSuite`` (constructed directly by the overhead bench; no registry entry)."""

    train_size: int = 1024
    prompt_chars: int = 64
    obs_chars: int = 16
    turns: int = 1


class InstantEnv:
    """One episode: ``reset`` returns the task's prompt; ``step`` ends it after ``turns`` steps.

    Rewards alternate 0, 1, 0, ... over the suite (so a group's rewards never all tie).
    """

    def __init__(self, suite: InstantSuite) -> None:
        self._suite = suite
        self._turn = 0

    async def reset(self, task: Task) -> str:
        self._turn = 0
        return task.prompt

    async def step(self, action: str) -> StepResult:
        self._turn += 1
        suite = self._suite
        if self._turn < suite.params.turns:
            return StepResult(observation=suite.observation, done=False)
        suite.episodes += 1
        return StepResult(reward=float(suite.episodes & 1), done=True)

    async def close(self) -> None:
        return None


class InstantSuite:
    """EnvSuite of instant episodes; no held-out tasks (the overhead bench runs no evals)."""

    Params: ClassVar[type] = InstantSuiteParams

    def __init__(self, params: InstantSuiteParams | None = None, seed: int = 0, eval_size: int = 0) -> None:
        self.params = params or InstantSuiteParams()
        p = self.params
        if p.turns < 1 or p.train_size < 1 or p.prompt_chars < 1:
            raise ValueError(f"InstantSuite: turns, train_size and prompt_chars must be >= 1, got {p}")
        self.seed = seed
        self.observation = "o" * p.obs_chars
        self._train = [Task(id=f"t{i}", prompt=(f"t{i}: " + "q" * p.prompt_chars)[: p.prompt_chars]) for i in range(p.train_size)]
        self.episodes = 0  # episodes ended by step()

    def train_tasks(self) -> Sequence[Task]:
        return self._train

    def eval_tasks(self) -> Sequence[Task]:
        return []

    def make_env(self) -> InstantEnv:
        return InstantEnv(self)
