"""vLLM's LLMEngine (its EngineCore and model in this process) stepped by one thread, for asyncio callers.

    asyncio (engine server)                      engine thread (the only one touching vLLM)
      generate(key, prompt, params) --command-->  llm.add_request
      abort / pause / resume        --command-->  applied between two steps
      call(fn)                      --command-->  fn(llm) between two steps (weight load, version label)
      beside(fn)                    --a thread of its own, while the engine thread steps on-->  fn(llm)
                                                  (only what touches none of vLLM's state: the weight receive)
                                                  llm.step() while anything is unfinished and not paused
      futures resolved  <--call_soon_threadsafe--  finished RequestOutputs, once per step

Why not vLLM's AsyncLLM: AsyncLLM runs its EngineCore in a process of its own and moves every request
and every step's outputs across a socket between the two. For RL rollouts (many short requests, token
ids in and out, no detokenizing) that hop is most of the engine's cost: 128 samples of 4 tokens on the
built-in model took 71 ms and 96 ms of CPU through AsyncLLM vs 51 ms and 56 ms of CPU through LLMEngine
in-process, and the spawned EngineCore re-imports torch and vLLM at start-up (ready 10.1 s vs 3.7 s;
bench/engine_inproc.py, bench/results/engine/inproc.md). The EngineCore's busy loop is replaced by ``_run`` below, which does the
same thing: take in what arrived, step while there is work, hand finished outputs back.

Commands run between steps on the engine thread, so a command never sees a half-done step: a pause
takes effect before the next step, and ``call(fn)`` (the weight load) runs while nothing generates.
A step that raises ends the thread: every waiting request and every later call fails with ``EngineDead``
and the server exits (a dead EngineCore was the same under AsyncLLM).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

log = logging.getLogger("flashrl.engine")

IDLE_POLL_S = 0.5  # how often an idle engine thread looks at its stop flag


class EngineDead(RuntimeError):
    """The engine thread has stopped (a vLLM step raised, or the engine was shut down)."""


class InprocEngine:
    """An ``LLMEngine`` driven by a thread of its own; methods are called from the event loop's thread."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop, name: str = "engine") -> None:
        self.llm = llm
        self._loop = loop
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._waiting: dict[str, asyncio.Future[Any]] = {}  # vLLM request id (unique) -> its future
        self._by_external: dict[str, set[str]] = {}  # the caller's request id -> vLLM request ids
        # MoE route capture (flashrl/moe/capture.py), switched on by the server: each request's routes, taken from
        # the worker on the engine thread right after the step that finished (or the abort that ended) it
        self.route_capture = False
        self._internal: dict[str, list[str]] = {}  # (engine thread) our key -> vLLM's internal request ids
        self.routes: dict[str, bytes] = {}  # our key -> its packed routes, until the caller pops them
        # Engine-thread state (only that thread reads or writes these once it runs).
        self._paused = False
        self._halted = False  # never step again (weights half-loaded): set by halt()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._calls: set[asyncio.Future[Any]] = set()  # futures of commands in flight (failed if the thread dies)
        self.error: BaseException | None = None
        # Engine-thread accounting (written by the thread, read for the log): time inside vLLM's step()
        # and inside commands, from the first command on.
        self.started_at: float | None = None
        self.step_s = 0.0
        self.command_s = 0.0
        self.steps = 0
        self._mark: tuple[float, float, float] | None = None  # occupancy(): (time, step_s, command_s) last read
        self._thread = threading.Thread(target=self._run, name=f"{name}-vllm", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio side
    @property
    def errored(self) -> bool:
        return self.error is not None or not self._thread.is_alive()

    def _dead(self) -> EngineDead:
        return EngineDead(f"the vLLM engine thread has stopped: {self.error!r}" if self.error else
                          "the vLLM engine thread has stopped")

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.errored:
            raise self._dead()
        self._cmds.put(fn)

    async def generate(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> Any:
        """Add one request; return its final ``RequestOutput`` (finish_reason "abort" when aborted).
        ``lora_request``: vLLM's LoRARequest of the adapter to serve it with (engine/lora.py), None: the base."""
        key = f"{request_id}#{next(self._seq)}"  # unique even when a caller reuses an id
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._waiting[key] = fut
        self._by_external.setdefault(request_id, set()).add(key)

        def add() -> None:
            try:
                if lora_request is None:
                    self.llm.add_request(key, prompt, params)
                else:
                    self.llm.add_request(key, prompt, params, lora_request=lora_request)
                if self.route_capture:
                    self._internal[key] = list(self.llm.output_processor.external_req_ids.get(key, ()))
            except Exception as e:  # a bad request fails alone
                self._post(self._fail_one, key, e)

        try:
            self._submit(add)
            return await fut
        finally:
            self._waiting.pop(key, None)
            keys = self._by_external.get(request_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_external[request_id]

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests by the caller's ids; each answers with the tokens it had (finish_reason "abort")."""
        keys = [k for rid in request_ids for k in self._by_external.get(rid, ())]
        if keys:
            await self.call(lambda llm: self._abort_keys(keys))

    async def pause(self, mode: Literal["keep", "abort", "wait"] = "keep") -> None:
        """keep: stop stepping (requests resume later); abort: abort everything, then stop; wait: go on
        stepping until nothing is in flight, then stop."""
        if mode == "wait":
            fut: asyncio.Future[None] = self._loop.create_future()

            def drain() -> None:
                self._paused = True  # stepping goes on until drained: see _run
                self._drain_waiters.append(fut)

            await self._await(fut, drain)
            return

        def stop() -> None:
            if mode == "abort":
                self._abort_keys(None)
            self._paused = True

        await self.call(lambda llm: stop())

    async def resume(self) -> None:
        def go() -> None:
            self._paused = False

        await self.call(lambda llm: go())

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(llm)`` on the engine thread between two steps; return its result (or raise its error)."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        return await self._await(fut, self._resolving(fn, fut))

    async def beside(self, fn: Callable[[Any], Any], name: str = "beside") -> Any:
        """Run ``fn(llm)`` on a daemon thread of its own while the engine thread steps on; return its result.

        Only for work that reads or writes none of vLLM's scheduling, request or model state (the weight
        sync's receive into fresh buffers): the engine thread is not stopped for it. A daemon thread, so a
        ``fn`` blocked on a dead peer never holds up the process's exit."""
        if self.errored:
            raise self._dead()
        fut: asyncio.Future[Any] = self._loop.create_future()
        threading.Thread(target=self._resolving(fn, fut), name=f"{self._thread.name}-{name}", daemon=True).start()
        return await fut

    def _resolving(self, fn: Callable[[Any], Any], fut: asyncio.Future[Any]) -> Callable[[], None]:
        """``fn(llm)`` as a callable for another thread that hands its result (or error) to ``fut`` on the loop."""
        def run() -> None:
            try:
                result = fn(self.llm)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._post(_set_exception, fut, e)
            else:
                self._post(_set_result, fut, result)

        return run

    async def _await(self, fut: asyncio.Future[Any], cmd: Callable[[], None]) -> Any:
        self._calls.add(fut)
        try:
            self._submit(cmd)
            return await fut
        finally:
            self._calls.discard(fut)

    def unpause(self) -> None:
        """From the engine thread (inside ``call``): step again after this call, as after ``resume``."""
        self._paused = False

    def utilization(self) -> str:
        """How busy the engine thread was since its first command (stepping, and running commands)."""
        if self.started_at is None:
            return "no request"
        span = max(time.perf_counter() - self.started_at, 1e-9)
        return (f"stepping {self.step_s / span:.0%} of {span:.0f}s ({self.steps} steps, "
                f"{1000 * self.step_s / max(self.steps, 1):.1f} ms each), commands {self.command_s / span:.0%}")

    def occupancy(self) -> dict[str, float]:
        """Fractions of the wall time since the previous call (the first call: since the first command)
        the engine thread spent stepping vLLM ("stepping") and running commands ("commands": adding
        requests, aborts, the weight sync's receive and load); {} before the first command. Exact when
        called on the engine thread (inside ``call``); a command running meanwhile counts in the next reading."""
        now, step_s, command_s = time.perf_counter(), self.step_s, self.command_s
        if self.started_at is None:
            return {}
        t0, step0, command0 = self._mark if self._mark is not None else (self.started_at, 0.0, 0.0)
        self._mark = (now, step_s, command_s)
        span = max(now - t0, 1e-9)
        return {"stepping": min(1.0, (step_s - step0) / span), "commands": min(1.0, (command_s - command0) / span)}

    def halt(self) -> None:
        """From the engine thread (inside ``call``): never step again. The model may hold half-loaded weights."""
        self._halted = True

    def shutdown(self, timeout_s: float = 10.0, release: bool = True) -> None:
        """Stop the thread (after its current step) and shut vLLM's EngineCore down.

        ``release=False`` when the process ends right after (the engine server, ``procs.exit_now``): vLLM's
        teardown frees memory for an engine built again in the same process, by unfreezing every object
        and running two full collections (~1.2 s on the 2-core machine); the kernel frees that anyway, so
        only vLLM's distributed state is torn down (its process groups; the file its store keeps in /tmp).
        """
        self._cmds.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the vLLM engine thread did not stop within %.0fs", timeout_s)
            return
        if not release:
            # Only what would outlive the process: vLLM's distributed state (its FileStore's file in /tmp).
            from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
            return
        shutdown = getattr(self.llm.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------------ engine thread
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                busy = not self._halted and llm.has_unfinished_requests()
                stepping = busy and (not self._paused or bool(self._drain_waiters))
                cmds: list[Callable[[], None] | None] = []
                try:
                    cmds.append(self._cmds.get_nowait() if stepping else self._cmds.get(timeout=IDLE_POLL_S))
                    while True:
                        cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                t_cmd = time.perf_counter()
                if cmds and self.started_at is None:
                    self.started_at = t_cmd
                for cmd in cmds:
                    if cmd is None:
                        return
                    cmd()
                    t_step = time.perf_counter()
                    self.command_s += t_step - t_cmd  # per command: occupancy() may run inside the next one
                    t_cmd = t_step
                t_step = time.perf_counter()
                if self._halted:
                    continue
                if not llm.has_unfinished_requests():
                    if self._drain_waiters:  # a "wait" pause: drained now
                        waiters, self._drain_waiters = self._drain_waiters, []
                        for fut in waiters:
                            self._post(_set_result, fut, None)
                    continue
                if self._paused and not self._drain_waiters:
                    continue
                outs = llm.step()
                self.step_s += time.perf_counter() - t_step
                self.steps += 1
                done = [o for o in outs if o.finished]
                if done:
                    if self.route_capture:
                        self._take_routes([o.request_id for o in done])
                    self._post(self._deliver, done)
        except BaseException as e:  # noqa: BLE001 - a dead engine is reported, not swallowed
            log.exception("vLLM engine step failed")
            self.error = e
            self._post(self._fail_all)

    def _abort_keys(self, keys: list[str] | None) -> None:
        """Engine thread: abort ``keys`` (None: every unfinished request) and answer each with what it had."""
        from vllm.v1.engine import FinishReason

        proc = self.llm.output_processor
        if keys is None:
            keys = list(proc.external_req_ids)
        answers = []
        for key in keys:
            for internal in list(proc.external_req_ids.get(key, ())):
                state = proc.request_states.get(internal)
                if state is not None:
                    out = state.make_request_output([], None, FinishReason.ABORT, None)
                    if out is not None:
                        answers.append(out)
        if self.route_capture and answers:
            self._take_routes([o.request_id for o in answers])
        self.llm.abort_request(keys)
        # A request with no state left had finished: its answer is already on its way.
        if answers:
            self._post(self._deliver, answers)

    def _take_routes(self, keys: list[str]) -> None:
        """Engine thread: the routes of the finished requests ``keys`` out of the worker (one collective_rpc,
        a direct call in this process), kept in ``routes`` for the caller; before their outputs are delivered."""
        internal = {k: self._internal.pop(k, []) for k in keys}
        got = self.llm.collective_rpc("flashrl_take_routes", args=([i for ids in internal.values() for i in ids],))[0]
        for k, ids in internal.items():
            self.routes[k] = b"".join(got.get(i, b"") for i in ids)

    # ------------------------------------------------------------------ back on the event loop
    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            fut = self._waiting.get(out.request_id)
            if fut is not None and not fut.done():
                fut.set_result(out)

    def _fail_one(self, key: str, error: BaseException) -> None:
        fut = self._waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def _fail_all(self) -> None:
        dead = self._dead()
        for fut in [*self._waiting.values(), *self._calls]:
            if not fut.done():
                fut.set_exception(dead)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
