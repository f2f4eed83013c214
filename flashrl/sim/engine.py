"""A simulated inference engine: continuous batching on the virtual clock, behind ``EngineClient``.

    generate(req) --> waiting (FIFO) --admit--> running (<= max_num_seqs, KV reservation fits)
                                                   |
         _loop():  plan k = decode steps until the next sequence finishes
                   sleep until that instant, or until woken (arrival, abort, pause, cancel)
                   -> advance every running sequence by the steps done (an interrupted step
                      finishes first: a newcomer joins at the next step boundary)
                   -> resolve finished sequences' futures with ``Generated``
    update_weights() -- pause after the current step, receive and load for ``weight_load_s`` (+ the
                        broadcast's growth with the engine count, ``sync_extra_s``), new version, resume
    abort(ids)       -- aborted sequences answer finish_reason "abort" with their tokens so far

The loop is event-driven (one wake-up per arrival or completion, not per token), so a 128-engine,
32K-token scenario costs seconds of CPU. Within a plan the batch is fixed, so the time of ``j``
decode steps has a closed form (see ``LatencyModel``).

Latency model of one engine (``LatencyModel``): a decode step over a batch of ``b`` running sequences
holding ``S`` context tokens takes ``decode_base_s + decode_per_seq_s * b + decode_per_kv_token_s * S``
(weights read once per step; per-sequence sampling/overheads; attention reads the KV cache). New
sequences add ``prefill_per_token_s`` per prompt token to the step they join. Limits that are not
modelled: KV preemption (a request waits until its whole sequence fits the KV reservation instead),
prefix caching (a multi-turn request re-prefills its whole context), speculative decoding.

Every answer is written to ``ledger`` (request id, tokens, finish reason, version of the first
token, time): the bench uses it to tell trained tokens from thrown-away ones (bench.token_ledger).

Response lengths (``LengthModel``) are a pure function of (engine seed, request seed or id): the
synchronous baseline and the asynchronous run see exactly the same samples.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import deque
from statistics import NormalDist
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from flashrl.moe.routes import stand_in_routes
from flashrl.wire.protocol import Generate, Generated, LoadReport, WeightManifest, WeightsUpdated

EOS_ID = 2
FIRST_TEXT_ID = 4  # ids below are special tokens (pad, bos, eos, unk) in flashrl's tokenizers


class LatencyModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Time costs of one simulated engine (seconds). Defaults: an 8B model on one H100 (see bench/README)."""

    decode_base_s: Annotated[float, Meta(ge=0, description="fixed cost of one decode step (reading the weights)")] = 0.012
    decode_per_seq_s: Annotated[float, Meta(ge=0, description="extra cost per running sequence per step")] = 5e-5
    decode_per_kv_token_s: Annotated[float, Meta(ge=0, description="extra cost per context token held by running sequences, per step (attention)")] = 0.0
    prefill_per_token_s: Annotated[float, Meta(ge=0, description="cost per prompt token when a sequence joins the batch")] = 2e-5
    max_num_seqs: Annotated[int, Meta(ge=1, description="concurrent sequences (vLLM max_num_seqs)")] = 128
    kv_tokens: Annotated[int, Meta(ge=0, description="KV cache capacity in tokens; a request waits until prompt + response fit (0 = unlimited)")] = 0
    weight_load_s: Annotated[float, Meta(ge=0, description="pause to receive and load new weights")] = 0.5

    def step_time(self, batch: int, context_tokens: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_kv_token_s * context_tokens


class LengthModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Long-tailed response lengths in tokens, clipped to [min_tokens, request max_tokens]."""

    dist: Annotated[Literal["lognormal", "pareto", "constant"], Meta(description="distribution family")] = "lognormal"
    median: Annotated[float, Meta(gt=0, description="median length in tokens (constant: the length)")] = 512.0
    sigma: Annotated[float, Meta(ge=0, description="lognormal: std of log length (1.0 puts the 99.9th percentile at 22x the median)")] = 1.0
    alpha: Annotated[float, Meta(gt=0, description="pareto: tail index (smaller = heavier tail)")] = 1.5
    min_tokens: Annotated[int, Meta(ge=1, description="shortest response")] = 1

    def length(self, u: float, max_tokens: int) -> int:
        """The length for uniform ``u`` in (0, 1) (inverse CDF), clipped."""
        if self.dist == "constant":
            x = self.median
        elif self.dist == "lognormal":
            x = self.median * math.exp(self.sigma * _NORMAL.inv_cdf(u))
        else:  # pareto with the given median: x_m = median / 2**(1/alpha)
            x = self.median / 2 ** (1 / self.alpha) * (1 - u) ** (-1 / self.alpha)
        return max(self.min_tokens, min(max_tokens, int(round(x))))


_NORMAL = NormalDist()


def request_key(req: Generate) -> bytes:
    """What identifies a sample across runs: its seed if the controller set one, else its id."""
    return f"s{req.seed}".encode() if req.seed is not None else f"r{req.request_id}".encode()


def stand_in_top_logprobs(ids: list[int], logprobs: list[float], k: int) -> list[list[tuple[int, float]]]:
    """A stand-in engine's answer to Generate.top_logprobs = k: per token, the sampled token first with its
    logprob, then k - 1 neighbouring ids each a nat less likely ([] when k is 0)."""
    return [[(t + j, lp - j) for j in range(k)] for t, lp in zip(ids, logprobs)] if k > 0 else []


def uniform(seed: int, key: bytes, salt: bytes = b"len") -> float:
    """A uniform number in (0, 1) that depends only on (seed, key, salt)."""
    h = hashlib.blake2b(key, digest_size=8, key=seed.to_bytes(8, "little") + salt).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2**64


def steps_within(prefill: float, a: float, c: float, elapsed: float, kmax: int) -> int:
    """Largest ``j <= kmax`` with ``prefill + j*a + c*j*(j-1)/2 <= elapsed`` (decode steps done)."""
    if elapsed < prefill + a:
        return 0
    x = elapsed - prefill
    if c <= 0:
        j = int(x / a) if a > 0 else kmax
    else:  # c/2 j^2 + (a - c/2) j - x = 0
        b = a - c / 2
        j = int((-b + math.sqrt(b * b + 2 * c * x)) / c)
    j = min(max(j, 0), kmax)

    def t(n: int) -> float:
        return n * a + c * n * (n - 1) / 2

    while j > 0 and t(j) > x:
        j -= 1
    while j < kmax and t(j + 1) <= x:
        j += 1
    return j


class LedgerEntry(NamedTuple):
    """One answered request: what it generated and how it ended."""

    request_id: str
    tokens: int
    finish: str  # "stop" | "length" | "abort"
    first_version: int  # policy version of its first token (the engine's version if it generated none)
    t: float  # when it was answered (virtual seconds)


class _Seq:
    __slots__ = ("req", "key", "prompt_len", "target", "finish", "done", "segments", "fut", "gone")

    def __init__(self, req: Generate, key: bytes, target: int, finish: str, fut: asyncio.Future[Generated]) -> None:
        self.req = req
        self.key = key
        self.prompt_len = len(req.prompt_ids)
        self.target = target  # tokens this request will generate (including EOS when it stops)
        self.finish = finish
        self.done = 0
        self.segments: list[list[int]] = []  # [version, tokens] runs: per-token versions, compressed
        self.fut = fut
        self.gone = False  # cancelled by the caller or aborted: leave at the next wake-up

    def add(self, version: int, n: int) -> None:
        if n <= 0:
            return
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1][1] += n
        else:
            self.segments.append([version, n])
        self.done += n


class SimEngine:
    """One simulated engine; implements ``flashrl.interfaces.EngineClient`` on the running loop's clock."""

    def __init__(
        self,
        name: str,
        latency: LatencyModel | None = None,
        lengths: LengthModel | None = None,
        *,
        seed: int = 0,
        vocab_size: int = 64,
        sync_extra_s: float = 0.0,
        routes: Any = None,
    ) -> None:
        if vocab_size <= FIRST_TEXT_ID + 1:
            raise ValueError(f"vocab_size must be > {FIRST_TEXT_ID + 1}, got {vocab_size}")
        self.name = name
        # a MoE policy's routes (a RouteShape, flashrl/moe/routes.py): every answer carries well-formed stand-in
        # routes of that shape, the payload a MoE engine sends and the controller checks and keeps per token
        self._routes = stand_in_routes(routes, seed=seed) if routes is not None else None
        self.dead = None  # never dies (EngineClient.dead)
        self.latency = latency or LatencyModel()
        self.lengths = lengths or LengthModel()
        self.seed = seed
        self.vocab_size = vocab_size
        self.sync_extra_s = sync_extra_s  # the weight broadcast's extra rounds with many engines (TrainerModel.sync_extra_s)
        self.version = 0
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._inflight = 0
        self._kv_reserved = 0
        self._paused = 0  # nested pauses (update_weights)
        self._pause_acks: list[asyncio.Future[None]] = []  # resolved once paused at a step boundary
        self._wake: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # accounting (virtual seconds)
        self._t0: float | None = None
        self.busy_s = 0.0  # time with >= 1 sequence decoding
        self.slot_s = 0.0  # integral of the running batch size over time
        self.generated_tokens = 0
        self.finished = 0
        self.aborted = 0
        self.ledger: list[LedgerEntry] = []  # one entry per answered request

    # ------------------------------------------------------------------ EngineClient
    @property
    def inflight(self) -> int:
        return self._inflight

    async def generate(self, req: Generate) -> Generated:
        if self._closed:
            raise RuntimeError(f"{self.name}: generate on a closed engine")
        loop = asyncio.get_running_loop()
        self._ensure_loop(loop)
        key = request_key(req)
        natural = self.lengths.length(uniform(self.seed, key), 1 << 30)
        if natural < req.max_tokens:
            target, finish = natural, "stop"  # the last token is EOS
        else:
            target, finish = req.max_tokens, "length"
        if self.latency.kv_tokens and len(req.prompt_ids) + target > self.latency.kv_tokens:
            raise ValueError(
                f"{self.name}: request {req.request_id!r} needs {len(req.prompt_ids) + target} KV tokens but the engine "
                f"holds {self.latency.kv_tokens}; raise latency.kv_tokens or lower max_tokens"
            )
        seq = _Seq(req, key, target, finish, loop.create_future())
        self._waiting.append(seq)
        self._inflight += 1
        self._poke()
        try:
            return await seq.fut
        except asyncio.CancelledError:
            seq.gone = True
            self._poke()
            raise
        finally:
            self._inflight -= 1

    async def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for seq in (*self._waiting, *self._running):
            if seq.req.request_id in ids:
                seq.gone = True
        self._poke()

    async def update_weights(self, manifest: WeightManifest) -> WeightsUpdated:
        loop = asyncio.get_running_loop()
        self._ensure_loop(loop)
        start = loop.time()
        self._paused += 1
        ack: asyncio.Future[None] = loop.create_future()
        self._pause_acks.append(ack)
        self._poke()
        try:
            await ack  # the step in progress finishes first (its boundary may lie a little ahead)
            await asyncio.sleep(self.latency.weight_load_s + self.sync_extra_s)
            self.version = manifest.version
        finally:
            self._paused -= 1
            self._poke()
        return WeightsUpdated(version=self.version, ok=True, seconds=loop.time() - start)

    async def load(self) -> LoadReport:
        loop = asyncio.get_running_loop()
        elapsed = loop.time() - self._t0 if self._t0 is not None else 0.0
        kv = self._kv_reserved / self.latency.kv_tokens if self.latency.kv_tokens else len(self._running) / self.latency.max_num_seqs
        return LoadReport(
            engine=self.name,
            version=self.version,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=kv,
            tokens_per_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0,
            busy_fraction=self.busy_s / elapsed if elapsed > 0 else 0.0,
            generated_tokens=self.generated_tokens,
        )

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for seq in (*self._waiting, *self._running):
            self._record(seq, "abort")
            if not seq.fut.done():
                seq.fut.set_result(self._answer(seq, "abort"))
        self._waiting.clear()
        self._running.clear()

    # ------------------------------------------------------------------ accounting
    def busy_until(self, now: float) -> float:
        """Busy seconds up to ``now``, counting the part of the current decode plan already run."""
        if self._plan_start is None:
            return self.busy_s
        return self.busy_s + max(0.0, now - self._plan_start)

    def generated_until(self, now: float) -> int:
        """Tokens generated up to ``now``, counting the decode steps of the current plan already done."""
        if self._plan_start is None or self._plan is None:
            return self.generated_tokens
        prefill, a, c, k, b = self._plan
        return self.generated_tokens + b * steps_within(prefill, a, c, now - self._plan_start, k)

    # ------------------------------------------------------------------ the batching loop
    _plan_start: float | None = None  # start of the decode plan now running (busy accounting)
    _plan: tuple[float, float, float, int, int] | None = None  # (prefill, a, c, k, batch) of that plan
    _state_t = 0.0  # the instant the running sequences' counts are valid for (a step boundary)

    def _ensure_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None:
            self._t0 = self._state_t = loop.time()
            self._task = loop.create_task(self._loop(), name=f"sim-engine-{self.name}")

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _sleep_until(self, loop: asyncio.AbstractEventLoop, when: float | None) -> None:
        """Wait until ``when`` (None: forever) or until poked."""
        self._wake = loop.create_future()
        handle = loop.call_at(when, self._poke) if when is not None else None
        try:
            await self._wake
        finally:
            self._wake = None
            if handle is not None:
                handle.cancel()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        lat = self.latency
        while True:
            self._drop_gone()
            if self._state_t < loop.time():
                self._state_t = loop.time()  # idle time: the next plan starts now
            if self._paused:
                for ack in self._pause_acks:
                    if not ack.done():
                        ack.set_result(None)
                self._pause_acks.clear()
                await self._sleep_until(loop, None)
                continue
            prefill = self._admit()
            if not self._running:
                await self._sleep_until(loop, None)
                continue
            b = len(self._running)
            ctx = sum(s.prompt_len + s.done for s in self._running)
            a = lat.step_time(b, ctx)
            c = lat.decode_per_kv_token_s * b
            k = min(s.target - s.done for s in self._running)
            t_start = self._state_t
            t_end = t_start + prefill + k * a + c * k * (k - 1) / 2
            self._plan_start = t_start
            self._plan = (prefill, a, c, k, b)
            try:
                await self._sleep_until(loop, t_end)
            finally:
                self._plan_start = None
                self._plan = None
            now = loop.time()
            if now >= t_end:
                j = k
            else:  # woken early: the step in progress completes, then the batch changes
                elapsed = now - t_start
                j = steps_within(prefill, a, c, elapsed, k)
                if prefill + j * a + c * j * (j - 1) / 2 < elapsed - 1e-12 * max(1.0, now):
                    j += 1  # strictly inside a step (not on its boundary): it finishes first
            dt = prefill + j * a + c * j * (j - 1) / 2
            self._state_t = t_start + dt
            self.busy_s += dt
            self.slot_s += dt * b
            self.generated_tokens += j * b
            version = self.version
            still: list[_Seq] = []
            for s in self._running:
                s.add(version, j)
                if s.done >= s.target:
                    self._finish(s, s.finish)
                else:
                    still.append(s)
            self._running = still
            if self._state_t > now:
                # The interrupted step ends a little later; nothing new may start before it does.
                await self._sleep_until_boundary(loop)

    async def _sleep_until_boundary(self, loop: asyncio.AbstractEventLoop) -> None:
        while loop.time() < self._state_t:
            await self._sleep_until(loop, self._state_t)

    def _admit(self) -> float:
        """Move waiting requests into the batch; return the prefill time they add."""
        lat = self.latency
        prefill_tokens = 0
        while self._waiting and len(self._running) < lat.max_num_seqs:
            seq = self._waiting[0]
            need = seq.prompt_len + seq.target
            if lat.kv_tokens and self._kv_reserved + need > lat.kv_tokens:
                break  # FIFO: later requests do not overtake (as vLLM's scheduler)
            self._waiting.popleft()
            self._kv_reserved += need
            self._running.append(seq)
            prefill_tokens += seq.prompt_len
        return prefill_tokens * lat.prefill_per_token_s

    def _drop_gone(self) -> None:
        if any(s.gone for s in self._waiting):
            kept: deque[_Seq] = deque()
            for s in self._waiting:
                if s.gone:
                    self._finish(s, "abort", reserved=False)
                else:
                    kept.append(s)
            self._waiting = kept
        if any(s.gone for s in self._running):
            kept_running = []
            for s in self._running:
                if s.gone:
                    self._finish(s, "abort")
                else:
                    kept_running.append(s)
            self._running = kept_running

    def _finish(self, seq: _Seq, reason: str, reserved: bool = True) -> None:
        if reserved:
            self._kv_reserved -= seq.prompt_len + seq.target
        if reason == "abort":
            self.aborted += 1
        else:
            self.finished += 1
        self._record(seq, reason)  # also when the caller cancelled (no one reads the answer): its tokens were generated
        if not seq.fut.done():
            seq.fut.set_result(self._answer(seq, reason))

    def _record(self, seq: _Seq, reason: str) -> None:
        first = seq.segments[0][0] if seq.segments else self.version
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:  # pragma: no cover - answered outside a loop
            now = 0.0
        self.ledger.append(LedgerEntry(seq.req.request_id, seq.done, reason, first, now))

    def _answer(self, seq: _Seq, reason: str) -> Generated:
        n = seq.done
        ids = self._tokens(seq.key, n, eos=reason == "stop")
        versions: list[int] = []
        for v, cnt in seq.segments:
            versions += [v] * cnt
        return Generated(
            request_id=seq.req.request_id,
            token_ids=ids,
            logprobs=[-1.0] * n,
            top_logprobs=stand_in_top_logprobs(ids, [-1.0] * n, seq.req.top_logprobs),
            versions=versions,
            finish_reason=reason,
            engine=self.name,
            routes=self._routes(n) if self._routes is not None else b"",
        )

    def _tokens(self, key: bytes, n: int, eos: bool) -> list[int]:
        """``n`` token ids: a short pseudo-random head (so samples differ), filler, EOS when stopped."""
        if n <= 0:
            return []
        span = self.vocab_size - FIRST_TEXT_ID
        head_n = min(n - (1 if eos else 0), 8)
        h = hashlib.blake2b(key, digest_size=8, key=self.seed.to_bytes(8, "little") + b"tok").digest()
        ids = [FIRST_TEXT_ID + h[i] % span for i in range(head_n)]
        ids += [FIRST_TEXT_ID] * (n - head_n - (1 if eos else 0))
        if eos:
            ids.append(EOS_ID)
        return ids
