"""Scores from a reward model, batched, off the event loop, in worker processes that are kept alive.

    episode coroutines --score(text)--> [pending]  --dispatcher: up to max_batch, or batch_wait_s after the
                                                     first one--> batch task --backend.score_batch(texts)-->
                                                     a worker (WorkerPool: one batch at a time per worker)
    batch task <-- scores (one per text) -- futures resolved; each episode goes on

Invariants:
- every ``score`` call ends with a float, ``RewardFailed`` (never a made-up score, never 0 for an outage) or,
  when a task of the client crashed, ``aio.TaskDied``;
- one text the model cannot score never fails the others in its batch: the backend scores the batch's texts
  alone when the batch raises and returns, in that text's place, why it was refused (a str): that episode
  alone fails with RewardFailed("rm_refused") (``rm_refused``; the rollout is retried); a text longer than
  the model takes is cut to its last tokens by the worker and scored (``rm_truncated``);
- a batch whose worker died, hung past ``timeout_s`` or sent garbage (wrong count, not finite, not
  decodable) is retried up to ``retries`` times on a restarted worker (``rm_retries``; the cause counted as
  ``rm_crash`` / ``rm_timeout`` / ``rm_garbage`` / ``rm_error``) and only then fails every episode in it
  with RewardFailed (``rm_failed``), which the suite turns into an infrastructure failure (EnvFailure);
- a text scored before (or being scored) is not scored again: ``ScoreMemo`` (reward.cache_size) gives its
  score (``rm_cached``); the model is frozen, so the score is the same;
- the dispatcher never blocks on a batch: batches run as tasks, as many at once as there are workers
  (the pool's acquire waits for one), so scoring goes on beside generation;
- no task dies unseen: the dispatcher or a batch task that ends by an error (a bug: anything but a
  ScoreFailed) or by a cancel not ``aclose``'s is logged at once, fails every episode waiting on the client
  with ``aio.TaskDied`` naming the task and its error, and so does every later ``score``: the run stops,
  named, instead of its episodes waiting for a dispatcher that is gone (or a bug retried as an outage).

``ProcessScorer`` is the worker-process backend; ``Scorer`` is the protocol a backend satisfies (the
unit tests drive ``RewardModelClient`` with ``flashrl.rewardmodel.fake.FakeScorer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

import msgspec

from flashrl.aio import TaskDied
from flashrl.procs import PARENT_ENV
from flashrl.rewardmodel.memo import ScoreMemo
from flashrl.rewardmodel.worker import Ready, ScoreBatch, Scores
from flashrl.rewards import RewardFailed
from flashrl.workers import PipedProc, WorkerPool

__all__ = ["ProcessScorer", "RewardModelClient", "ScoreFailed", "Scorer"]

log = logging.getLogger("flashrl.rewardmodel")

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class ScoreFailed(Exception):
    """One batch could not be scored (infrastructure): ``reason`` is crash | timeout | garbage | error."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Scorer(Protocol):
    async def score_batch(self, texts: list[str], timeout_s: float) -> list[float | str]:
        """One score per text, in order, or in a text's place why the model refused that text alone (a str);
        ScoreFailed when the batch failed."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    @property
    def counters(self) -> dict[str, int]: ...

    def pids(self) -> list[int]: ...


# --------------------------------------------------------------------------- the process backend
_READY = msgspec.json.Decoder(Ready)
_SCORES = msgspec.json.Decoder(Scores)
_ENC = msgspec.json.Encoder()


class ProcessScorer:
    """``workers`` reward-model worker processes (flashrl/rewardmodel/worker.py), started at once and
    replaced at once when one exits (WorkerPool, eager); one batch at a time per worker."""

    def __init__(self, model: str | Path, *, workers: int = 1, threads: int = 1, device: str = "cpu",
                 startup_timeout_s: float = 120.0, runner: str = "torch", kv_cache_gib: float = 0.25) -> None:
        self.model = str(model)
        self.threads = threads
        self.device = device
        self.runner = runner  # what the workers are asked to run: torch | vllm | auto
        self.kv_cache_gib = kv_cache_gib
        self.served_by: dict[str, int] = {}  # workers started per runner that served ("torch" / "vllm")
        self.truncated = 0  # texts the workers cut to the model's length
        self.startup_timeout_s = startup_timeout_s
        self.pool: WorkerPool[asyncio.subprocess.Process] = WorkerPool(
            f"reward-model worker ({self.model})", workers, start=self._spawn, ready=self._ready,
            failure=lambda reason, detail: ScoreFailed(reason, detail), capacity=1, eager=True,
            startup_timeout_s=startup_timeout_s, wait_restarts=True)

    @property
    def counters(self) -> dict[str, int]:
        c = self.pool.counters
        return {"rm_workers_started": c["spawned"], "rm_workers_exited": c["exits"],
                "rm_workers_killed": sum(v for k, v in c.items() if k.startswith("killed:")),
                "rm_truncated": self.truncated,
                **{f"rm_workers_{r}": n for r, n in self.served_by.items() if r}}

    def pids(self) -> list[int]:
        return [w.handle.pid for w in self.pool.workers()]

    async def start(self) -> None:
        await self.pool.start()

    async def _spawn(self, slot: int, generation: int) -> tuple[PipedProc, asyncio.subprocess.Process]:
        path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(self.threads))
        env[PARENT_ENV] = str(os.getpid())  # procs.child_init: the worker dies with this process
        w = await PipedProc.start("flashrl.rewardmodel.worker", [
            "--model", self.model, "--threads", str(self.threads), "--device", self.device, "--runner", self.runner,
            "--kv-cache-gib", str(self.kv_cache_gib)], env)
        log.info("reward-model worker %d started (pid %d, generation %d)", slot, w.pid, generation)
        return w, w.proc

    async def _ready(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        try:
            msg = _READY.decode(line) if line else Ready(ready=False, error="it exited before answering")
        except msgspec.DecodeError as e:
            msg = Ready(ready=False, error=f"no ready line ({e})")
        if not msg.ready:
            raise RuntimeError(f"the reward-model worker could not load the model: {msg.error}")
        self.served_by[msg.runner] = self.served_by.get(msg.runner, 0) + 1
        if msg.note:  # reward.runner = "auto" fell back to torch: said once per worker start
            log.warning("reward-model worker (pid %d): torch serves %s: %s", proc.pid, self.model, msg.note)
        else:
            log.info("reward-model worker (pid %d): %s serves %s", proc.pid, msg.runner, self.model)

    async def score_batch(self, texts: list[str], timeout_s: float) -> list[float | str]:
        # a worker being restarted gets its start-up deadline (loading torch and the model), not the batch's
        try:
            async with asyncio.timeout(self.startup_timeout_s + timeout_s):
                w = await self.pool.acquire()
        except TimeoutError:
            raise ScoreFailed("timeout", f"no reward-model worker was ready within reward.startup_timeout_s = "
                                         f"{self.startup_timeout_s} s") from None
        proc = w.handle
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(_ENC.encode(ScoreBatch(texts=texts)) + b"\n")
            async with asyncio.timeout(timeout_s):
                await proc.stdin.drain()
                line = await proc.stdout.readline()
        except TimeoutError:
            self.pool.kill(w, "timeout")
            raise ScoreFailed("timeout", f"the reward-model worker (pid {proc.pid}) gave no scores within "
                                         f"reward.timeout_s = {timeout_s} s; killed, it is restarted") from None
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        except BaseException:
            self.pool.kill(w, "cancelled")
            raise
        if not line:
            self.pool.kill(w)
            code = await proc.wait()
            raise ScoreFailed("crash", f"the reward-model worker (pid {proc.pid}) died (exit code {code}"
                                       f"{', killed by signal ' + str(-code) if code and code < 0 else ''}); it is restarted")
        try:
            reply = _SCORES.decode(line)
        except msgspec.DecodeError as e:
            self.pool.kill(w, "garbage")
            raise ScoreFailed("garbage", f"the reward-model worker (pid {proc.pid}) sent garbage ({e}); "
                                         "killed, it is restarted") from None
        if reply.error:
            self.pool.release(w)
            raise ScoreFailed("error", f"the reward-model worker (pid {proc.pid}) failed on a batch: {reply.error}")
        refused = reply.refused or [""] * len(reply.scores)
        if (len(reply.scores) != len(texts) or len(refused) != len(texts)
                or not all(math.isfinite(s) for s, r in zip(reply.scores, refused) if not r)):
            self.pool.kill(w, "garbage")
            raise ScoreFailed("garbage", f"the reward-model worker (pid {proc.pid}) sent {len(reply.scores)} scores "
                                         f"for {len(texts)} texts (or a non-finite one); killed, it is restarted")
        self.pool.release(w)
        self.truncated += reply.truncated
        return [r or s for s, r in zip(reply.scores, refused)]

    async def aclose(self) -> None:
        await self.pool.aclose()


# --------------------------------------------------------------------------- the batching client
class RewardModelClient:
    """``await client.score(text)`` -> the model's score; batches concurrent calls (see the module doc)."""

    def __init__(self, backend: Scorer, *, max_batch: int = 64, batch_wait_s: float = 0.005,
                 timeout_s: float = 30.0, retries: int = 3, cache_size: int = 0) -> None:
        self.backend = backend
        self.memo = ScoreMemo(cache_size)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.timeout_s = timeout_s
        self.retries = retries
        self.counts: Counter[str] = Counter()
        self.latency_s = 0.0  # summed over scored episodes: from score() to its score
        self._pending: list[tuple[str, asyncio.Future[float], float]] = []
        self._wakeup: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self._closed = False
        self._crash: tuple[str, BaseException | None] | None = None  # (what, its error): a task of ours that died

    @property
    def counters(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counts)
        out.update(self.backend.counters)
        out["rm_cached"] = self.memo.reused
        if self.counts["rm_scored"]:
            out["rm_latency_ms"] = 1000 * self.latency_s / self.counts["rm_scored"]
        return out

    def pids(self) -> list[int]:
        return self.backend.pids()

    async def start(self) -> None:
        await self.backend.start()

    async def score(self, text: str) -> float:
        return await self.memo.get(text, lambda: self._score(text))

    async def _score(self, text: str) -> tuple[float, bool]:
        self._raise_crash()
        if self._closed:
            raise RewardFailed("rm_closed", "the reward-model client is closed")
        loop = asyncio.get_running_loop()
        if self._dispatcher is None:
            self._wakeup = asyncio.Event()
            self._dispatcher = loop.create_task(self._dispatch(), name="rm-dispatcher")
            self._dispatcher.add_done_callback(self._task_ended)
        fut: asyncio.Future[float] = loop.create_future()
        self._pending.append((text, fut, time.monotonic()))
        assert self._wakeup is not None
        self._wakeup.set()
        return await fut, True

    async def _dispatch(self) -> None:
        assert self._wakeup is not None
        while not self._closed:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            if len(self._pending) < self.max_batch and self.batch_wait_s > 0:
                deadline = asyncio.get_running_loop().time() + self.batch_wait_s
                while len(self._pending) < self.max_batch:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await self._wakeup.wait()
                    self._wakeup.clear()
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
                t = asyncio.get_running_loop().create_task(self._run_batch(batch), name="rm-batch")
                self._batches.add(t)
                t.add_done_callback(self._batches.discard)
                t.add_done_callback(functools.partial(self._task_ended, batch=batch))

    async def _run_batch(self, batch: list[tuple[str, asyncio.Future[float], float]]) -> None:
        texts = [t for t, _, _ in batch]
        failure: ScoreFailed | None = None
        for attempt in range(self.retries + 1):
            try:
                got = await self.backend.score_batch(texts, self.timeout_s)
            except ScoreFailed as e:
                failure = e
                self.counts[f"rm_{e.reason}"] += 1
                if attempt < self.retries:
                    self.counts["rm_retries"] += 1
                    log.warning("reward model: %s; retrying the batch of %d (retry %d of %d)", e, len(texts),
                                attempt + 1, self.retries)
                continue
            except asyncio.CancelledError:  # closing (or a cancel not ours: _task_ended names it)
                _fail_all(batch, RewardFailed("rm_closed", "the reward-model client closed"))
                raise
            except Exception as e:  # a bug, not an outage: this batch's episodes hear it named, the run stops
                _fail_all(batch, self._died(asyncio.current_task(), e))
                raise
            self._resolve(batch, got)
            return
        assert failure is not None
        self.counts["rm_failed"] += len(batch)
        log.error("reward model: a batch of %d failed after %d retries: %s", len(texts), self.retries, failure)
        _fail_all(batch, RewardFailed(f"rm_{failure.reason}", failure.detail))

    def _resolve(self, batch: list[tuple[str, asyncio.Future[float], float]], got: list[float | str]) -> None:
        """Each episode its score, or RewardFailed("rm_refused") for a text the model refused alone."""
        now = time.monotonic()
        self.counts["rm_batches"] += 1
        for (_, fut, t0), s in zip(batch, got):
            if isinstance(s, str):
                self.counts["rm_refused"] += 1
                if self.counts["rm_refused"] == 1:  # the first said; the rest counted (env/rm_refused)
                    log.warning("reward model: a text refused alone (its episode is retried; counted as "
                                "env/rm_refused): %s", s)
                if not fut.done():
                    fut.set_exception(RewardFailed("rm_refused", f"the reward model refused the text: {s}"))
                continue
            self.counts["rm_scored"] += 1
            self.latency_s += now - t0
            if not fut.done():
                fut.set_result(s)

    def _died(self, task: asyncio.Task[None] | None, err: BaseException | None) -> TaskDied:
        """The error that names a crashed task of ours: the first is kept, logged, and given to every waiter."""
        if self._crash is None:
            name = task.get_name() if task is not None else "?"
            what = f"reward-model task {name!r} " + (f"died: {type(err).__name__}: {err}" if err is not None
                                                      else "was cancelled before the client closed")
            self._crash = (what, err)
            log.error("%s; the run stops (every score from now on raises it)", what, exc_info=err)
            died = self._crashed_error()
            _fail_all(self._pending, died)
            self._pending = []
        return self._crashed_error()

    def _crashed_error(self) -> TaskDied:
        assert self._crash is not None
        what, err = self._crash
        died = TaskDied(what)
        died.__cause__ = err
        return died

    def _raise_crash(self) -> None:
        if self._crash is not None:
            raise self._crashed_error()

    def _task_ended(self, t: asyncio.Task[None], batch: list[tuple[str, asyncio.Future[float], float]] | None = None) -> None:
        """The dispatcher or a batch task ended: by an error or a cancel not aclose's, a crash (``_died``); a
        batch's episodes that still wait (its task cancelled before it ran) hear it too."""
        if self._closed or (not t.cancelled() and t.exception() is None):
            return
        _fail_all(batch or [], self._died(t, None if t.cancelled() else t.exception()))

    async def aclose(self) -> None:
        """Stop dispatching, fail what waits, stop every worker (idempotent)."""
        self._closed = True
        tasks = [t for t in (self._dispatcher, *self._batches) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, fut, _ in self._pending:
            if not fut.done():
                fut.set_exception(RewardFailed("rm_closed", "the reward-model client closed"))
        self._pending = []
        await self.backend.aclose()
        await self.memo.aclose()  # what waits has heard rm_closed by now


def _fail_all(batch: list[tuple[str, asyncio.Future[float], float]], err: BaseException) -> None:
    for _, fut, _ in batch:
        if not fut.done():
            fut.set_exception(err)
