"""Engine supervision: deaths, restarts and the catch-up that puts a restarted engine back in service.

    rollout (PeerDead) ─┐
    weight sync ────────┼─engine_dead(i)──> router.mark_dead(i), engine/deaths ──> revive(i) task
    watch loop ─────────┘                                                          (a restarter given)
      every WATCH_S: a client that reports ``dead`` (the launcher fails a dead
      process's client at once; a hung one fails its heartbeat); a dead trainer rank raises here

    engine_dead(i) ──> trainer.drop_weight_peer(name): a send waiting on that engine stops waiting
    revive(i):  restarter.restart(i) ──> catch-up under the sync lock: trainer.send_weights(v, [new])
                  || new.update_weights(published manifest)  (weight_sync.timeout_s)
                ──> engines[i] = new, router.revive(i)  ──> wakes wait_engine()
      waits on: the launcher's restart (its own back-off, engine.max_restarts), a running weight sync

Invariants: an engine is routed to only while it holds the published weights: a restarted engine
gets them alone, verified (version and ok), before ``router.revive``; a failed catch-up restarts
it again (``engine/catch_up_failed``). The catch-up takes the publisher's sync lock, so it never
interleaves with a regular sync and always sends the newest published version. Each death is
counted once (``engine/deaths``) and starts at most one restart. The run goes on with the other
engines when the launcher gives up on one (``engine/gave_up``); it ends with an error only when no
engine is left and none can come back. Without a restarter a dead engine stays dead (the fakes,
the simulator).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from flashrl.aio import timeout
from flashrl.config import Config
from flashrl.controller.scheduler import Router, mark_engine_dead
from flashrl.controller.types import Published
from flashrl.deadlines import weight_sync_timeout_s
from flashrl.interfaces import EngineClient, EngineRestarter, TrainerClient
from flashrl.wire.protocol import WeightsUpdated
from flashrl.wire.transport import PeerDead, RemoteError

__all__ = ["WATCH_S", "EngineCatchUpError", "EngineSupervisor"]

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the watcher looks for engines reported dead and for a dead trainer rank


class EngineCatchUpError(RuntimeError):
    """A restarted engine did not load the published weights."""


class EngineSupervisor:
    """Marks engines dead, restarts them through ``restarter`` and catches them up (see the module docstring).

    ``engines`` and ``engine_versions`` are the controller's lists, shared: a restart replaces the
    client in place. ``spawn`` starts a task in the run's task group (shutdown cancels it).
    """

    def __init__(self, cfg: Config, engines: list[EngineClient], engine_versions: list[int], router: Router,
                 counters: Counter[str], trainer: TrainerClient, restarter: EngineRestarter | None,
                 published: Published, spawn: Callable[[Coroutine[Any, Any, Any], str], Any]) -> None:
        self.cfg = cfg
        self.engines = engines
        self.engine_versions = engine_versions
        self.router = router
        self.counters = counters
        self.trainer = trainer
        self.restarter = restarter
        self.published = published
        self._spawn = spawn
        self.reviving: set[int] = set()  # engines being restarted
        self._change = asyncio.Event()  # replaced after each set: an engine came back or gave up
        self._open = False  # restarts start only while the run's task group is open (start() .. stop())

    @property
    def restarts(self) -> bool:
        """Whether a dead engine can come back (a launcher that restarts engines was given)."""
        return self.restarter is not None

    def start(self) -> None:
        """The run's task group is open: restarts may start."""
        self._open = True

    def stop(self) -> None:
        """Shutdown began: no new restart, no more watching."""
        self._open = False

    def engine_dead(self, i: int, err: BaseException) -> None:
        """Engine ``i`` died (a rollout, the sync or the watcher found it): marked dead and counted once,
        then restarted in the background when it can be."""
        if not mark_engine_dead(self.router, self.counters, self.engines, i, err):
            return
        name = self.engines[i].name
        if not self._open or i in self.reviving:
            return
        if self.restarter is None:  # stays dead: only the trainer's send to it must stop waiting
            self._spawn(self._drop(name), f"drop {name}")
            return
        self.reviving.add(i)
        self._spawn(self._revive(i), f"revive {name}")

    async def _drop(self, name: str) -> None:
        """Tell the trainer that engine ``name`` is dead, so that a weight send waiting on it stops waiting
        (a send to a dead peer can otherwise hold every engine's sync up to its timeout). Best effort: a
        trainer that cannot answer is the watcher's to report."""
        try:
            await self.trainer.drop_weight_peer(name)
        except Exception as e:  # noqa: BLE001 - a dead trainer is reported by the watcher, with its cause
            log.warning("engine %s: the trainer did not take its drop (%s: %s)", name, type(e).__name__, e)

    def mark_reported_dead(self, counter: str | None = None) -> None:
        """Mark dead every live engine whose client already says so (``client.dead``), counted under
        ``counter`` when given.

        A rollout learns of a dead engine only when its own request fails; an engine that died
        while no request of ours was waiting on it would otherwise be sent the weights and fail
        the whole sync. Skipped, it fails only its own rollouts (retried elsewhere).
        """
        for i in self.router.live:
            dead = self.engines[i].dead
            if dead:
                if counter is not None:
                    self.counters[counter] += 1
                self.engine_dead(i, dead if isinstance(dead, BaseException) else PeerDead("reported dead"))

    async def watch(self) -> None:
        """Notice a dead engine that no request is waiting on, so that its restart starts without
        delay; and a dead trainer rank while no trainer call is waiting (e.g. every engine
        restarting): the run stops with its error."""
        while self._open:
            trainer_dead = self.trainer.dead
            if trainer_dead is not None:
                raise trainer_dead
            if self.restarter is not None:
                self.mark_reported_dead()
            await asyncio.sleep(WATCH_S)

    async def wait_engine(self) -> None:
        """Wait until some engine is live again (the last restart to give up ends the run instead)."""
        while self.router.all_dead:
            await self._change.wait()

    async def _revive(self, i: int) -> None:
        """Restart engine i (the launcher: kill what is left, back off, spawn, join its weight-sync
        group), give it the current weights, verified, then route to it again. Gives up when the
        launcher does (engine.max_restarts); the run goes on with the other engines."""
        assert self.restarter is not None
        name = self.engines[i].name
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            while True:
                await self._drop(name)  # the dead process's group (or the failed catch-up's), before a new one
                try:
                    client = await self.restarter.restart(i)
                except Exception as e:  # noqa: BLE001 - the launcher gave up on this engine
                    self.counters["engine/gave_up"] += 1
                    log.error("engine %s stays down: %s", name, e)
                    if self.router.all_dead and self.reviving == {i}:
                        raise RuntimeError(
                            f"no live engine left (all {len(self.engines)} dead; {name} could not be restarted: {e})"
                        ) from e
                    return
                try:
                    await self._catch_up(i, client)
                except EngineCatchUpError as e:
                    self.counters["engine/catch_up_failed"] += 1
                    log.error("engine %s: restarted but the catch-up sync failed (%s); restarting again", name, e)
                    continue
                break
            self.counters["engine/restarts"] += 1
            self.counters["engine/down_s"] += round(loop.time() - t0)
            log.warning("engine %s is back at version %d after %.1f s", name, self.engine_versions[i], loop.time() - t0)
        finally:
            self.reviving.discard(i)
            self._change.set()
            self._change = asyncio.Event()

    async def _catch_up(self, i: int, client: EngineClient) -> None:
        """Send the published weights to restarted engine ``i`` alone; route to it only once it loaded them."""
        async with self.published.lock:
            m = self.published.manifest
            if m is not None:
                limit = weight_sync_timeout_s(self.cfg)

                async def engine_side() -> WeightsUpdated:
                    try:
                        return await client.update_weights(m)
                    except (PeerDead, RemoteError) as e:  # the engine's failure, not the trainer's
                        raise EngineCatchUpError(f"{type(e).__name__}: {e}") from e

                update = asyncio.ensure_future(engine_side())
                try:
                    async with timeout(limit):
                        await self.trainer.send_weights(m.version, [client.name])  # a trainer error ends the run
                        r = await update
                except TimeoutError as e:
                    raise EngineCatchUpError(f"no catch-up within weight_sync.timeout_s = {limit}") from e
                finally:
                    if not update.done():
                        update.cancel()
                        with contextlib.suppress(BaseException):
                            await update
                if not r.ok or r.version != m.version:
                    raise EngineCatchUpError(f"answered ok={r.ok}, version={r.version}: {r.error}")
            self.engines[i] = client
            self.engine_versions[i] = m.version if m is not None else 0
            self.router.revive(i)
