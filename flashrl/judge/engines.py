"""The judge's vLLM engine processes: the policy's engine server (flashrl/engine/server.py) serving the judge's
weights, never synced, restarted when one dies.

    JudgeEngines.start(): spawn judge.engines engine processes through the run's launcher (role "judge": local,
                          Ray placement group, SLURM layout), wait until each answers Ping; one watcher per engine
    generate(ids)       : the least-loaded live engine; Generate -> Generated within judge.timeout_s;
                          its death (PeerDead), a refusal or the deadline -> JudgeEngineFailed(reason)
    watcher(i)          : awaits engine i's exit -> fails its client at once (every request on it raises
                          PeerDead now, not at a missed heartbeat) -> counted (judge_engine_died) -> restarted
                          (judge_engine_restarts) unless judge.max_restarts are spent; the others serve meanwhile
    a start that fails  : (vLLM refused, its address taken, the deadline) counted (judge_engine_start_failed) and
                          tried again as a restart, with backoff; once every engine's restarts are spent,
                          generate raises JudgeDown and the run stops, named (never an endless wait)
    a task that crashes : a start or watcher task that ends by an error (a launcher's kill or stop raising, a
                          bug) or a cancel not aclose's: logged at once, and every generate from then on (the
                          verdicts waiting for an engine too) raises aio.TaskDied naming the task and its error:
                          the run stops at once, never waiting judge.startup_timeout_s for an engine that
                          nothing will start
    a request refused   : the engine answered Error for this request alone (vLLM refused its input: a prompt
                          longer than the judge's max_model_len) -> JudgeRefused, not an engine failure
    aclose()            : watchers cancelled, every engine terminated (Shutdown, SIGTERM, SIGKILL to its group)

Invariants: a request goes only to an engine that answered Ping and has not exited; ``generate`` waits for a
live engine at most judge.startup_timeout_s (a restart), then fails loudly; nothing here updates weights.
Placement: the run's launcher (cluster.launcher) places judge engine i as (role "judge", i), beside the policy's
engines and trainer ranks: a restart is spawned again in the same place (the same Ray bundle, the same SLURM node).
Without a launcher (tests, a judge used on its own) a local launcher of its own starts them on this machine.
On cuda the judge runs on engine.device; locally each judge engine gets a GPU of its own after the trainer ranks'
and the policy engines' when the machine has enough (else it shares, judge.gpu_memory_utilization).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from flashrl.aio import BusyTime, TaskDied
from flashrl.config import JudgeConfig
from flashrl.engine.client import ENGINE_ARGV, EngineProcess, engine_extra_env
from flashrl.engine.server import EngineSpec
from flashrl.launch.base import Launcher
from flashrl.procs import backoff
from flashrl.wire.protocol import Generate, Generated
from flashrl.wire.transport import PeerDead, RemoteError, TransportError

__all__ = ["JudgeDown", "JudgeEngineFailed", "JudgeEngines", "JudgeRefused"]

log = logging.getLogger("flashrl.judge")


class JudgeEngineFailed(Exception):
    """A verdict request failed for the engine's sake: ``reason`` is engine_died | engine_timeout | engine_error."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class JudgeRefused(Exception):
    """The judge refused this verdict request for its input (its engine is healthy and would refuse it again):
    the judge's text is longer than its max_model_len leaves room for, or vLLM's input check failed."""


class JudgeDown(RuntimeError):
    """Every judge engine is down and none can come back (judge.max_restarts spent): the run cannot be judged and
    stops, naming it (not an infrastructure retry: no verdict could ever come)."""


class JudgeEngines:
    """``launcher``: the run's (it places and restarts the engines; the run closes it), or None: a local launcher of
    this object's own, closed by ``aclose``. ``device``: "cpu" | "cuda"; ``gpus``: on cuda with the local launcher,
    judge engine i's CUDA_VISIBLE_DEVICES (None: unpinned)."""

    def __init__(self, jc: JudgeConfig, model: str | Path, logs: Path, *, max_model_len: int = 256, seed: int = 0,
                 launcher: Launcher | None = None, device: str = "cpu", gpus: list[str | None] | None = None) -> None:
        self.jc = jc
        self.device = device
        self.gpus = gpus or [None] * jc.engines
        self._own_launcher = launcher is None
        if launcher is None:
            from flashrl.launch.local import LocalLauncher

            launcher = LocalLauncher(logs.parent)
        self.launcher = launcher
        self.model = str(model)
        self.logs = logs
        self.max_model_len = max_model_len
        self.seed = seed
        self.procs: list[EngineProcess | None] = [None] * jc.engines
        self.counts: Counter[str] = Counter()
        self.busy = BusyTime(jc.engines)  # verdicts in flight per engine, busy time summed over engines
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._live = asyncio.Event()
        self._closing = False
        self._generation = 0
        self._starting: list[asyncio.Task[None]] = []
        self._down: set[int] = set()  # engines whose restarts are spent
        self._crash: tuple[str, BaseException | None] | None = None  # (what, its error): a task of ours that died

    def _spec(self, i: int, address: str) -> EngineSpec:
        return EngineSpec(address=address, model=self.model, name=f"judge{i}", device=self.device,  # type: ignore[arg-type]
                          max_model_len=self.max_model_len, kv_cache_gib=self.jc.kv_cache_gib,
                          max_num_seqs=self.jc.max_num_seqs, threads=self.jc.threads, seed=self.seed + i,
                          gpu_memory_utilization=self.jc.gpu_memory_utilization)

    @property
    def _all_down(self) -> bool:
        """Every engine's restarts are spent: no verdict can come any more."""
        return len(self._down) == self.jc.engines

    def pids(self) -> list[int]:
        """The live judge engines' process ids (on the node each runs on)."""
        return [_pid(p) for p in self.procs if p is not None and p.alive]

    async def start(self, wait: bool = False) -> None:
        """Spawn every engine; they come up in the background (beside the policy's engines) unless ``wait``.
        One that cannot start is logged and counted (judge_engine_start_failed); verdicts wait for a live
        engine at most judge.startup_timeout_s."""
        self._starting = [self._task(self._first_start(i), f"judge{i}-start") for i in range(self.jc.engines)]
        if wait:
            await asyncio.gather(*self._starting)

    def _task(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A start or watcher task, watched: its crash is ``_task_ended``'s."""
        t = asyncio.get_running_loop().create_task(coro, name=name)
        t.add_done_callback(self._task_ended)
        return t

    def _task_ended(self, t: asyncio.Task[None]) -> None:
        """A task that ends by an error or a cancel not our own leaves an engine nobody starts or watches: the
        first is kept (generate raises it) and the verdicts waiting for an engine are woken to hear it."""
        if self._closing or (not t.cancelled() and t.exception() is None):
            return
        err = None if t.cancelled() else t.exception()
        what = f"judge task {t.get_name()!r} " + (f"died: {type(err).__name__}: {err}" if err is not None
                                                  else "was cancelled before the judge closed")
        if self._crash is None:
            self._crash = (what, err)
            log.error("%s; the run stops (every verdict from now on raises it)", what, exc_info=err)
        self._live.set()

    def _raise_crash(self) -> None:
        if self._crash is not None:
            what, err = self._crash
            raise TaskDied(what) from err

    async def _first_start(self, i: int) -> None:
        try:
            await self._start_one(i)
        except Exception as e:
            self.counts["judge_engine_start_failed"] += 1
            log.error("judge engine %d could not start: %s", i, e)
            await self._revive(i)

    async def _revive(self, i: int) -> None:
        """Start engine i again until it is up, each try a judge_engine_restart (after 0, 1, 2, 4 .. 30 s), while
        judge.max_restarts (for the whole run) last; then it stays down, and once every engine is down for good
        ``generate`` raises JudgeDown (the run stops, naming it) instead of waiting."""
        tries = 0
        while self.counts["judge_engine_restarts"] < self.jc.max_restarts:
            self.counts["judge_engine_restarts"] += 1
            await asyncio.sleep(backoff(tries, 1.0, 30.0) if tries else 0.0)
            tries += 1
            try:
                await self._start_one(i)
                return
            except Exception as e:  # counted; tried again while restarts last
                self.counts["judge_engine_start_failed"] += 1
                log.error("judge engine %d could not be restarted: %s", i, e)
        log.error("judge engine %d stays down: judge.max_restarts = %d spent; logs %s", i, self.jc.max_restarts,
                  self.logs)
        self._down.add(i)
        if self._all_down:
            self._live.set()  # wakes the verdicts waiting for an engine: generate raises JudgeDown

    async def _spawn(self, i: int) -> EngineProcess:
        """Judge engine i through the launcher: a fresh address where it will run, then the process."""
        self._generation += 1
        where = await self.launcher.endpoint("judge", i)  # a new socket per start: no stale replies
        spec = self._spec(i, where.bind)
        gpu = self.gpus[i] if self.device == "cuda" and self.launcher.name == "local" else None
        proc = await self.launcher.spawn("judge", i, ENGINE_ARGV, engine_extra_env(spec, {"CUDA_VISIBLE_DEVICES": gpu} if gpu else None),
                                         self.logs / f"judge{i}-{self._generation}.log")
        curve = self.launcher.curve.client() if self.launcher.curve is not None else None
        log.info("judge engine %d on %s (%s launcher)", i, where.connect, self.launcher.name)
        return EngineProcess(spec, proc, heartbeat_s=0.0, connect=where.connect, curve=curve)

    async def _start_one(self, i: int) -> None:
        if self._own_launcher:
            await self.launcher.start()  # idempotent: keys when its sockets are off loopback
        ep = await self._spawn(i)
        try:
            await ep.wait_ready(self.jc.startup_timeout_s)
        except BaseException:
            try:
                await ep.discard()
            except Exception as e:  # the start's own error is the one to tell; this one is logged
                log.error("judge engine %d: discarding it after a failed start failed too: %s: %s", i,
                          type(e).__name__, e)
            raise
        self.counts["judge_engines_started"] += 1
        self.procs[i] = ep
        self._live.set()
        self._watchers[i] = self._task(self._watch(i, ep), f"judge{i}-watcher")
        log.info("judge engine %d up (pid %d) in %.1f s", i, _pid(ep), ep.ready_s or 0.0)

    async def _watch(self, i: int, ep: EngineProcess) -> None:
        code = await ep.child.exited()
        if self._closing:
            return
        self.procs[i] = None
        if not any(self.procs):
            self._live.clear()
        self.counts["judge_engine_died"] += 1
        ep.client.fail(PeerDead(f"judge engine {i} (pid {_pid(ep)}) died (exit code {code})"))
        log.error("judge engine %d (pid %d) died (exit code %s); log %s", i, _pid(ep), code, ep.log_path)
        await ep.discard()
        await self._revive(i)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int) -> Generated:
        """One verdict's tokens from the least-loaded live engine; JudgeEngineFailed when that engine fails."""
        self._raise_crash()
        try:
            async with asyncio.timeout(self.jc.startup_timeout_s):
                while not any(self.procs):
                    self._raise_crash()
                    if self._all_down:
                        raise JudgeDown(f"every judge engine is down for good: judge.max_restarts = "
                                        f"{self.jc.max_restarts} restarts spent; see the judge engines' logs in "
                                        f"{self.logs} (judge<i>-<start>.log)")
                    await self._live.wait()
        except TimeoutError:
            raise JudgeEngineFailed("engine_died", f"no judge engine alive within judge.startup_timeout_s = "
                                                   f"{self.jc.startup_timeout_s} s") from None
        i = self.busy.least_loaded(k for k, p in enumerate(self.procs) if p is not None)
        ep = self.procs[i]
        assert ep is not None
        req = Generate(request_id=f"judge-{seed}", prompt_ids=prompt_ids, max_tokens=max_tokens,
                       temperature=temperature, seed=seed)
        try:
            with self.busy.request(i):
                async with asyncio.timeout(self.jc.timeout_s):
                    return await ep.client.generate(req)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await ep.client.abort([req.request_id])
            raise JudgeEngineFailed("engine_timeout", f"judge engine {i} gave no verdict within judge.timeout_s = "
                                                      f"{self.jc.timeout_s} s") from None
        except PeerDead as e:
            raise JudgeEngineFailed("engine_died", f"judge engine {i} died: {e}") from None
        except RemoteError as e:  # this request alone (the engine answered): asked again, it is refused again
            raise JudgeRefused(f"judge engine {i} refused the verdict request ({len(prompt_ids)} prompt tokens, "
                               f"max_model_len {self.max_model_len}): {e}") from None
        except TransportError as e:
            raise JudgeEngineFailed("engine_error", f"judge engine {i} failed the request: {e}") from None

    async def aclose(self) -> None:
        self._closing = True
        tasks = [*self._starting, *self._watchers.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(p.terminate(timeout=10.0) for p in self.procs if p is not None), return_exceptions=True)
        self.procs = [None] * self.jc.engines
        if self._own_launcher:
            await self.launcher.close()


def _pid(ep: EngineProcess) -> int:
    """The engine's process id on its node (a local Child's, or what a remote launcher's Proc reports)."""
    child = ep.child
    proc = getattr(child, "proc", None)
    return int(proc.pid if proc is not None else getattr(child, "pid", 0))
