"""Any registered environment in a pool of worker processes behind ZeroMQ.

    controller process                                          worker process i (python -m envs.remote)
      RemoteEnv.reset(task) -- pick the live worker with          RpcServer (ROUTER, ipc://)
                               the fewest open sessions              sessions: {session id -> Env}
        RpcClient(i).request(EnvReset) ---------------------------->  suite.make_env(); env.reset(task)
      RemoteEnv.step(action) (same worker: the episode lives there)
        request(EnvStep, timeout=call_timeout_s) ------------------>  env.step(action) -> EnvStepped
                                     <---- EnvObservation / EnvStepped / Error(kind="env:<reason>")
      supervisor task per worker (flashrl.workers.WorkerPool, the pool process rewards use too):
        exit -> every pending call of that worker fails (EnvFailure "crash") -> respawn in the slot

Failure rules (per call; each raises ``EnvFailure`` so the controller retries the rollout elsewhere):
- the worker process dies (any cause)             -> "crash"; the pool starts a replacement.
- a call takes longer than ``call_timeout_s``     -> "timeout"; that worker is killed and replaced
  (every other episode on it is lost and fails "crash": a hung env may have wedged the process).
- the inner env raises EnvFailure(reason)         -> EnvFailure(reason), the worker stays.
- the inner env raises anything else              -> "error", the worker stays.
- an observation fails ``validate_observation``   -> "garbage" (a worker is not trusted blindly).
- the caller cancels a call (its own deadline)    -> the worker is told to cancel that session.
- every worker is down (restarting)               -> a new episode waits for a replacement (the caller's
  turn deadline bounds the wait), rather than failing at once and spinning through its retries.

Configuration: ``env.name = "remote"`` with ``[env.params] inner = "guess", workers = 2,
params = {...}`` (the inner env's own params, including its ``faults`` sub-table, which then act
inside the workers). Tasks come from a copy of the inner suite built in the controller (data only).
Messages are msgspec structs (below); nothing is pickled. Inside a run, workers start through the run's
launcher (``flashrl.launch.active()``: role "env", index = slot; logs in runs/<name>/logs/env<slot>.log;
CURVE keys when cluster.interface is off loopback); used on its own (no run), the pool starts them here
as ``flashrl.procs`` children. Either way each leads its own process group and dies with the controller
(parent-death signal plus a watchdog); call ``RemoteSuite.aclose()`` on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import Meta

from envs.faults import WORKER_ENV_VAR, validate_observation
from flashrl import launch
from flashrl.env import Env, EnvFailure, StepResult, Task
from flashrl.plugins import PluginError, make_suite
from flashrl.procs import Child, child_init
from flashrl.wire.keys import CurveKeys
from flashrl.wire.protocol import Codec, Error, Msg, Ok, Ping, Pong, Shutdown
from flashrl.wire.spec import read_spec_or_exit, spec_env
from flashrl.wire.transport import PeerDead, RemoteError, RpcClient, RpcServer
from flashrl.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `-m envs.remote` from any cwd


# --------------------------------------------------------------------------- messages
class EnvReset(Msg):
    """Start (or restart) episode ``session`` on ``task``; the reply is its first observation."""

    session: int = 0
    task: Task | None = None


class EnvStep(Msg):
    session: int = 0
    action: str = ""


class EnvClose(Msg):
    """End ``session``: cancel its call in progress, if any, and close its env."""

    session: int = 0


class EnvObservation(Msg):
    text: str = ""


class EnvStepped(Msg):
    result: StepResult = msgspec.field(default_factory=StepResult)


WorkerRequest = Union[EnvReset, EnvStep, EnvClose, Ping, Shutdown]
WorkerReply = Union[EnvObservation, EnvStepped, Ok, Pong, Error]
WORKER_REQUESTS = Codec(WorkerRequest, "env worker request")
WORKER_REPLIES = Codec(WorkerReply, "env worker reply")


# --------------------------------------------------------------------------- params
class RemoteParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[env.params]`` of ``env.name = "remote"``."""

    inner: Annotated[str, Meta(min_length=1, description="the environment the workers run (any env.name)")]
    params: Annotated[dict[str, Any], Meta(description="the inner environment's [env.params]")] = {}
    workers: Annotated[int, Meta(ge=1, le=256, description="worker processes")] = 2
    call_timeout_s: Annotated[float, Meta(gt=0, description="deadline of one reset/step; past it the worker is replaced")] = 30.0
    startup_timeout_s: Annotated[float, Meta(gt=0, description="seconds a new worker has to answer its first ping")] = 60.0
    max_obs_chars: Annotated[int, Meta(ge=1, description="longest observation accepted from a worker")] = 4096


class EnvWorkerSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one worker process is started with (JSON in ``FLASHRL_SPEC``, flashrl/wire/spec.py)."""

    address: Annotated[str, Meta(min_length=1, description="ZeroMQ address the worker binds")]
    inner: Annotated[str, Meta(min_length=1, description="the environment the worker runs (any env.name)")]
    params: Annotated[dict[str, Any], Meta(description="the inner environment's [env.params]")] = {}
    seed: int = 0
    eval_size: Annotated[int, Meta(ge=0)] = 200


INNER_KEY, INNER_PARAMS = "env.params.inner", "env.params.params"  # where the wrapped env is written
WORKER_ARGV = ["python", "-m", "envs.remote"]  # for ``Launcher.spawn``; the spec travels in the environment


# --------------------------------------------------------------------------- controller side
class RemotePool:
    """The env worker processes: a flashrl.workers.WorkerPool (every slot started up front, supervised,
    replaced at once when it exits; many sessions per worker, the least loaded first) whose workers
    are reached through an RpcClient each."""

    def __init__(self, params: RemoteParams, seed: int, eval_size: int) -> None:
        self.params = params
        self.seed = seed
        self.eval_size = eval_size
        self._sessions = itertools.count(1)
        self._dir = tempfile.mkdtemp(prefix="flashrl-envpool-")
        self.workers: WorkerPool[RpcClient] = WorkerPool(
            "env worker", params.workers, start=self._spawn, ready=self._ping, on_exit=self._exited,
            failure=EnvFailure, eager=True, startup_timeout_s=params.startup_timeout_s, wait_restarts=True)
        # Live workers; each Child SIGKILLs its group if dropped unstopped. The finalizer removes the folder.
        self._children: set[launch.Proc] = set()
        self._finalizer = weakref.finalize(self, _kill_all, self._children, self._dir)

    @property
    def counters(self) -> Counter[str]:
        """spawned, exits, restarts, killed:<reason> (the pool's) and rejected:<reason> (observations)."""
        return self.workers.counters

    @property
    def pids(self) -> list[int]:
        """Process ids of the current local workers (slot order; tests kill them on purpose)."""
        return [w.proc.pid for w in self.workers.workers() if isinstance(w.proc, Child)]

    async def start(self) -> None:
        await self.workers.start()

    async def _spawn(self, slot: int, gen: int) -> tuple[launch.Proc, RpcClient]:
        run = launch.active()
        if run is None:  # no run around this pool: ipc:// in its own folder
            bind = connect = f"ipc://{self._dir}/w{slot}-{gen}.sock"
        else:
            ep = await run.launcher.endpoint("env", slot)
            bind, connect = ep.bind, ep.connect
        spec = EnvWorkerSpec(address=bind, inner=self.params.inner, params=self.params.params, seed=self.seed,
                             eval_size=self.eval_size)
        path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        extra = {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), WORKER_ENV_VAR: "1",
                 **spec_env(spec)}
        child: launch.Proc
        curve = None
        if run is None:
            child = Child.spawn(f"env worker {slot}.{gen}", [sys.executable, *WORKER_ARGV[1:]], None,
                                env=dict(os.environ, **extra))
        else:
            child = await run.launcher.spawn("env", slot, WORKER_ARGV, extra, run.logs / f"env{slot}.log")
            curve = run.launcher.curve.client() if run.launcher.curve is not None else None
        self._children.add(child)
        return child, RpcClient(connect, WORKER_REPLIES, name=f"env-worker-{slot}.{gen}", curve=curve)

    async def _ping(self, client: RpcClient) -> None:
        await client.request(Ping(), timeout=self.params.startup_timeout_s)

    async def _exited(self, w: Worker[RpcClient]) -> None:
        child: launch.Proc = w.proc  # type: ignore[assignment]  # what _spawn returned
        await child.reap_group()  # anything the worker started (e.g. sandboxed code) goes with it
        self._children.discard(child)
        await w.handle.close()  # pending calls get PeerDead -> EnvFailure("crash")

    async def acquire(self) -> Worker[RpcClient]:
        """The ready worker with the fewest open sessions (waits for one that is starting)."""
        return await self.workers.acquire()

    def release(self, w: Worker[RpcClient]) -> None:
        self.workers.release(w)

    def kill(self, w: Worker[RpcClient], reason: str) -> None:
        """Kill ``w``'s process (counted as killed:<reason>); the pool replaces it."""
        self.workers.kill(w, reason)

    def new_session(self) -> int:
        return next(self._sessions)

    def background(self, coro: Any) -> None:
        self.workers.background(coro)

    async def aclose(self) -> None:
        """Kill every worker and wait for them; idempotent."""
        await self.workers.aclose()
        self._finalizer()


def _kill_all(children: set[launch.Proc], path: str) -> None:
    for child in list(children):
        child.kill()
    shutil.rmtree(path, ignore_errors=True)


class RemoteEnv:
    """An Env whose episode runs in a pool worker; every failure surfaces as EnvFailure."""

    def __init__(self, pool: RemotePool) -> None:
        self.pool = pool
        self.worker: Worker[RpcClient] | None = None
        self.generation = -1
        self.session = 0

    async def _call(self, msg: Msg) -> Msg:
        w = self.worker
        if w is None:
            raise RuntimeError("remote env: step() before reset()")
        if not w.alive or w.generation != self.generation:
            raise EnvFailure("crash", f"env worker {w.slot} was replaced; the episode is lost")
        try:
            return await w.handle.request(msg, timeout=self.pool.params.call_timeout_s)
        except TimeoutError:
            self.pool.kill(w, "timeout")
            raise EnvFailure("timeout", f"env worker {w.slot} took over {self.pool.params.call_timeout_s:g}s; replaced") from None
        except PeerDead as e:
            raise EnvFailure("crash", f"env worker {w.slot} died: {e}") from None
        except RemoteError as e:
            reason = e.kind[4:] if e.kind.startswith("env:") else "error"
            raise EnvFailure(reason, str(e)) from None
        except asyncio.CancelledError:
            # The caller's own deadline: tell the worker to stop this session's call.
            self.pool.background(_quiet(w.handle.request(EnvClose(session=self.session), timeout=5.0)))
            raise

    def _valid(self, text: str) -> str:
        reason = validate_observation(text, self.pool.params.max_obs_chars)
        if reason is not None:
            self.pool.counters[f"rejected:{reason}"] += 1
            raise EnvFailure("garbage", f"observation from env worker rejected: {reason}")
        return text

    async def reset(self, task: Task) -> str:
        await self._release()
        w = await self.pool.acquire()
        self.worker, self.generation, self.session = w, w.generation, self.pool.new_session()
        reply = await self._call(EnvReset(session=self.session, task=task))
        if not isinstance(reply, EnvObservation):
            raise EnvFailure("garbage", f"env worker answered reset with {type(reply).__name__}")
        return self._valid(reply.text)

    async def step(self, action: str) -> StepResult:
        reply = await self._call(EnvStep(session=self.session, action=action))
        if not isinstance(reply, EnvStepped):
            raise EnvFailure("garbage", f"env worker answered step with {type(reply).__name__}")
        if not reply.result.done:
            self._valid(reply.result.observation)
        return reply.result

    async def _release(self) -> None:
        w, self.worker = self.worker, None
        if w is None:
            return
        self.pool.release(w)
        if w.alive and w.generation == self.generation:
            await _quiet(w.handle.request(EnvClose(session=self.session), timeout=5.0))

    async def close(self) -> None:
        await self._release()


async def _quiet(aw: Any) -> None:
    with contextlib.suppress(Exception):
        await aw


class RemoteSuite:
    """``env.name = "remote"``: the inner suite's tasks; episodes run in the worker pool."""

    Params: ClassVar[type] = RemoteParams

    def __init__(self, params: RemoteParams, seed: int = 0, eval_size: int = 200) -> None:
        self.params = params
        # data + early errors, named by their full path under the remote wrapper: a name that does not load
        # as env.params.inner, a bad inner param as env.params.params.<key>
        try:
            self.local = make_suite(params.inner, dict(params.params), seed, eval_size, key=INNER_KEY,
                                    prefix=INNER_PARAMS)
        except ValueError as e:  # the inner suite's own checks name their keys as env.params.<key>
            msg = str(e)
            if msg.startswith((INNER_KEY, INNER_PARAMS)):
                raise
            raise PluginError(msg.replace("env.params", INNER_PARAMS)) from None
        self.pool = RemotePool(params, seed, eval_size)

    @staticmethod
    def wrapped_env(params: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
        """(env name, its params, the key that names it) of the wrapped environment, from ``[env.params]``
        as written: what the built-in model's warm-start, its cache key and ``flashrl validate`` look at
        (flashrl.plugins.task_env)."""
        return str(params.get("inner", "")), dict(params.get("params", {})), INNER_KEY

    @property
    def task_suite(self) -> Any:
        """The wrapped suite, in this process: what the built-in model's warm-start learns from."""
        return self.local

    @property
    def counters(self) -> Counter[str]:
        return self.pool.counters

    def train_tasks(self) -> Sequence[Task]:
        return self.local.train_tasks()

    def eval_tasks(self) -> Sequence[Task]:
        return self.local.eval_tasks()

    def make_env(self) -> Env:
        return RemoteEnv(self.pool)

    async def aclose(self) -> None:
        await self.pool.aclose()


# --------------------------------------------------------------------------- worker side
class _WorkerState:
    def __init__(self, suite: Any) -> None:
        self.suite = suite
        self.sessions: dict[int, Env] = {}
        self.running: dict[int, asyncio.Task[Any]] = {}
        self.stop = asyncio.Event()

    async def _guard(self, session: int, aw: Any) -> Any:
        """Run one env call as a task EnvClose can cancel; EnvFailure -> Error(kind="env:<reason>")."""
        task = asyncio.ensure_future(aw)
        self.running[session] = task
        try:
            return await task
        finally:
            if self.running.get(session) is task:
                del self.running[session]

    async def handle(self, msg: Msg) -> Msg | None:
        try:
            if isinstance(msg, Ping):
                return Pong()
            if isinstance(msg, EnvReset):
                if msg.task is None:
                    return Error(message="EnvReset without a task", kind="env:garbage")
                await self._drop(msg.session)
                env = self.sessions[msg.session] = self.suite.make_env()
                return EnvObservation(text=await self._guard(msg.session, env.reset(msg.task)))
            if isinstance(msg, EnvStep):
                env = self.sessions.get(msg.session)
                if env is None:
                    return Error(message=f"unknown session {msg.session}", kind="env:crash")
                return EnvStepped(result=await self._guard(msg.session, env.step(msg.action)))
            if isinstance(msg, EnvClose):
                await self._drop(msg.session)
                return Ok()
            if isinstance(msg, Shutdown):
                self.stop.set()
                return Ok()
        except EnvFailure as e:
            return Error(message=e.detail or e.reason, kind=f"env:{e.reason}")
        return Error(message=f"unexpected {type(msg).__name__}")

    async def _drop(self, session: int) -> None:
        task = self.running.pop(session, None)
        if task is not None:
            task.cancel()
        env = self.sessions.pop(session, None)
        if env is not None:
            with contextlib.suppress(Exception):
                await env.close()


async def _worker_main(spec: EnvWorkerSpec) -> None:
    suite = make_suite(spec.inner, spec.params, spec.seed, spec.eval_size)
    state = _WorkerState(suite)
    keys = CurveKeys.from_env()  # set by the run's launcher when sockets are off loopback
    server = RpcServer(spec.address, WORKER_REQUESTS, state.handle, name=f"env-worker({spec.inner})",
                       curve=keys.server() if keys is not None else None)
    serve = asyncio.get_running_loop().create_task(server.serve())
    await state.stop.wait()
    serve.cancel()
    with contextlib.suppress(BaseException):
        await serve


def main() -> int:
    """``python -m envs.remote``: one worker, its EnvWorkerSpec in FLASHRL_SPEC (RemotePool sets it)."""
    spec = read_spec_or_exit(EnvWorkerSpec, who="python -m envs.remote", label="env worker")
    child_init(f"env worker ({spec.inner})")  # dies with the controller, and takes its own children along
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s env-worker %(levelname)s %(message)s")
    asyncio.run(_worker_main(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
