"""The weight publisher: every version the trainer makes reaches every live engine, verified, before
the batch that made it frees its admission slots.

    train loop, after step s:  wait() (the sync of v = s, beside that step's training; its error raises here)
                               prepare(s+1): trainer.prepare_weights (gather + pack + checksums)
                               start(s+1, batch, manifest) ──> sync task in the run's task group:
      sync task:  under Published.lock: engines whose client reports ``dead`` are skipped (counted)
                  trainer.send_weights(v, live) || engine.update_weights(manifest) for each live engine
                  (weight_sync.timeout_s) ──> Published = (manifest, v)
              ──> on_synced(batch) (buffer.mark_trained: frees the slots, so a prompt admitted into
                  them generates with v) ──> the step's record gets the sync's times ──> emitted,
                  if the train loop released it meanwhile (release())
      waits on: the trainer's broadcast, every live engine's load; a restarted engine's catch-up
      (supervisor.py) holds the same lock

Invariants: at most one sync runs (the train loop waits for the previous one before it prepares
the next: the trainer refuses otherwise), and ``Published.version`` moves only when every live
engine answered ok with that version: a bad load is never served. An engine that dies or fails
its load during a sync only drops out of it (handed to the supervisor, which restarts it when it
can); without a restarter a failed load ends the run (a bad sync is never served). A LoRA adapter an
engine refuses leaves it live at its older version, held back from new requests (Router.hold_back) until
it loads a newer one; when every live engine refused a version, ``Published.version`` stays at the one
they serve, and an eval of the refused version is not run (evals.py: counted). A step's record
goes out only with its sync's times: ``release(record)`` emits it now, or when its sync is done.

Evals hold the engines' weights (``hold(v)`` .. ``unhold(v)``, evals.py): while an eval of version v
runs, no newer version is loaded, so every eval token is from v, and the train loop does not wait:

    start(u > v) while held ──> deferred: no broadcast, no task; the trainer keeps the prepared u
    start(u+1) while u is deferred ──> u is superseded (never sent: the trainer's PrepareWeights
        replaces it); its batch frees its slots, and its record goes out, with u+1's sync
        (``time/sync/skipped`` = 1: no sync of its own; counted as ``weight_sync/skipped_versions``)
    unhold(v) ──> the deferred version's sync starts at once: one sync to the newest prepared
        weights, like a restarted engine's catch-up (supervisor.py); during a prepare (which
        replaces the deferred version in the trainer) the prepared one goes instead, from start()

Evals on engines set apart (``run.eval_engines`` = k, fewer than the live engines): ``hold(v)`` sets the
k least busy live engines apart (router.reserve: no new training request goes to them); they load v
and keep it for the eval, while every version made meanwhile goes to the other engines at once (no
deferral), so the train loop never waits for the eval's stragglers. When the eval ends (``unhold``),
``_rejoin`` sends the published version to those engines alone (the trainer re-sends its last
version, as for a restarted engine) and only then does training route to them again. A queued eval's
version goes to the others at once and to the eval's engines when the eval before it ends; the train
loop's ``wait()`` for that version lasts until then (the trainer must still hold it). Records of
steps after a running eval's wait for its record (ledger.eval_due: step order).

A deferred version that a queued eval will evaluate (``hold`` of a version not yet loaded: evals
closer together than one eval's time) is pinned: never superseded, so ``wait()`` waits for it
(the train loop cannot prepare the next version before it is sent).

Why this shape (measured on configs/tiny.toml, bench/results/evals): the trainer's wait for evals
went from 11% of wall time to 0.13%, since an eval (0.4-1.5 s there) rarely outlasts the
async_ratio + 1 steps the trainer can take on samples of v. Receiving versions beside the eval and
deferring only the engine's load would hide at most the catch-up sync after it (~35 ms there), at
the cost of an engine change and a second copy of the weights on the engine; evals at a higher
priority would end the hold sooner but take the same engine time from training rollouts (an eval's
tokens are already ~70% of the engine's output while it runs: eval/engine_share). The catch-up is
one sync however long the eval took, and the staleness bound is the only limit on how far the
trainer goes meanwhile (core/staleness.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from flashrl.aio import timeout
from flashrl.config import Config
from flashrl.controller.buffer import Group
from flashrl.controller.scheduler import Router
from flashrl.controller.supervisor import EngineSupervisor
from flashrl.controller.types import Published
from flashrl.core.records import BatchStats, StepRecord
from flashrl.deadlines import weight_sync_timeout_s
from flashrl.interfaces import EngineClient, TrainerClient
from flashrl.wire.protocol import AdapterRefused, WeightManifest
from flashrl.wire.transport import PeerDead, RemoteError

__all__ = ["AdapterRefused", "PendingSync", "WeightPublisher"]

log = logging.getLogger(__name__)


class PendingSync:
    """A weight sync started by the train loop: the version, the batch that made it, and the step
    record that gets its times (emitted by the sync when the loop released it before it was done)."""

    __slots__ = ("version", "batch", "task", "record", "step_record", "phases", "engine", "emit", "manifest", "t0",
                 "carried", "pinned", "spawned", "apart_done")

    def __init__(self, version: int, batch: list[Group]) -> None:
        self.version = version
        self.batch = batch
        self.task: asyncio.Task[None] | None = None  # None while deferred (an eval holds older weights)
        self.record: BatchStats | None = None
        self.step_record: StepRecord | None = None
        self.phases: dict[str, float] | None = None  # set when done
        self.engine: dict[str, float] = {}  # the least busy engine's occupancy, reported by this sync
        self.emit = False
        self.manifest: WeightManifest | None = None  # kept while deferred
        self.t0 = 0.0  # when its prepare began
        self.carried: list[PendingSync] = []  # superseded versions, done (batches freed, records out) with this one
        self.pinned = False  # a queued eval evaluates this version: never superseded
        self.spawned = asyncio.Event()  # its task exists
        # a queued eval evaluates this version on engines set apart (run.eval_engines): set once they hold it
        self.apart_done: asyncio.Event | None = None

    @property
    def deferred(self) -> bool:
        """Prepared, but held back by an eval of an older version (not sending yet)."""
        return self.task is None


class WeightPublisher:
    """Prepares, broadcasts and verifies each version (see the module docstring).

    ``engines`` / ``engine_versions``: the controller's lists, shared with the supervisor (a restart
    replaces a client in place). ``on_synced(batch)`` runs when the batch's version is on every live
    engine; ``emit(record)`` writes a step record; ``spawn`` starts a task in the run's task group.
    """

    def __init__(self, cfg: Config, trainer: TrainerClient, engines: list[EngineClient], engine_versions: list[int],
                 router: Router, counters: Counter[str], published: Published, supervisor: EngineSupervisor, *,
                 clock: Callable[[], float], spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
                 on_synced: Callable[[list[Group]], None], emit: Callable[[StepRecord], None]) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.engines = engines
        self.engine_versions = engine_versions
        self.router = router
        self.counters = counters
        self._refusals: dict[int, int] = {}  # engine index -> LoRA adapter versions refused in a row
        self._refused_at: dict[int, int] = {}  # engine index -> the newest LoRA adapter version it refused
        self._sent = published.version  # the newest version whose sync every live engine answered (ok or refused)
        self.published = published
        self.supervisor = supervisor
        self._clock = clock
        self._spawn = spawn
        self._on_synced = on_synced
        self._emit = emit
        self.pending: PendingSync | None = None  # the last sync started by the train loop (weight_sync.overlap)
        self.last_sync_s = 0.0  # the last finished sync's time/weight_sync_s (the dashboard's)
        self._engine_timings: dict[str, float] = {}  # the current sync's slowest-engine phases
        self._engine_occupancy: list[dict[str, float]] = []  # the current sync's engines: busy since the last
        self._engine_extra = 0  # the current sync's largest engine/sync_extra_bytes (receive buffers held)
        # versions held for evals, oldest first: [0] is loaded and being evaluated, the rest queued
        self._holds: deque[int] = deque()
        self._synced = asyncio.Event()  # set (and replaced) after each finished broadcast
        self._preparing = False  # a PrepareWeights is in flight (the trainer no longer holds the deferred version)
        # run.eval_engines: the engines the running (and queued) evals hold (None: every engine, as above)
        self._apart: frozenset[int] | None = None
        self._rejoining: frozenset[int] | None = None  # set apart by an eval that ended, not caught up yet

    @property
    def holds(self) -> tuple[int, ...]:
        """The versions held for evals, oldest (the one loaded) first."""
        return tuple(self._holds)

    @property
    def held(self) -> int | None:
        """The version an eval holds the engines at (None: no eval runs; newer versions load as made)."""
        return self._holds[0] if self._holds else None

    @property
    def defers(self) -> bool:
        """Whether an eval holds every engine's weights (versions made now wait for its end)."""
        return bool(self._holds) and self._apart is None

    # ------------------------------------------------------------------ the train loop's calls
    async def prepare(self, version: int) -> tuple[WeightManifest, dict[str, float]]:
        """The trainer's gather + pack + checksums of ``version`` (``prepare_s``: the round trip;
        ``trainer/*``: its parts). The previous sync must be done (the trainer refuses otherwise)."""
        t0 = self._clock()
        self._preparing = True  # the deferred version is being replaced: unhold must not send it now
        try:
            manifest = await self.trainer.prepare_weights(version)
        finally:
            self._preparing = False
        phases = {"prepare_s": self._clock() - t0}
        phases.update({f"trainer/{k}": v for k, v in manifest.timings.items()})
        return msgspec.structs.replace(manifest, timings={}), phases  # engines need no trainer timings

    def start(self, version: int, batch: list[Group], manifest: WeightManifest, t0: float) -> PendingSync:
        """Start the sync of a prepared ``version`` (made by ``batch``; ``t0``: when its prepare began)."""
        p = PendingSync(version, batch)
        p.manifest, p.t0 = manifest, t0
        prev = self.pending
        if prev is not None and prev.deferred:
            # never sent (the train loop prepared ``version`` over it): it is done with this sync
            assert not prev.pinned, f"version {prev.version} is pinned for an eval and was superseded"
            p.carried = [*prev.carried, prev]
            prev.carried = []
            self.counters["weight_sync/skipped_versions"] += 1
        self.pending = p
        held = self.held
        if held is None or version <= held or self._apart is not None:  # apart: the other engines take it now
            self._spawn_sync(p)
        return p

    def _spawn_sync(self, p: PendingSync) -> None:
        assert p.manifest is not None
        p.task = self._spawn(self._publish(p, p.manifest, p.t0), f"sync v{p.version}")
        p.manifest = None
        p.spawned.set()

    async def wait(self) -> float:
        """Wait for the train loop's last sync (its error raises here); the seconds waited. A version
        deferred by an eval is not waited for (the next version supersedes it), unless an eval is
        queued for it (pinned: it is sent when the running eval ends)."""
        p = self.pending
        if p is None or (p.deferred and not p.pinned):
            return 0.0
        t0 = self._clock()
        await p.spawned.wait()
        assert p.task is not None
        if not p.task.done():
            await asyncio.wait([p.task])  # not ``await task``: a cancel of this waiter must not cancel the sync
        p.task.result()
        if p.apart_done is not None:  # a queued eval's version: until the eval's engines hold it too
            await p.apart_done.wait()
        return self._clock() - t0

    async def flush(self) -> float:
        """Wait until the last version the train loop made is on the engines (a deferred one is sent
        when the eval holding it back ends: call after evals.quiesce)."""
        p = self.pending
        if p is not None and p.deferred and not self._holds:
            self._spawn_sync(p)
        if p is not None and p.deferred:
            p.pinned = True
        return await self.wait()

    # ------------------------------------------------------------------ evals
    def hold(self, version: int) -> None:
        """An eval of ``version`` is due: once ``version`` is loaded, no newer one is until ``unhold``.
        ``version`` is the train loop's newest (its sync started, or deferred by a running eval: then
        pinned, and loaded when the evals before it end)."""
        if self._holds and version <= self._holds[-1]:
            raise RuntimeError(f"eval of version {version} after one of {self._holds[-1]}: evals go in version order")
        p = self.pending
        if not self._holds:
            self._apart = self._set_apart()
            if self._apart is not None:
                self.router.reserve(self._apart)
        elif self._apart is not None:
            # queued: its version goes to the other engines now, and the train loop's wait() for it lasts
            # until the eval's engines load it (the trainer must still have it then: unhold)
            assert p is not None and p.version == version, (version, p and p.version)
            p.pinned = True
            p.apart_done = asyncio.Event()
        else:
            assert p is not None and p.version == version and p.deferred, (version, p and p.version)
            p.pinned = True
        self._holds.append(version)

    def _set_apart(self) -> frozenset[int] | None:
        """The engines an eval starting now holds (run.eval_engines of the live ones, the least busy), or
        None: every engine (eval_engines = 0, or no more live engines than that)."""
        k = self.cfg.run.eval_engines
        live = self.router.live
        if not 0 < k < len(live):
            return None
        if self._rejoining is not None:  # still behind the others: the next eval holds them again
            return self._rejoining
        return frozenset(sorted(live, key=lambda i: (self.router.inflight[i], i))[:k])

    @property
    def eval_engines(self) -> frozenset[int] | None:
        """The engines the running eval runs on (None: every engine)."""
        return self._apart

    def holding(self, version: int) -> bool:
        """Whether the engines an eval of ``version`` runs on hold exactly ``version`` (the live ones; without
        engines set apart, those the router sends requests to: every engine behind the published version is
        held back). False after a LoRA refusal left them at another version: the eval is refused (evals.py)."""
        if self._apart is None:
            return self.published.version == version
        return all(self.engine_versions[i] == version for i in self._apart if self.router.alive[i])

    def unhold(self, version: int) -> None:
        """The eval of ``version`` ended: the newest prepared version (or the next eval's) loads now."""
        assert self._holds and self._holds[0] == version, (version, list(self._holds))
        self._holds.popleft()
        if self._apart is not None:  # the eval's engines rejoin: the next eval's version, or the newest
            apart = self._apart
            nxt = self._holds[0] if self._holds else None
            if nxt is None:
                self._apart = None  # the next syncs go to every engine (the rejoin's catch-up first, if due)
                self._rejoining = apart
            self._spawn(self._rejoin(apart, nxt, self.pending), f"eval engines to v{nxt if nxt is not None else 'newest'}")
            return
        p = self.pending
        # a prepare in flight replaces the deferred version: start() sends the new one, at once
        if p is not None and p.deferred and not self._preparing:
            self._spawn_sync(p)

    async def loaded(self, version: int) -> None:
        """Wait until the engines hold ``version`` (or newer: held, they never do during its eval);
        with engines set apart for evals, until those hold it. Also ends when they answered its sync and
        refused it (LoRA): ``holding`` then says the eval's engines do not hold it."""
        while not self._loaded(version):
            await self._synced.wait()

    def _loaded(self, version: int) -> bool:
        if self._apart is None:
            return self.published.version >= version or self._sent >= version
        return all(max(self.engine_versions[i], self._refused_at.get(i, -1)) >= version
                   for i in self._apart if self.router.alive[i]) and (self.published.version >= version or self._sent >= version)

    def _hold_back(self) -> None:
        """The live engines behind the published version (a LoRA adapter refused; not those an eval holds at
        its older version) take no new request while others can (Router.hold_back): every token generated from
        now on is at least ``published.version``, as Published says."""
        apart = self._apart or frozenset()
        self.router.hold_back(frozenset(i for i in self.router.live
                                        if i not in apart and self.engine_versions[i] < self.published.version))

    async def _rejoin(self, apart: frozenset[int], version: int | None, p: PendingSync | None) -> None:
        """After an eval on engines set apart: bring them to ``version`` (the queued eval's, which the train
        loop's wait() keeps on the trainer until then) or, None, to the newest published weights, then
        let training requests use them again. Like a restarted engine's catch-up (supervisor.py): the
        trainer re-sends the published version to those engines alone."""
        while version is not None and self.published.version < version and self._sent < version:
            await self._synced.wait()  # the other engines first (the train loop waits for this version meanwhile)
        async with self.published.lock:
            m = self.published.manifest
            behind = [i for i in self.router.live if i in apart and m is not None and self.engine_versions[i] < m.version]
            if m is not None and behind:
                assert version is None or m.version == version, (m.version, version)
                limit = weight_sync_timeout_s(self.cfg)
                try:
                    async with timeout(limit), asyncio.TaskGroup() as tg:
                        tg.create_task(self.trainer.send_weights(m.version, [self.engines[i].name for i in behind]),
                                       name="trainer.send_weights (eval engines)")
                        for i in behind:
                            tg.create_task(self._update_engine(i, m), name=f"update {self.engines[i].name}")
                except TimeoutError:
                    raise RuntimeError(
                        f"the eval engines' catch-up to version {m.version} took longer than weight_sync.timeout_s = "
                        f"{limit:.0f} s: check the trainer and engine logs, or raise the timeout") from None
                self.counters["weight_sync/eval_rejoins"] += 1
            self._hold_back()
            self._synced.set()
            self._synced = asyncio.Event()
        if version is None:
            if self._rejoining is apart:
                self._rejoining = None
            if self._apart is None:
                self.router.reserve(frozenset())
        elif p is not None and p.version == version and p.apart_done is not None:
            p.apart_done.set()

    def attach(self, p: PendingSync, record: StepRecord) -> None:
        """``record`` (the step that made ``p``'s version) gets the sync's times, now or when it is done."""
        assert record.batch is not None
        p.record = record.batch
        if p.phases is not None:  # done already (serial, or a sync faster than the step's record)
            _add_sync(record.batch, p.phases, p.engine)
        p.step_record = record

    def release(self, record: StepRecord) -> None:
        """Emit ``record`` now, or when the sync it carries the times of is done."""
        p = self.pending
        if p is not None and p.phases is None:  # p's sync also carries the versions it superseded
            for q in (p, *p.carried):
                if q.step_record is record:
                    q.emit = True
                    return
        self._emit(record)

    async def sync_now(self, version: int) -> dict[str, float]:
        """Publish ``version`` to every live engine, here and now (a resumed run's first weights)."""
        manifest, phases = await self.prepare(version)
        phases.update(await self._send(version, manifest))
        return phases

    # ------------------------------------------------------------------ the sync
    async def _publish(self, p: PendingSync, manifest: WeightManifest, t0: float) -> None:
        """The sync of a prepared version, beside training: every live engine loads it, then the
        batch that made it frees its slots, and its step record gets the sync's times (and goes out, if
        the loop released it meanwhile)."""
        phases = await self._send(p.version, manifest)
        if self._engine_occupancy:  # the least busy engine since the previous sync (records: engine/*)
            least = min(self._engine_occupancy, key=lambda o: sum(o.values()))
            p.engine = {**least, "busy": min(1.0, sum(least.values()))}
        if self._engine_extra:  # the largest receive-buffer footprint of an engine in this sync (weight_sync.load)
            p.engine = {**p.engine, "sync_extra_bytes": float(self._engine_extra)}
        # the bytes each engine received in this sync: the full weights, or the adapter's tensors (model.lora)
        nbytes = sum(b.numel * _ITEMSIZE.get(b.dtype, 0) for b in manifest.buckets)
        if nbytes:
            p.engine = {**p.engine, "sync_bytes": float(nbytes)}
        for q in p.carried:  # superseded versions: their batches' slots, their records (in step order)
            self._on_synced(q.batch)
            q.phases = {"weight_sync_s": 0.0, "skipped": 1.0}
            if q.record is not None:
                _add_sync(q.record, q.phases, p.engine)  # its interval's engine: the carrier's covers it
                q.record.counters = dict(sorted(self.counters.items()))
                if q.emit and q.step_record is not None:
                    self._emit(q.step_record)
        p.carried = []
        self._on_synced(p.batch)
        self.last_sync_s = self._clock() - t0  # prepare + broadcast + loads: the sync's own time
        phases["weight_sync_s"] = self.last_sync_s
        p.phases = phases
        if p.record is not None:
            _add_sync(p.record, phases, p.engine)
            # the counters at the step's end, which is now (its batch trained, its skipped engines counted)
            p.record.counters = dict(sorted(self.counters.items()))
            if p.emit and p.step_record is not None:
                self._emit(p.step_record)

    async def _send(self, version: int, manifest: WeightManifest) -> dict[str, float]:
        """Broadcast a prepared ``version`` to every live engine; return where the time went (``time/sync/*``
        seconds, by phase: send = the broadcast until every engine answered; engine/* = the slowest
        engine's pause, receive, verify, load, rpc, resume)."""
        async with self.published.lock:
            t1 = self._clock()
            phases: dict[str, float] = {}
            self._engine_timings = {}
            self._engine_occupancy = []
            self._engine_extra = 0
            self.supervisor.mark_reported_dead("weight_sync/found_dead_engines")
            live = self.router.live
            held = self.held
            if self._apart is not None and held is not None and version > held:
                # an eval holds its engines at an older version: the others take this one now (none live
                # outside them and none reviving: they take it too, and the eval's tokens are mixed: counted)
                outside = [i for i in live if i not in self._apart]
                if outside or self.supervisor.reviving:
                    live = outside
            if not live and not self.supervisor.reviving:
                raise RuntimeError(
                    f"no live engine to publish weights version {version} to (all {len(self.engines)} dead): "
                    "check the engine logs in the run directory and restart the run"
                )
            limit = weight_sync_timeout_s(self.cfg)
            peers = [self.engines[i].name for i in live]
            try:
                async with timeout(limit), asyncio.TaskGroup() as tg:
                    tg.create_task(self.trainer.send_weights(version, peers), name="trainer.send_weights")
                    for i in live:
                        tg.create_task(self._update_engine(i, manifest), name=f"update {self.engines[i].name}")
            except TimeoutError:
                raise RuntimeError(
                    f"weight sync to version {version} took longer than weight_sync.timeout_s = "
                    f"{limit:.0f} s: check the trainer and engine logs, or raise the timeout"
                ) from None
            # the newest version sent (what a catch-up sends: the trainer holds it); the published version moves
            # only if a live engine holds it: when every one refused it (LoRA), they all still serve the one before
            self.published.manifest = manifest
            if not live or any(self.engine_versions[i] == version for i in live):
                self.published.version = version
            elif any(i in self._refused_at for i in live):
                log.error("weights version %d: every live engine refused it; they serve version %d", version,
                          self.published.version)
            self._sent = max(self._sent, version)
            self._hold_back()
            self._synced.set()
            self._synced = asyncio.Event()
            skipped = len(self.engines) - len(self.router.live)
            if skipped:
                self.counters["weight_sync/skipped_dead_engines"] += skipped
            phases["send_s"] = self._clock() - t1
            phases.update({f"engine/{k}": v for k, v in self._engine_timings.items()})
            return phases

    def _adapter_refused(self, i: int, version: int, r: Any) -> None:
        """A LoRA adapter version that engine ``i``'s vLLM refused: counted (weight_sync/adapter_refused) and logged;
        the engine stays live at the version it still serves, and takes the next version as every engine does.
        AdapterRefused after ADAPTER_REFUSALS_MAX refusals in a row (the adapter, not the engine, is at fault)."""
        self.counters["weight_sync/adapter_refused"] += 1
        self._refused_at[i] = version
        n = self._refusals[i] = self._refusals.get(i, 0) + 1
        name = self.engines[i].name
        what = (f"engine {name} refused LoRA adapter version {version} and still serves version "
                f"{self.engine_versions[i]}: {r.error or 'no error given'}")
        if n >= ADAPTER_REFUSALS_MAX:
            raise AdapterRefused(f"{what}; {n} versions refused in a row by {name}: the adapter does not fit the "
                                 "engines' LoRA settings (check model.lora against the model and the engine log)",
                                 version, self.engine_versions[i])
        log.error("%s (%d in a row; the run ends at %d)", what, n, ADAPTER_REFUSALS_MAX)

    async def _update_engine(self, i: int, manifest: WeightManifest) -> None:
        """One engine's part of a sync. An engine that dies meanwhile only drops out (its request
        fails at once: the launcher fails a dead process's client), never fails or stalls the sync."""
        engine = self.engines[i]
        try:
            r = await engine.update_weights(manifest)
        except PeerDead as e:
            self.counters["weight_sync/engine_died"] += 1
            self.supervisor.engine_dead(i, e)
            return
        except RemoteError as e:
            if self.trainer.dead is not None:
                return  # the sender died mid-broadcast: its own call raises TrainerDied, naming the rank
            if not self.supervisor.restarts:
                raise
            self.counters["weight_sync/engine_failed"] += 1
            self.supervisor.engine_dead(i, e)  # its receive failed: taken out; a fresh process gets verified weights
            return
        if not r.ok and r.adapter_refused:
            self._adapter_refused(i, manifest.version, r)
            return
        self._refusals.pop(i, None)
        if not r.ok or r.version != manifest.version:
            msg = (f"engine {engine.name} failed to load weights version {manifest.version} "
                   f"(answered ok={r.ok}, version={r.version}): {r.error or 'no error given'}; a bad sync is never served")
            if not self.supervisor.restarts:
                raise RuntimeError(msg)
            self.counters["weight_sync/engine_failed"] += 1
            self.supervisor.engine_dead(i, RuntimeError(msg))  # taken out; a fresh process gets verified weights
            return
        self.engine_versions[i] = manifest.version
        for k, v in r.timings.items():  # the slowest engine's phases: what the sync waited for
            self._engine_timings[k] = max(v, self._engine_timings.get(k, 0.0))
        if r.occupancy:
            self._engine_occupancy.append(r.occupancy)
        self._engine_extra = max(self._engine_extra, r.extra_bytes)


# A refused adapter version (engine/lora.py AdapterRefused) leaves its engine alive at the version it had (no
# restart: a fresh engine would be sent the same adapter); this many refusals in a row by one engine end the run.
ADAPTER_REFUSALS_MAX = 3


# bytes per element of the wire's dtypes (flashrl.wire.weights.DTYPES, without importing torch here)
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def _add_sync(b: BatchStats, phases: dict[str, float], engine: dict[str, float]) -> None:
    """A finished sync's times into its step's record: ``weight_sync_s`` (its own time), its phases, and
    how busy its least busy engine was since the previous sync (``engine``: stepping, commands, busy)."""
    b.weight_sync_s = phases["weight_sync_s"]
    b.sync.update({k: v for k, v in phases.items() if k != "weight_sync_s"})
    b.engine = dict(engine)
