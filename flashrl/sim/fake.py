"""The Fake family: small scripted stand-ins of every part the controller talks to, for unit tests.

    Controller ──Generate──> FakeEngine     awaits a scripted duration on the loop clock; tokens are
                                            stamped with the version loaded when each was produced
               ──TrainBatch─> FakeTrainer   records batches; prepare/send weights on the loop clock
               ──reset/step─> FakeEnv       (of a FakeSuite) reward = action starts with the answer
    FakeTokenizer: one id per character (its code point), eos 0.

Every behaviour is scripted (durations, failures, deaths, hangs), so a test states exactly what
happens and asserts exact times and token layouts. They use only the event loop's clock, so they
work on real time and on virtual time alike (``flashrl.sim.clock.run_virtual``: minutes of
scheduling in milliseconds). Which stand-in family to use when: ``flashrl.sim``'s docstring.
"""

from __future__ import annotations

import json
import random
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import msgspec

from flashrl.env import EnvFailure, StepResult, Task
from flashrl.sim.engine import stand_in_top_logprobs
from flashrl.wire.protocol import (
    Generate,
    Generated,
    LoadReport,
    TrainBatch,
    TrainResult,
    WeightManifest,
    WeightsUpdated,
)
from flashrl.wire.transport import PeerDead

__all__ = [
    "FakeTokenizer",
    "FakeEngine",
    "FakeTrainer",
    "FakeEnv",
    "FakeSuite",
    "default_script",
]

# script(request, engine version at arrival) -> (token ids, seconds to produce all of them)
Script = Callable[[Generate, int], tuple[list[int], float]]
DIGITS = [ord(c) for c in "0123456789"]


def default_script(token_s: float = 0.01, min_tokens: int = 1) -> Script:
    """Seeded random length in [min_tokens, max_tokens] of random digits, ``token_s`` per token.

    Depends only on the request's seed, so two engines give the same sample for the same request.
    """

    def script(req: Generate, version: int) -> tuple[list[int], float]:
        rng = random.Random(req.seed if req.seed is not None else req.request_id)
        n = rng.randint(min(min_tokens, req.max_tokens), req.max_tokens)
        return [rng.choice(DIGITS) for _ in range(n)], n * token_s

    return script


class FakeEngine:
    """An EngineClient that produces scripted tokens over scripted time on the event-loop clock.

    Token i of a request of duration d started at t0 is produced at t0 + (i + 1) * d / n and is
    stamped with the version loaded at that instant, so weights can change mid-request. An abort
    returns the tokens produced so far with finish_reason "abort". ``kill()`` makes every pending
    and later call raise PeerDead, like a dead engine process.
    """

    def __init__(
        self,
        name: str = "fake0",
        script: Script | None = None,
        *,
        sync_s: float = 0.0,
        update_ok: bool = True,
        die_at: float | None = None,
        occupancy: dict[str, float] | None = None,
        extra_bytes: int = 0,
        refuse_adapter: Callable[[int], bool] | None = None,
        routes: Callable[[int], bytes] | None = None,
    ) -> None:
        self.name = name
        # a MoE engine's routes: tokens -> packed routes (flashrl/moe/routes.py stand_in_routes); None: a dense model's
        self.routes = routes
        # LoRA: the adapter versions this engine's vLLM refuses (WeightsUpdated.adapter_refused; it keeps its version)
        self.refuse_adapter = refuse_adapter
        self.occupancy = dict(occupancy or {})  # what each WeightsUpdated reports (a real engine measures it)
        self.extra_bytes = extra_bytes  # the receive buffers each WeightsUpdated reports (engine/sync_extra_bytes)
        self.script = script or default_script()
        self.sync_s = sync_s
        self.update_ok = update_ok
        self.die_at = die_at  # loop time at which the engine dies by itself (None = never)
        self.version = 0
        self.requests: list[Generate] = []
        self.request_times: list[float] = []
        self.aborted: list[str] = []
        self.updates: list[int] = []
        self.dead = False
        self._history: list[tuple[float, int]] = [(-float("inf"), 0)]  # (loaded at, version)
        self._wake: dict[str, anyio.Event] = {}
        self._inflight = 0
        self.max_inflight = 0

    @property
    def inflight(self) -> int:
        return self._inflight

    def _version_at(self, t: float) -> int:
        v = 0
        for when, ver in self._history:
            if when <= t:
                v = ver
        return v

    def kill(self) -> None:
        self.dead = True
        for ev in self._wake.values():
            ev.set()

    def _check_alive(self) -> None:
        if self.die_at is not None and anyio.current_time() >= self.die_at:
            self.dead = True
        if self.dead:
            raise PeerDead(f"engine {self.name} is dead (fake)")

    async def generate(self, req: Generate) -> Generated:
        self._check_alive()
        t0 = anyio.current_time()
        self.requests.append(req)
        self.request_times.append(t0)
        tokens, duration = self.script(req, self.version)
        tokens = tokens[: req.max_tokens]
        ev = anyio.Event()
        self._wake[req.request_id] = ev
        self._inflight += 1
        self.max_inflight = max(self.max_inflight, self._inflight)
        try:
            limit = duration
            if self.die_at is not None:
                limit = min(limit, max(self.die_at - t0, 0.0))
            with anyio.move_on_after(limit):
                await ev.wait()
            self._check_alive()
        finally:
            self._inflight -= 1
            del self._wake[req.request_id]
        elapsed = anyio.current_time() - t0
        n = len(tokens)
        aborted = ev.is_set()
        done = n if not aborted or duration <= 0 else min(n, int(n * elapsed / duration))
        times = [t0 + (k + 1) * duration / max(n, 1) for k in range(done)]
        rng = random.Random(f"{req.seed}:lp" if req.seed is not None else f"{req.request_id}:lp")
        logprobs = [-rng.random() for _ in range(done)]
        return Generated(
            request_id=req.request_id,
            token_ids=tokens[:done],
            logprobs=logprobs,
            top_logprobs=stand_in_top_logprobs(tokens[:done], logprobs, req.top_logprobs),
            versions=[self._version_at(t) for t in times],
            finish_reason="abort" if aborted else ("length" if n >= req.max_tokens else "stop"),
            engine=self.name,
            routes=self.routes(done) if self.routes is not None else b"",
        )

    async def abort(self, request_ids: list[str]) -> None:
        self._check_alive()
        for rid in request_ids:
            self.aborted.append(rid)
            ev = self._wake.get(rid)
            if ev is not None:
                ev.set()

    async def update_weights(self, manifest: WeightManifest) -> WeightsUpdated:
        self._check_alive()
        await anyio.sleep(self.sync_s)
        self._check_alive()
        if not self.update_ok:
            return WeightsUpdated(version=self.version, ok=False, error="checksum mismatch (fake)")
        if self.refuse_adapter is not None and self.refuse_adapter(manifest.version):
            return WeightsUpdated(version=self.version, ok=False, adapter_refused=True,
                                  error=f"adapter v{manifest.version} refused by vLLM (fake)")
        self.version = manifest.version
        self._history.append((anyio.current_time(), manifest.version))
        self.updates.append(manifest.version)
        return WeightsUpdated(version=manifest.version, ok=True, seconds=self.sync_s, occupancy=self.occupancy,
                              extra_bytes=self.extra_bytes)

    async def load(self) -> LoadReport:
        return LoadReport(engine=self.name, version=self.version, running=self._inflight)

    async def close(self) -> None:
        self.dead = True


class FakeTrainer:
    """A TrainerClient that records every batch; each call takes a fixed time on the loop clock.

    Metrics: ``loss`` = -mean reward of the batch, ``samples`` = batch size. ``fail_at_step``
    raises RuntimeError from that train_step (to test crash propagation).

    Checkpoints: ``save_checkpoint(path, background=True)`` captures the state at once and writes it
    ``ckpt_write_s`` later on the loop clock, beside training (as the real trainer's DCP thread does);
    ``finish_checkpoint(path)`` waits for that write and renames it into place. ``fail_write`` (an
    exception) makes the background write fail after half its files.
    """

    def __init__(self, *, train_s: float = 0.0, sync_s: float = 0.0, fail_at_step: int | None = None,
                 prepare_s: float = 0.0) -> None:
        self.train_s = train_s
        self.sync_s = sync_s
        self.prepare_s = prepare_s
        self._preparing: int | None = None
        self.fail_at_step = fail_at_step
        self.batches: list[TrainBatch] = []
        self.dead: BaseException | None = None  # never dies (TrainerClient.dead)
        self.train_times: list[float] = []  # loop time when each train_step began
        self.prepared: list[int] = []
        self.sent: list[int] = []
        self.dropped: list[str] = []  # drop_weight_peer's peers, in order
        self.saved: list[str] = []  # checkpoint folders written
        self.fail_save: BaseException | None = None
        self.ckpt_write_s = 0.0
        self.fail_write: BaseException | None = None
        self.writes: dict[str, tuple[Any, float]] = {}  # background writes in flight: path -> (task, started)
        self.train_during_write: list[int] = []  # steps trained while a background write was in flight

    async def train_step(self, batch: TrainBatch) -> TrainResult:
        self.train_times.append(anyio.current_time())
        if any(not t.done() for t, _ in self.writes.values()):
            self.train_during_write.append(batch.step)
        await anyio.sleep(self.train_s)
        if self.fail_at_step is not None and batch.step == self.fail_at_step:
            raise RuntimeError(f"fake trainer failure at step {batch.step}")
        self.batches.append(batch)
        rewards = [s.reward for s in batch.samples]
        return TrainResult(step=batch.step, metrics={"loss": -sum(rewards) / max(len(rewards), 1), "samples": float(len(rewards))})

    async def prepare_weights(self, version: int) -> WeightManifest:
        # like the real trainer: the previous prepared version is gone from the prepare's start
        if self.prepare_s:  # (0: no await at all, as the tests written before it expect)
            self._preparing = version
            try:
                await anyio.sleep(self.prepare_s)
            finally:
                self._preparing = None
        self.prepared.append(version)
        return WeightManifest(version=version)

    async def send_weights(self, version: int, peers: list[str] | None = None) -> None:
        # like the real trainer (trainer/sender.py WeightPublisher.send): only the version just prepared, or the
        # one sent last (a restarted engine's catch-up); a prepared one that a later prepare replaced is gone
        last = self.prepared[-1] if self.prepared and self._preparing is None else None
        if version != last and (not self.sent or version != self.sent[-1]):
            raise RuntimeError(f"SendWeights({version}): prepared {last}, last sent "
                               f"{self.sent[-1] if self.sent else None}; send PrepareWeights({version}) first")
        await anyio.sleep(self.sync_s)
        self.sent.append(version)

    async def drop_weight_peer(self, peer: str) -> None:
        self.dropped.append(peer)

    async def save_checkpoint(self, path: str | Path, background: bool = False) -> float:
        """A real (tiny) DCP checkpoint in ``path``, like the trainer's: tmp folder, then rename.

        ``fail_save`` (an exception) is raised instead, after half the files are written (a full disk).
        ``background``: the state is taken now, written ``ckpt_write_s`` later; ``finish_checkpoint`` seals it.
        """
        import asyncio

        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        version = len(self.batches)  # the state as of now (the real trainer stages it before replying)
        if not background:
            self._write(tmp, version)
            if self.fail_save is not None:
                raise self.fail_save
            self._seal(tmp, final, version)
            return 0.0

        async def write() -> None:
            await anyio.sleep(self.ckpt_write_s)
            self._write(tmp, version)
            if self.fail_write is not None:
                raise self.fail_write

        self.writes[str(final)] = (asyncio.ensure_future(write()), anyio.current_time())
        return 0.0

    async def finish_checkpoint(self, path: str | Path, timeout_s: float) -> float:
        import asyncio

        final = Path(path)
        task, started = self.writes[str(final)]
        try:
            with anyio.fail_after(timeout_s):
                await asyncio.shield(task)
        finally:
            if task.done():
                del self.writes[str(final)]
        self._seal(final.with_name(final.name + ".tmp"), final, None)
        return anyio.current_time() - started

    def _write(self, tmp: Path, version: int) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        state = {"version": torch.tensor(version), "w": torch.arange(256, dtype=torch.float32)}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": yes, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        (tmp / "version").write_text(str(version))

    def _seal(self, tmp: Path, final: Path, version: int | None) -> None:
        if version is None:
            version = int((tmp / "version").read_text())
        (tmp / "trainer.json").write_text(json.dumps({"version": version}))
        tmp.rename(final)
        self.saved.append(str(final))

    async def close(self) -> None:
        pass


class FakeTokenizer:
    """One id per character (its code point); id 0 is EOS and decodes to nothing."""

    eos_token_id = 0
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i != 0)


class FakeSuiteParams(msgspec.Struct, forbid_unknown_fields=True):
    """FakeSuite takes no ``[env.params]``: tests construct it directly."""


@dataclass(eq=False)
class FakeSuite:
    """An EnvSuite of arithmetic-free tasks: task i asks for the digit ``i % 10``.

    reward = 1.0 when the action starts with the answer. ``turns``: steps until done (observation
    " obs<k> " in between). ``step_s(task, turn)``: env latency. ``fail(task, call)`` returns an
    EnvFailure reason (or None) for the ``call``-th step of that task across all attempts, ``hang``
    likewise returns True to sleep forever (the turn deadline must catch it), ``crash`` raises a
    plain exception (a bug, which must crash the run). Like the suites of envs/faults.py and
    envs/remote.py it keeps ``counters`` ("steps", "fail:<reason>", "hang") and has ``aclose()``
    (counted in ``aclosed``), the suite-level resources a controller must release at shutdown.
    """

    Params: ClassVar[type] = FakeSuiteParams

    n_train: int = 16
    n_eval: int = 0
    turns: int = 1
    step_s: Callable[[Task, int], float] | float = 0.0
    fail: Callable[[Task, int], str | None] | None = None
    hang: Callable[[Task, int], bool] | None = None
    crash: Callable[[Task, int], bool] | None = None
    calls: dict[str, int] = field(default_factory=dict)  # task id -> env.step calls so far
    counters: Counter[str] = field(default_factory=Counter)
    closed: int = 0
    opened: int = 0
    aclosed: int = 0

    def _tasks(self, prefix: str, n: int) -> list[Task]:
        return [Task(id=f"{prefix}{i}", prompt=f"{prefix}{i}?", answer=str(i % 10)) for i in range(n)]

    def train_tasks(self) -> Sequence[Task]:
        return self._tasks("t", self.n_train)

    def eval_tasks(self) -> Sequence[Task]:
        return self._tasks("e", self.n_eval)

    def make_env(self) -> FakeEnv:
        self.opened += 1
        return FakeEnv(self)

    async def aclose(self) -> None:
        self.aclosed += 1


class FakeEnv:
    def __init__(self, suite: FakeSuite) -> None:
        self.suite = suite
        self.task: Task | None = None
        self.turn = 0
        self._closed = False

    async def reset(self, task: Task) -> str:
        self.task = task
        self.turn = 0
        return task.prompt

    async def step(self, action: str) -> StepResult:
        s, task = self.suite, self.task
        assert task is not None, "step() before reset()"
        call = s.calls.get(task.id, 0)
        s.calls[task.id] = call + 1
        s.counters["steps"] += 1
        delay = s.step_s(task, self.turn) if callable(s.step_s) else s.step_s
        await anyio.sleep(delay)
        if s.hang and s.hang(task, call):
            s.counters["hang"] += 1
            await anyio.sleep_forever()
        if s.crash and s.crash(task, call):
            raise ValueError(f"scripted env bug on {task.id}")
        if s.fail:
            reason = s.fail(task, call)
            if reason:
                s.counters[f"fail:{reason}"] += 1
                raise EnvFailure(reason, f"scripted failure on {task.id}")
        self.turn += 1
        correct = action.startswith(task.answer)
        if self.turn >= s.turns:
            return StepResult(reward=1.0 if correct else 0.0, done=True, info={"correct": correct})
        return StepResult(observation=f" obs{self.turn} ", reward=0.0, done=False)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.suite.closed += 1
