"""Rollout coroutines: one trajectory (generic multi-turn), one sample with retries, one group.

    run_group(uid, need, extra)                       one asyncio task per rollout; each reports its
      ├─ run_sample(index k) x (need + extra) ──┐     result to the group's tally as it finishes:
      │    retry loop (infra failures, stale)   │     first ``need`` ok samples -> on_sample() at once
      │      run_trajectory(engine i, attempt)  │     then the group cancels the rest: each cancelled
      └────── _GroupState.finish(traj) <────────┘     generate sends engine.abort([request_id])
                                                      unfillable (ok + still running < need) -> False

    run_trajectory:  env.reset(task) -> encode once -> ┌> [permit] engine.generate [/permit]
                                                       │   decode -> env.step(action)  (turn deadline)
                                                       └── not done, turns < max_turns, room left:
                                                           append generated ids (mask 1) + obs ids (mask 0)

A rollout stays on the engine it was routed to for all its turns (its prefix stays in that
engine's cache) and moves only when retried. Token ids are concatenated turn after turn; nothing
is re-tokenized from text. Generated tokens keep the engine's logprob and per-token policy
version; observation tokens get mask 0, logprob 0.0, version -1.

Engine concurrency model (``rollout.env_async``): every engine has ``engine.max_num_seqs`` permits
(scheduler.Router.slot). With env_async = true a rollout holds a permit only inside
engine.generate, so while it waits on its environment the engine serves another rollout. With
env_async = false it takes the permit before env.reset and keeps it until the trajectory ends:
the engine slot idles while the environment steps, as in a loop that calls a blocking env.

Failure tiers, each counted under its own name (nothing is lost silently):
  infrastructure, retried up to rollout.max_retries, re-routed to the least-loaded live engine:
      EnvFailure(reason)         -> rollout/retry_env_<reason>
      env call past turn_timeout -> rollout/retry_env_timeout
      transport.PeerDead         -> rollout/retry_engine_dead (the engine is marked dead first)
  the rollout itself, not retried:
      trajectory past rollout.trajectory_timeout_s -> rollout/failed_trajectory_timeout
      transport.RemoteError (engine refused the request) -> rollout/failed_engine_error
      prompt longer than model.max_model_len              -> rollout/failed_prompt_too_long
  retries exhausted -> rollout/failed_<reason>. Any other exception is a bug and crashes the run.

Stale early abort (``RolloutContext.staleness`` set, training rollouts only): once a
multi-turn trajectory knows the version of its first generated token (its first generate came
back and the env asked for another turn), it is watched; when that version can no longer pass
the staleness bound at any step still to come (``staleness.doomed(version_start)``: the rule of
flashrl/core/staleness.py that buffer.take_batch applies), the trajectory is cancelled at once (its engine request aborted, its env closed), counted
``rollout/aborted_stale``, and the sample restarts on fresh weights (not charged to
rollout.max_retries). Why only then: before the first generate returns, the controller knows only
a lower bound on the first token's version (its own version at dispatch: every live engine had
loaded it before it was published), and staleness needs an upper bound; a single-turn sample is
done by the time its versions are known, so the buffer's check catches it at no extra cost.
Restarts converge: a restart's first token is at least the controller's version V when it starts,
and staleness.next_step <= V + 1, so it is doomed again at once only with async_ratio = 0, where no
training sample generates while a batch trains (capacity = batch_prompts: every group is in it).

Cost (the controller must push >= 20K samples per CPU second through this path): plain asyncio,
no anyio cancel scopes per sample. One task per rollout and nothing else: no per-sample streams,
no helper tasks. Cancellation is asyncio's own (``Task.cancel`` / ``uncancel`` counting, as
``asyncio.timeout`` does), so the three causes stay apart: a stale abort (``_Attempt``), the
trajectory deadline (``asyncio.timeout``), and the caller's cancel (redundancy, shutdown), which
always propagates. An env call or cleanup (env.close, engine.abort) is first run to its first
suspension inline: one that completes at once (the common case) costs no timer and no task; one
that suspends then gets its deadline (turn_timeout_s) or its shielded, bounded wait.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import types
from collections import Counter
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from envs.base import EnvFailure, EnvSuite, StepResult, Task
from flashrl.config import Config
from flashrl.controller.scheduler import BusyMeter, Router, request_seed, sample_id
from flashrl.core.staleness import Staleness
from flashrl.interfaces import EngineClient
from flashrl.metrics import RateMeter
from flashrl.protocol import Generate, Generated, TrainSample
from flashrl.transport import PeerDead, RemoteError

__all__ = ["RolloutContext", "RolloutSpec", "Trajectory", "run_group", "run_sample", "run_trajectory"]

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on telling an engine to drop a request nobody will read
ENV_CLOSE_TIMEOUT_S = 5.0


class Trajectory(msgspec.Struct, kw_only=True):
    """One rollout as the controller keeps it: token ids, per-token data, outcome and timings."""

    sample_id: str
    group: int  # prompt uid (admission index); eval rollouts use -1 - task position
    index: int  # sample index inside the group (seeds, ordering)
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    loss_mask: list[int] = []
    behav_logp: list[float] = []
    versions: list[int] = []
    reward: float = 0.0
    correct: bool = False  # StepResult.info["correct"] when the env says, else reward >= 1
    finish_reason: str = ""  # engine's "stop"/"length", or "max_turns", "max_model_len"
    turns: int = 0
    status: Literal["ok", "failed"] = "ok"
    failure: str = ""  # counter name of the failure when status == "failed"
    engine: str = ""
    attempts: int = 1
    version_sent: int = 0  # controller version when the last attempt began
    t_start: float = 0.0
    t_end: float = 0.0
    gen_s: float = 0.0  # inside engine.generate
    env_s: float = 0.0  # inside env.reset / env.step
    wait_s: float = 0.0  # waiting for an engine permit
    task_id: str = ""
    metrics: dict[str, float] = {}  # StepResult.info["metrics"] (e.g. a reward function's extras), last value per key

    @property
    def version_start(self) -> int:
        """Version of the first generated token (the staleness bound is on this)."""
        for m, v in zip(self.loss_mask, self.versions):
            if m:
                return v
        return self.version_sent

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)

    def to_train_sample(self) -> TrainSample:
        return TrainSample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            behav_logp=self.behav_logp,
            versions=self.versions,
            reward=self.reward,
            group=self.group,
            sample_id=self.sample_id,
        )


class RolloutSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to roll out: the task, the group and index (ids, seeds), the sampling temperature."""

    task: Task
    group: int
    index: int
    temperature: float
    seed_key: tuple[int, int]  # (prompt uid, sample index) for training; (-1 - k, version) for eval
    sample_id: str = ""


@dataclass(eq=False)
class RolloutContext:
    """Everything a rollout needs, shared by all of them (single event loop: no locks)."""

    cfg: Config
    tokenizer: Any  # encode(text) -> list[int], decode(ids) -> str, eos_token_id
    suite: EnvSuite
    engines: Sequence[EngineClient]
    router: Router
    version: Callable[[], int]
    counters: Counter[str] = field(default_factory=Counter)
    live: dict[str, int] = field(default_factory=dict)  # request id -> engine, while generating
    generated_tokens: list[int] = field(default_factory=list)  # per engine, for rates
    # per engine: time with >= 1 generate in flight (the controller replaces these at run start)
    busy: list[BusyMeter] = field(default_factory=list)
    token_rates: list[RateMeter] = field(default_factory=list)  # per engine; empty: not metered
    # the run's staleness rule (shared with the buffer, which advances its next_step); None turns
    # the stale early abort off
    staleness: Staleness | None = None
    # trajectories watched for staleness: "<sample id>.<attempt>" -> (version_start, what cancels it:
    # an object with ``cancel()`` and ``cancel_called``)
    watched: dict[str, tuple[int, Any]] = field(default_factory=dict)
    # trajectory deadlines of the attempts in flight (rollout.trajectory_timeout_s)
    deadlines: _Deadlines = field(default_factory=lambda: _Deadlines())

    def __post_init__(self) -> None:
        if not self.generated_tokens:
            self.generated_tokens = [0] * len(self.engines)
        if not self.busy:
            self.busy = [BusyMeter() for _ in self.engines]

    def abort_stale(self) -> int:
        """Cancel every watched trajectory that became too stale to train; return how many.

        The controller calls this whenever ``staleness.next_step`` grows (a batch was taken).
        """
        rule = self.staleness
        if rule is None:
            return 0
        n = 0
        for version_start, scope in self.watched.values():
            if not scope.cancel_called and rule.doomed(version_start):
                scope.cancel()
                n += 1
        return n


class _Expiry:
    """The trajectory deadline of one attempt running in ``task`` (see ``_Deadlines``)."""

    __slots__ = ("task", "when", "expired", "over")

    def __init__(self, task: asyncio.Task[Any], when: float) -> None:
        self.task: asyncio.Task[Any] | None = task
        self.when = when
        self.expired = False  # the deadline passed and the task was cancelled for it
        self.over = False  # the attempt ended: nothing to cancel any more


class _Deadlines:
    """Trajectory deadlines, all ``trajectory_timeout_s`` long: they expire in the order they began.

    One loop timer for the earliest pending one instead of an ``asyncio.timeout`` (a timer handle,
    a heap push and a cancel) per attempt. An attempt that ended is skipped when its turn comes;
    ended ones at the front are also dropped whenever a new one is added, so the queue holds about
    the attempts in flight.
    """

    def __init__(self) -> None:
        self._q: collections.deque[_Expiry] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], seconds: float) -> _Expiry:
        if loop is not self._loop:  # a context reused on another loop: the old timer is gone with it
            self._q.clear()
            self._timer = None
            self._loop = loop
        e = _Expiry(task, loop.time() + seconds)
        q = self._q
        while q and q[0].over:
            q.popleft()
        q.append(e)
        if self._timer is None:
            self._timer = loop.call_at(e.when, self._fire)
        return e

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        q = self._q
        while q:
            e = q[0]
            if e.over:
                q.popleft()
            elif e.when > now:
                self._timer = loop.call_at(e.when, self._fire)
                return
            else:
                q.popleft()
                e.expired = True
                assert e.task is not None
                e.task.cancel()


def _correct(res: StepResult, reward: float) -> bool:
    if "correct" in res.info:
        return bool(res.info["correct"])
    return reward >= 1.0


# --------------------------------------------------------------------------- cheap awaiting helpers
class _Resume:
    """Awaitable that goes on with a coroutine already run to its first suspension.

    ``first`` is what the coroutine yielded there (the future it waits on). Exactly what
    ``await coro`` does after its first step: values sent and exceptions thrown (a cancel) go on
    into the coroutine.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, y = self._coro, self._first
        while True:
            try:
                sent = yield y
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - delivered into the coroutine, as ``await`` does
                try:
                    y = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    y = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _drive(aw: Any) -> Any:
    return await aw


def _coro(call: Any) -> Coroutine[Any, Any, Any]:
    """``call`` as a coroutine that can be stepped by hand (an env or engine method may return any awaitable)."""
    return call if type(call) is types.CoroutineType else _drive(call)


def _timeout_s(seconds: float) -> float | None:
    return seconds if math.isfinite(seconds) else None


async def _shielded(coro: Coroutine[Any, Any, Any], seconds: float) -> bool:
    """Run cleanup ``coro`` to its end, even if this task is cancelled meanwhile, for at most ``seconds``.

    Returns False when it was given up on (timed out: it is cancelled). A cancel of this task that
    came meanwhile is raised once the cleanup is over; the cleanup's own error is raised.
    """
    coro = _coro(coro)
    try:
        y = coro.send(None)
    except StopIteration:
        return True  # finished at once: no task, no timer
    loop = asyncio.get_running_loop()
    task = loop.create_task(_drive(_Resume(coro, y)))
    deadline = loop.time() + seconds
    cancelled = False
    gave_up = False
    while not task.done():
        left = deadline - loop.time()
        if left <= 0 and not gave_up:
            gave_up = True
            task.cancel()
        try:
            await asyncio.wait((task,), timeout=None if gave_up else left)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    if not task.cancelled():
        err = task.exception()
        if err is not None:
            raise err
    return not gave_up


class _Attempt:
    """One attempt of one rollout, running in ``task``: what ``RolloutContext.abort_stale`` cancels."""

    __slots__ = ("task", "cancel_called", "key")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.cancel_called = False
        self.key = ""  # its key in RolloutContext.watched once watched

    def cancel(self) -> None:
        if not self.cancel_called:
            self.cancel_called = True
            self.task.cancel()


# --------------------------------------------------------------------------- one trajectory
def _env_now(ctx: RolloutContext, call: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run an env call up to its first suspension: (True, its result) or (False, what it yielded).

    A call that completes here takes no loop time, so it cannot miss its deadline: the timer of
    turn_timeout_s is armed (``_env_rest``) only for a call that suspends. ``call`` must be the
    coroutine ``_env_rest`` then goes on with (see ``_coro``).
    """
    try:
        return False, call.send(None)
    except StopIteration as stop:
        return True, stop.value
    except TimeoutError:
        raise _env_timeout(ctx) from None


async def _env_rest(ctx: RolloutContext, traj: Trajectory, call: Coroutine[Any, Any, Any], first: Any) -> Any:
    """The rest of an env call that suspended, bounded by rollout.turn_timeout_s."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    limit = _timeout_s(ctx.cfg.rollout.turn_timeout_s)
    try:
        if limit is None:
            return await _Resume(call, first)
        async with asyncio.timeout(limit):
            return await _Resume(call, first)
    except TimeoutError:
        raise _env_timeout(ctx) from None
    finally:
        traj.env_s += loop.time() - t0


def _env_timeout(ctx: RolloutContext) -> EnvFailure:
    return EnvFailure("timeout", f"env call took longer than rollout.turn_timeout_s = {ctx.cfg.rollout.turn_timeout_s}")


async def _generate(
    ctx: RolloutContext, i: int, req: Generate, traj: Trajectory, hold: bool, loop: asyncio.AbstractEventLoop
) -> Generated:
    """One engine request. ``hold``: the caller already holds engine i's permit (env_async off)."""
    engine = ctx.engines[i]
    slot = None
    if not hold:
        slot = ctx.router.slot(i)
        if not slot.try_acquire():  # a free permit costs no await
            t_wait = loop.time()
            await slot.acquire()
            traj.wait_s += loop.time() - t_wait
    rid = req.request_id
    try:
        t0 = loop.time()
        ctx.live[rid] = i
        busy = ctx.busy[i]
        busy.enter(t0)
        try:
            out = await engine.generate(req)
        except asyncio.CancelledError:
            # Cancelled (redundant sample, deadline, stale, shutdown): the engine would keep
            # generating a request nobody reads, holding its slot. Tell it, shielded and bounded.
            try:
                await _shielded(engine.abort([rid]), ABORT_TIMEOUT_S)
            except asyncio.CancelledError:
                pass  # this task is being cancelled anyway: raised just below
            except Exception as e:  # a dead engine cannot abort anything; nothing to free
                log.debug("abort of %s on %s failed: %s", rid, engine.name, e)
            raise
        finally:
            del ctx.live[rid]
            t1 = loop.time()
            busy.exit(t1)
            traj.gen_s += t1 - t0
    finally:
        if slot is not None:
            slot.release()
    n = len(out.token_ids)
    ctx.generated_tokens[i] += n
    if ctx.token_rates:
        ctx.token_rates[i].add(n)
    return out


async def run_trajectory(ctx: RolloutContext, spec: RolloutSpec, i: int, attempt: int = 0) -> Trajectory:
    """One attempt of one rollout on engine ``i``. Raises EnvFailure / PeerDead / RemoteError.

    Its turns may be cancelled by ``RolloutContext.abort_stale`` (``_Attempt``): the trajectory
    then comes back with status "failed", failure "stale".
    """
    cfg = ctx.cfg
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    traj = Trajectory(
        sample_id=spec.sample_id,
        group=spec.group,
        index=spec.index,
        engine=ctx.engines[i].name,
        attempts=attempt + 1,
        version_sent=ctx.version(),
        t_start=loop.time(),
        task_id=spec.task.id,
    )
    env = ctx.suite.make_env()
    try:
        held = None  # env_async off: the engine permit, held from before env.reset to the end
        if not cfg.rollout.env_async:
            held = ctx.router.slot(i)
            t0 = loop.time()
            await held.acquire()
            traj.wait_s += loop.time() - t0
        att = _Attempt(task)
        try:
            await _turn_loop(ctx, spec, i, attempt, env, traj, held is not None, att, loop)
        except asyncio.CancelledError:
            # Ours (the stale abort) only if no other cancel is pending on the task: a deadline or
            # the caller's cancel always goes on up.
            if att.cancel_called and task.uncancel() == 0:
                traj.status, traj.failure = "failed", "stale"
            else:
                raise
        finally:
            if att.key:
                ctx.watched.pop(att.key, None)
            if held is not None:
                held.release()
    finally:
        try:
            await _shielded(env.close(), ENV_CLOSE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken env must not hide the rollout's own outcome
            log.warning("env.close() failed for %s: %s", spec.sample_id, e)
    traj.t_end = loop.time()
    return traj


async def _turn_loop(
    ctx: RolloutContext,
    spec: RolloutSpec,
    i: int,
    attempt: int,
    env: Any,
    traj: Trajectory,
    hold: bool,
    att: _Attempt,
    loop: asyncio.AbstractEventLoop,
) -> None:
    cfg = ctx.cfg
    rule = ctx.staleness if spec.group >= 0 else None  # training rollouts only
    tok = ctx.tokenizer
    max_len = cfg.model.max_model_len
    call = _coro(env.reset(spec.task))
    done, obs = _env_now(ctx, call)
    if not done:
        obs = await _env_rest(ctx, traj, call, obs)
    traj.prompt_ids = list(tok.encode(obs))  # the only tokenization of the prompt
    if len(traj.prompt_ids) >= max_len:
        traj.status, traj.failure = "failed", "prompt_too_long"
        return
    uid, idx = spec.seed_key
    top_p = cfg.rollout.top_p if spec.group >= 0 else 1.0
    while True:
        room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
        if room <= 0:
            traj.finish_reason = "max_model_len"
            return
        req = Generate(
            request_id=f"{spec.sample_id}.{attempt}.{traj.turns}",
            prompt_ids=traj.prompt_ids + traj.response_ids,
            max_tokens=min(cfg.rollout.max_new_tokens, room),
            temperature=spec.temperature,
            top_p=top_p,
            seed=request_seed(cfg.run.seed, uid, idx, traj.turns),
        )
        out = await _generate(ctx, i, req, traj, hold, loop)
        n = len(out.token_ids)
        if not (n == len(out.logprobs) == len(out.versions)):
            raise RuntimeError(
                f"engine {ctx.engines[i].name} answered {req.request_id} with {n} tokens, "
                f"{len(out.logprobs)} logprobs, {len(out.versions)} versions: the engine must return one of each per token"
            )
        traj.response_ids += out.token_ids
        traj.loss_mask += [1] * n
        traj.behav_logp += out.logprobs
        traj.versions += out.versions
        traj.turns += 1
        ids = out.token_ids
        call = _coro(env.step(tok.decode(ids if type(ids) is list else list(ids))))
        done, res = _env_now(ctx, call)
        if not done:
            res = await _env_rest(ctx, traj, call, res)
        traj.reward += res.reward
        traj.correct = _correct(res, traj.reward)
        if res.info and "metrics" in res.info:
            traj.metrics.update(res.info["metrics"])
        if res.done:
            traj.finish_reason = out.finish_reason
            return
        if traj.turns >= cfg.rollout.max_turns:
            traj.finish_reason = "max_turns"
            return
        room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
        obs_ids = list(tok.encode(res.observation))[: max(room, 0)]
        traj.response_ids += obs_ids
        traj.loss_mask += [0] * len(obs_ids)
        traj.behav_logp += [0.0] * len(obs_ids)
        traj.versions += [-1] * len(obs_ids)
        if rule is not None and not att.key and traj.n_generated > 0:
            # version_start is now exact (the first generated token's version), and more turns follow.
            if rule.doomed(traj.version_start):
                traj.status, traj.failure = "failed", "stale"
                return
            att.key = f"{spec.sample_id}.{attempt}"
            ctx.watched[att.key] = (traj.version_start, att)


def _failed(spec: RolloutSpec, reason: str, attempts: int, engine: str) -> Trajectory:
    return Trajectory(
        sample_id=spec.sample_id,
        group=spec.group,
        index=spec.index,
        status="failed",
        failure=reason,
        attempts=attempts,
        engine=engine,
        t_end=asyncio.get_running_loop().time(),
    )


# --------------------------------------------------------------------------- one sample, one group
async def run_sample(ctx: RolloutContext, spec: RolloutSpec, engine: int) -> Trajectory:
    """One sample, retried after infrastructure failures. ``engine`` was picked (and counted) by the caller.

    Returns a Trajectory with status "ok" or "failed" (the failure named and counted); releases
    its engine count on every path (run_group releases it for a task cancelled before it started).
    """
    i = engine
    attempt = 0
    retries = 0  # infrastructure retries only; stale restarts are not charged to max_retries
    limit = _timeout_s(ctx.cfg.rollout.trajectory_timeout_s)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    while True:
        name = ctx.engines[i].name
        try:
            expiry = None if limit is None else ctx.deadlines.add(loop, task, limit)
            try:
                traj = await run_trajectory(ctx, spec, i, attempt)
            except asyncio.CancelledError:
                # The deadline's cancel only if no other cancel is pending (as asyncio.timeout decides).
                if expiry is not None and expiry.expired and task.uncancel() == 0:
                    raise TimeoutError from None
                raise
            finally:
                if expiry is not None:
                    expiry.over = True
                    expiry.task = None  # a finished attempt queued behind a long one holds nothing
            if traj.status == "failed" and traj.failure == "stale":
                reason = "stale"
            else:
                if traj.status == "failed":
                    ctx.counters[f"rollout/failed_{traj.failure}"] += 1
                return traj
        except EnvFailure as e:
            reason = f"env_{e.reason}"
            log.info("rollout %s: environment failure on attempt %d: %s", spec.sample_id, attempt, e)
        except PeerDead as e:
            reason = "engine_dead"
            if ctx.router.alive[i]:
                ctx.router.mark_dead(i)
                ctx.counters["engines/dead"] += 1
                log.error("engine %s is dead (%s); its rollouts move to other engines", name, e)
        except TimeoutError:
            ctx.counters["rollout/failed_trajectory_timeout"] += 1
            return _failed(spec, "trajectory_timeout", attempt + 1, name)
        except RemoteError as e:
            log.warning("engine %s refused %s: %s", name, spec.sample_id, e)
            ctx.counters["rollout/failed_engine_error"] += 1
            return _failed(spec, "engine_error", attempt + 1, name)
        finally:
            ctx.router.release(i)
        if reason == "stale":
            ctx.counters["rollout/aborted_stale"] += 1
            log.debug("rollout %s: too stale to be trained, restarted on fresh weights", spec.sample_id)
        elif retries >= ctx.cfg.rollout.max_retries:
            ctx.counters[f"rollout/failed_{reason}"] += 1
            return _failed(spec, reason, attempt + 1, name)
        else:
            ctx.counters[f"rollout/retry_{reason}"] += 1
            retries += 1
        attempt += 1
        i = ctx.router.pick()  # least-loaded live engine; a dead one is never picked again


async def run_group(
    ctx: RolloutContext,
    *,
    task: Task,
    group: int,
    need: int,
    first_index: int,
    extra: int,
    temperature: float,
    on_sample: Callable[[Trajectory], object],
    seed_key: Callable[[int], tuple[int, int]] | None = None,
    sample_ids: Callable[[int], str] | None = None,
) -> bool:
    """Run ``need + extra`` rollouts of ``task``; hand the first ``need`` ok ones to ``on_sample``.

    Returns True when ``need`` samples were delivered, False when the group cannot be filled
    (the caller drops it and counts it). The remaining rollouts are cancelled either way, which
    aborts their engine requests and frees their permits and engine counts; run_group returns
    (or raises) only once every one of its tasks has ended. A rollout that raises (a bug) cancels
    the others and its error is raised here.
    """
    n = need + extra
    router = ctx.router
    if ctx.cfg.scheduler.replication:
        engines = [router.pick() for _ in range(n)]  # each sample to the least-loaded engine
    else:
        first = router.pick()
        for _ in range(n - 1):
            router.take(first)
        engines = [first] * n
    loop = asyncio.get_running_loop()
    state = _GroupState(need, n, on_sample, loop.create_future())
    tasks: list[asyncio.Task[None]] = []
    for k, i in enumerate(engines):
        idx = first_index + k
        spec = RolloutSpec(
            task=task,
            group=group,
            index=idx,
            temperature=temperature,
            seed_key=seed_key(idx) if seed_key else (group, idx),
            sample_id=sample_ids(idx) if sample_ids else sample_id(group, idx),
        )
        tasks.append(loop.create_task(_report(ctx, spec, i, state)))
    try:
        await state.decided
    finally:
        await _end_all(ctx, tasks, engines)
    if state.error is not None:
        raise state.error
    if state.kept == need and state.done < n:
        ctx.counters["rollout/aborted_redundant"] += n - state.done
    return state.kept == need


class _GroupState:
    """One run_group's tally. Samples report into it from their own tasks, in the order they finish
    (no stream, no wake-up of the group task per sample); ``decided`` resolves once the group has
    ``need`` ok samples, can no longer get them, or a rollout raised."""

    __slots__ = ("need", "n", "on_sample", "decided", "kept", "done", "error")

    def __init__(self, need: int, n: int, on_sample: Callable[[Trajectory], object], decided: asyncio.Future[None]) -> None:
        self.need = need
        self.n = n
        self.on_sample = on_sample
        self.decided = decided
        self.kept = 0
        self.done = 0
        self.error: BaseException | None = None

    def finish(self, traj: Trajectory) -> None:
        if self.decided.done():
            return  # finished after the group had what it needed (counted as aborted)
        self.done += 1
        if traj.status == "ok":
            self.kept += 1
            self.on_sample(traj)
        if self.kept == self.need or self.kept + (self.n - self.done) < self.need:
            self.decided.set_result(None)  # redundant (or hopeless) rollouts: abort them now

    def fail(self, e: BaseException) -> None:
        if self.error is None:  # a bug is raised even when it comes after the group was decided
            self.error = e
        if not self.decided.done():
            self.decided.set_result(None)


async def _report(ctx: RolloutContext, spec: RolloutSpec, i: int, state: _GroupState) -> None:
    try:
        state.finish(await run_sample(ctx, spec, i))
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - a bug (or on_sample's error): the group raises it
        state.fail(e)


async def _end_all(ctx: RolloutContext, tasks: list[asyncio.Task[None]], engines: list[int]) -> None:
    """Cancel the group's unfinished tasks and wait for every one to end (their aborts are shielded).

    A task cancelled before it ever ran never enters run_sample, so its engine count is released
    here. A cancel of the waiting task itself is raised after the wait: the group never leaves
    rollouts behind.
    """
    pending = [t for t in tasks if not t.done()]
    if not pending:
        return
    for k, t in enumerate(tasks):
        if t.done():
            continue
        if inspect.getcoroutinestate(t.get_coro()) == inspect.CORO_CREATED:
            ctx.router.release(engines[k])
        t.cancel()
    cancelled = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [t for t in pending if not t.done()]
    if cancelled:
        raise asyncio.CancelledError
