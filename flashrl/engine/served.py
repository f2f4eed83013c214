"""Engines that serve a fixed model beside the policy's (a judge's, a distillation teacher's): the policy's engine
server (flashrl/engine/server.py) with weights that are never synced, watched and restarted.

    ServedEngines.start(): spawn the engines through the run's launcher (its "judge" role: local, a Ray placement
                           group, a SLURM layout; role indices ``index0 ..``), wait until each answers Ping; one
                           watcher per engine
    live()               : the least-loaded live engine (waiting for one at most startup_timeout_s), or
                           ``Down`` once every engine's restarts are spent (the run stops, named)
    watcher(i)           : awaits engine i's exit -> fails its client at once (every request on it raises PeerDead
                           now, not at a missed heartbeat) -> counted (<prefix>engine_died) -> restarted
                           (<prefix>engine_restarts) unless max_restarts are spent; the others serve meanwhile
    a start that fails   : (vLLM refused, its address taken, the deadline) counted (<prefix>engine_start_failed) and
                           tried again as a restart, with backoff
    a task that crashes  : a start or watcher task that ends by an error or a cancel not aclose's: logged at once,
                           and every request from then on raises aio.TaskDied naming the task and its error
    aclose()             : watchers cancelled, every engine terminated (Shutdown, SIGTERM, SIGKILL to its group)

Subclasses say what a request is (flashrl/judge/engines.py: ``generate``; flashrl/distill/engines.py: ``score``)
and name their errors (``Down``). ``opts`` is their config section: engines, kv_cache_gib, max_num_seqs, threads,
gpu_memory_utilization, max_restarts, startup_timeout_s.
Placement: engine i of a pool is the launcher's (role "judge", index0 + i): a restart is spawned again in the same
place (the same Ray bundle, the same SLURM node). Without the run's launcher (tests, a pool used on its own) the
subclass gives the pool a local launcher of its own (``own_launcher``): the roles never import a concrete launcher.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from flashrl.aio import BusyTime, TaskDied
from flashrl.engine.client import ENGINE_ARGV, EngineProcess, engine_extra_env
from flashrl.engine.server import EngineSpec
from flashrl.launch.base import Launcher
from flashrl.procs import backoff
from flashrl.wire.transport import PeerDead

__all__ = ["ServedEngines"]

log = logging.getLogger("flashrl.engine.served")


class ServedEngines:
    """``launcher``: the run's (it places and restarts the engines; the run closes it), or (``own_launcher``) one of
    this pool's own (a subclass's local launcher: started here, closed by ``aclose``). ``device``: "cpu" | "cuda"; ``gpus``: on cuda with the local launcher,
    engine i's CUDA_VISIBLE_DEVICES (None: unpinned). ``what``: the pool's name in logs and errors ("judge");
    ``prefix``: its counters' ("judge_"); ``names``: engine i's name is f"{names}{i}"."""

    Down: type[Exception] = RuntimeError  # every engine down for good (restarts spent): the run stops
    what = "served"
    prefix = ""
    names = "served"
    restarts_key = "max_restarts"  # the config key whose restarts are spent, for the Down message

    def __init__(self, opts: Any, model: str | Path, logs: Path, *, launcher: Launcher, own_launcher: bool = False,
                 max_model_len: int = 256, seed: int = 0, device: str = "cpu", gpus: list[str | None] | None = None,
                 index0: int = 0) -> None:
        self.opts = opts
        self.n = int(opts.engines)
        self.device = device
        self.gpus = gpus or [None] * self.n
        self.index0 = index0
        self._own_launcher = own_launcher  # a local launcher the subclass made for this pool alone: closed by aclose
        self.launcher = launcher
        self.model = str(model)
        self.logs = logs
        self.max_model_len = max_model_len
        self.seed = seed
        self.procs: list[EngineProcess | None] = [None] * self.n
        self.counts: Counter[str] = Counter()
        self.busy = BusyTime(self.n)  # requests in flight per engine, busy time summed over engines
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._live = asyncio.Event()
        self._closing = False
        self._generation = 0
        self._starting: list[asyncio.Task[None]] = []
        self._down: set[int] = set()  # engines whose restarts are spent
        self._crash: tuple[str, BaseException | None] | None = None  # (what, its error): a task of ours that died

    def _spec(self, i: int, address: str) -> EngineSpec:
        o = self.opts
        return EngineSpec(address=address, model=self.model, name=f"{self.names}{i}", device=self.device,  # type: ignore[arg-type]
                          max_model_len=self.max_model_len, kv_cache_gib=o.kv_cache_gib, max_num_seqs=o.max_num_seqs,
                          threads=o.threads, seed=self.seed + i, gpu_memory_utilization=o.gpu_memory_utilization)

    @property
    def _all_down(self) -> bool:
        """Every engine's restarts are spent: no request can be answered any more."""
        return len(self._down) == self.n

    def pids(self) -> list[int]:
        """The live engines' process ids (on the node each runs on)."""
        return [_pid(p) for p in self.procs if p is not None and p.alive]

    async def start(self, wait: bool = False) -> None:
        """Spawn every engine; they come up in the background (beside the policy's engines) unless ``wait``.
        One that cannot start is logged and counted (<prefix>engine_start_failed); requests wait for a live
        engine at most startup_timeout_s."""
        self._starting = [self._task(self._first_start(i), f"{self.names}{i}-start") for i in range(self.n)]
        if wait:
            await asyncio.gather(*self._starting)

    def _task(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A start or watcher task, watched: its crash is ``_task_ended``'s."""
        t = asyncio.get_running_loop().create_task(coro, name=name)
        t.add_done_callback(self._task_ended)
        return t

    def _task_ended(self, t: asyncio.Task[None]) -> None:
        """A task that ends by an error or a cancel not our own leaves an engine nobody starts or watches: the
        first is kept (requests raise it) and the requests waiting for an engine are woken to hear it."""
        if self._closing or (not t.cancelled() and t.exception() is None):
            return
        err = None if t.cancelled() else t.exception()
        what = f"{self.what} task {t.get_name()!r} " + (f"died: {type(err).__name__}: {err}" if err is not None
                                                        else f"was cancelled before the {self.what} closed")
        if self._crash is None:
            self._crash = (what, err)
            log.error("%s; the run stops (every request from now on raises it)", what, exc_info=err)
        self._live.set()

    def _raise_crash(self) -> None:
        if self._crash is not None:
            what, err = self._crash
            raise TaskDied(what) from err

    async def _first_start(self, i: int) -> None:
        try:
            await self._start_one(i)
        except Exception as e:
            self.counts[f"{self.prefix}engine_start_failed"] += 1
            log.error("%s engine %d could not start: %s", self.what, i, e)
            await self._revive(i)

    async def _revive(self, i: int) -> None:
        """Start engine i again until it is up, each try a restart (after 0, 1, 2, 4 .. 30 s), while max_restarts
        (for the whole run) last; then it stays down, and once every engine is down for good ``live`` raises
        ``Down`` (the run stops, naming it) instead of waiting."""
        tries = 0
        while self.counts[f"{self.prefix}engine_restarts"] < self.opts.max_restarts:
            self.counts[f"{self.prefix}engine_restarts"] += 1
            await asyncio.sleep(backoff(tries, 1.0, 30.0) if tries else 0.0)
            tries += 1
            try:
                await self._start_one(i)
                return
            except Exception as e:  # counted; tried again while restarts last
                self.counts[f"{self.prefix}engine_start_failed"] += 1
                log.error("%s engine %d could not be restarted: %s", self.what, i, e)
        log.error("%s engine %d stays down: %s = %d spent; logs %s", self.what, i, self.restarts_key,
                  self.opts.max_restarts, self.logs)
        self._down.add(i)
        if self._all_down:
            self._live.set()  # wakes the requests waiting for an engine: live raises Down

    async def _spawn(self, i: int) -> EngineProcess:
        """Engine i through the launcher: a fresh address where it will run, then the process."""
        self._generation += 1
        where = await self.launcher.endpoint("judge", self.index0 + i)  # a new socket per start: no stale replies
        spec = self._spec(i, where.bind)
        gpu = self.gpus[i] if self.device == "cuda" and self.launcher.name == "local" else None
        proc = await self.launcher.spawn("judge", self.index0 + i, ENGINE_ARGV,
                                         engine_extra_env(spec, {"CUDA_VISIBLE_DEVICES": gpu} if gpu else None),
                                         self.logs / f"{self.names}{i}-{self._generation}.log")
        curve = self.launcher.curve.client() if self.launcher.curve is not None else None
        log.info("%s engine %d on %s (%s launcher)", self.what, i, where.connect, self.launcher.name)
        return EngineProcess(spec, proc, heartbeat_s=0.0, connect=where.connect, curve=curve)

    async def _start_one(self, i: int) -> None:
        if self._own_launcher:
            await self.launcher.start()  # idempotent: keys when its sockets are off loopback
        ep = await self._spawn(i)
        try:
            await ep.wait_ready(self.opts.startup_timeout_s)
        except BaseException:
            try:
                await ep.discard()
            except Exception as e:  # the start's own error is the one to tell; this one is logged
                log.error("%s engine %d: discarding it after a failed start failed too: %s: %s", self.what, i,
                          type(e).__name__, e)
            raise
        self.counts[f"{self.prefix}engines_started"] += 1
        self.procs[i] = ep
        self._live.set()
        self._watchers[i] = self._task(self._watch(i, ep), f"{self.names}{i}-watcher")
        log.info("%s engine %d up (pid %d) in %.1f s", self.what, i, _pid(ep), ep.ready_s or 0.0)

    async def _watch(self, i: int, ep: EngineProcess) -> None:
        code = await ep.child.exited()
        if self._closing:
            return
        self.procs[i] = None
        if not any(self.procs):
            self._live.clear()
        self.counts[f"{self.prefix}engine_died"] += 1
        ep.client.fail(PeerDead(f"{self.what} engine {i} (pid {_pid(ep)}) died (exit code {code})"))
        log.error("%s engine %d (pid %d) died (exit code %s); log %s", self.what, i, _pid(ep), code, ep.log_path)
        await ep.discard()
        await self._revive(i)

    async def live(self) -> tuple[int, EngineProcess]:
        """The least-loaded live engine, waiting for one at most startup_timeout_s; raises ``Down`` once every
        engine is down for good, TimeoutError when none came in time, TaskDied when a task of ours crashed."""
        self._raise_crash()
        async with asyncio.timeout(self.opts.startup_timeout_s):
            while not any(self.procs):
                self._raise_crash()
                if self._all_down:
                    raise self.Down(f"every {self.what} engine is down for good: {self.restarts_key} = "
                                    f"{self.opts.max_restarts} restarts spent; see the {self.what} engines' logs in "
                                    f"{self.logs} ({self.names}<i>-<start>.log)")
                await self._live.wait()
        i = self.busy.least_loaded(k for k, p in enumerate(self.procs) if p is not None)
        ep = self.procs[i]
        assert ep is not None
        return i, ep

    async def aclose(self) -> None:
        self._closing = True
        tasks = [*self._starting, *self._watchers.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(p.terminate(timeout=10.0) for p in self.procs if p is not None), return_exceptions=True)
        self.procs = [None] * self.n
        if self._own_launcher:
            await self.launcher.close()


def _pid(ep: EngineProcess) -> int:
    """The engine's process id on its node (a local Child's, or what a remote launcher's Proc reports)."""
    child = ep.child
    proc = getattr(child, "proc", None)
    return int(proc.pid if proc is not None else getattr(child, "pid", 0))
