"""Rollout coroutines: one trajectory (generic multi-turn), one sample with retries, one group.

    run_group(uid, need, extra)                       one task per rollout, results in finish order
      ├─ run_sample(index k) x (need + extra) ──┐     first ``need`` ok samples -> on_sample() at once
      │    retry loop (infra failures, stale)   │     then cancel the rest: each cancelled generate
      │      run_trajectory(engine i, attempt)  │     sends engine.abort([request_id]); permits freed
      └────────────────── memory stream <───────┘     unfillable (ok + still running < need) -> False

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

Stale early abort (``RolloutContext.min_train_step`` set, training rollouts only): once a
multi-turn trajectory knows the version of its first generated token (its first generate came
back and the env asked for another turn), it is watched; when that version can no longer pass
the buffer's staleness bound at any step still to come (``min_train_step() - version_start >
scheduler.async_ratio``, the same inequality buffer.take_batch applies), the trajectory is
cancelled at once (its engine request aborted, its env closed), counted
``rollout/aborted_stale``, and the sample restarts on fresh weights (not charged to
rollout.max_retries). Why only then: before the first generate returns, the controller knows only
a lower bound on the first token's version (its own version at dispatch: every live engine had
loaded it before it was published), and staleness needs an upper bound; a single-turn sample is
done by the time its versions are known, so the buffer's check catches it at no extra cost.
Restarts converge: a restart's first token is at least the controller's version V when it starts,
and min_train_step() <= V + 1, so it is doomed again at once only with async_ratio = 0, where no
training sample generates while a batch trains (capacity = batch_prompts: every group is in it).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec

from envs.base import EnvFailure, EnvSuite, StepResult, Task
from flashrl.config import Config
from flashrl.controller.scheduler import BusyMeter, Router, request_seed, sample_id
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
    # earliest train step that may still take a sample; None turns the stale early abort off
    min_train_step: Callable[[], int] | None = None
    # trajectories watched for staleness: sample id -> (version_start, the scope that cancels it)
    watched: dict[str, tuple[int, anyio.CancelScope]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.generated_tokens:
            self.generated_tokens = [0] * len(self.engines)
        if not self.busy:
            self.busy = [BusyMeter() for _ in self.engines]

    def doomed(self, version_start: int) -> bool:
        """Can a sample whose first token has ``version_start`` never be trained (buffer invariant 2)?"""
        if self.min_train_step is None:
            return False
        return self.min_train_step() - version_start > self.cfg.scheduler.async_ratio

    def abort_stale(self) -> int:
        """Cancel every watched trajectory that became too stale to train; return how many.

        The controller calls this whenever ``min_train_step()`` grows (a batch was taken).
        """
        n = 0
        for version_start, scope in self.watched.values():
            if not scope.cancel_called and self.doomed(version_start):
                scope.cancel()
                n += 1
        return n


def _correct(res: StepResult, reward: float) -> bool:
    if "correct" in res.info:
        return bool(res.info["correct"])
    return reward >= 1.0


async def _env_call(ctx: RolloutContext, traj: Trajectory, fn: Callable[[], Any]) -> Any:
    t0 = anyio.current_time()
    try:
        with anyio.fail_after(ctx.cfg.rollout.turn_timeout_s):
            return await fn()
    except TimeoutError:
        raise EnvFailure(
            "timeout", f"env call took longer than rollout.turn_timeout_s = {ctx.cfg.rollout.turn_timeout_s}"
        ) from None
    finally:
        traj.env_s += anyio.current_time() - t0


async def _generate(ctx: RolloutContext, i: int, req: Generate, traj: Trajectory, hold: bool) -> Generated:
    """One engine request. ``hold``: the caller already holds engine i's permit (env_async off)."""
    t0 = anyio.current_time()
    if hold:
        return await _send(ctx, i, req, traj, t0)
    async with ctx.router.slot(i):
        return await _send(ctx, i, req, traj, t0)


async def _send(ctx: RolloutContext, i: int, req: Generate, traj: Trajectory, t_wait: float) -> Generated:
    engine = ctx.engines[i]
    t0 = anyio.current_time()
    traj.wait_s += t0 - t_wait
    ctx.live[req.request_id] = i
    ctx.busy[i].enter(t0)
    try:
        out = await engine.generate(req)
    except anyio.get_cancelled_exc_class():
        # Cancelled (redundant sample, deadline, shutdown): the engine would keep generating a
        # request nobody reads, holding its slot. Tell it, shielded and bounded.
        with anyio.CancelScope(shield=True), anyio.move_on_after(ABORT_TIMEOUT_S):
            try:
                await engine.abort([req.request_id])
            except Exception as e:  # a dead engine cannot abort anything; nothing to free
                log.debug("abort of %s on %s failed: %s", req.request_id, engine.name, e)
        raise
    finally:
        del ctx.live[req.request_id]
        t1 = anyio.current_time()
        ctx.busy[i].exit(t1)
        traj.gen_s += t1 - t0
    ctx.generated_tokens[i] += len(out.token_ids)
    if ctx.token_rates:
        ctx.token_rates[i].add(len(out.token_ids))
    return out


async def run_trajectory(ctx: RolloutContext, spec: RolloutSpec, i: int, attempt: int = 0) -> Trajectory:
    """One attempt of one rollout on engine ``i``. Raises EnvFailure / PeerDead / RemoteError."""
    cfg = ctx.cfg
    traj = Trajectory(
        sample_id=spec.sample_id,
        group=spec.group,
        index=spec.index,
        engine=ctx.engines[i].name,
        attempts=attempt + 1,
        version_sent=ctx.version(),
        t_start=anyio.current_time(),
    )
    env = ctx.suite.make_env()
    try:
        if cfg.rollout.env_async:
            await _turns(ctx, spec, i, attempt, env, traj, hold=False)
        else:
            t0 = anyio.current_time()
            async with ctx.router.slot(i):
                traj.wait_s += anyio.current_time() - t0
                await _turns(ctx, spec, i, attempt, env, traj, hold=True)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(ENV_CLOSE_TIMEOUT_S):
            try:
                await env.close()
            except Exception as e:  # a broken env must not hide the rollout's own outcome
                log.warning("env.close() failed for %s: %s", spec.sample_id, e)
    traj.t_end = anyio.current_time()
    return traj


async def _turns(
    ctx: RolloutContext, spec: RolloutSpec, i: int, attempt: int, env: Any, traj: Trajectory, hold: bool
) -> None:
    """The turns of one attempt, inside a scope ``RolloutContext.abort_stale`` may cancel."""
    key = f"{spec.sample_id}.{attempt}"
    scope = anyio.CancelScope()
    try:
        with scope:
            await _turn_loop(ctx, spec, i, attempt, env, traj, hold, key, scope)
    finally:
        ctx.watched.pop(key, None)
    if scope.cancelled_caught:
        traj.status, traj.failure = "failed", "stale"


async def _turn_loop(
    ctx: RolloutContext,
    spec: RolloutSpec,
    i: int,
    attempt: int,
    env: Any,
    traj: Trajectory,
    hold: bool,
    key: str,
    scope: anyio.CancelScope,
) -> None:
    cfg = ctx.cfg
    watch = spec.group >= 0 and ctx.min_train_step is not None  # training rollouts only
    tok = ctx.tokenizer
    max_len = cfg.model.max_model_len
    obs = await _env_call(ctx, traj, lambda: env.reset(spec.task))
    traj.prompt_ids = list(tok.encode(obs))  # the only tokenization of the prompt
    if len(traj.prompt_ids) >= max_len:
        traj.status, traj.failure = "failed", "prompt_too_long"
        return
    while True:
        room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
        if room <= 0:
            traj.finish_reason = "max_model_len"
            return
        uid, idx = spec.seed_key
        req = Generate(
            request_id=f"{spec.sample_id}.{attempt}.{traj.turns}",
            prompt_ids=traj.prompt_ids + traj.response_ids,
            max_tokens=min(cfg.rollout.max_new_tokens, room),
            temperature=spec.temperature,
            top_p=cfg.rollout.top_p if spec.group >= 0 else 1.0,
            seed=request_seed(cfg.run.seed, uid, idx, traj.turns),
        )
        out = await _generate(ctx, i, req, traj, hold)
        if not (len(out.token_ids) == len(out.logprobs) == len(out.versions)):
            raise RuntimeError(
                f"engine {ctx.engines[i].name} answered {req.request_id} with {len(out.token_ids)} tokens, "
                f"{len(out.logprobs)} logprobs, {len(out.versions)} versions: the engine must return one of each per token"
            )
        traj.response_ids += out.token_ids
        traj.loss_mask += [1] * len(out.token_ids)
        traj.behav_logp += out.logprobs
        traj.versions += out.versions
        traj.turns += 1
        action = tok.decode(list(out.token_ids))
        res: StepResult = await _env_call(ctx, traj, lambda a=action: env.step(a))
        traj.reward += res.reward
        traj.correct = _correct(res, traj.reward)
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
        if watch and key not in ctx.watched and traj.n_generated > 0:
            # version_start is now exact (the first generated token's version), and more turns follow.
            if ctx.doomed(traj.version_start):
                traj.status, traj.failure = "failed", "stale"
                return
            ctx.watched[key] = (traj.version_start, scope)


def _failed(spec: RolloutSpec, reason: str, attempts: int, engine: str) -> Trajectory:
    return Trajectory(
        sample_id=spec.sample_id,
        group=spec.group,
        index=spec.index,
        status="failed",
        failure=reason,
        attempts=attempts,
        engine=engine,
        t_end=anyio.current_time(),
    )


async def run_sample(ctx: RolloutContext, spec: RolloutSpec, engine: int) -> Trajectory:
    """One sample, retried after infrastructure failures. ``engine`` was picked (and counted) by the caller.

    Returns a Trajectory with status "ok" or "failed" (the failure named and counted); releases
    its engine count on every path.
    """
    i = engine
    attempt = 0
    retries = 0  # infrastructure retries only; stale restarts are not charged to max_retries
    while True:
        name = ctx.engines[i].name
        try:
            with anyio.fail_after(ctx.cfg.rollout.trajectory_timeout_s):
                traj = await run_trajectory(ctx, spec, i, attempt)
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
    aborts their engine requests and frees their permits and engine counts.
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
    send, recv = anyio.create_memory_object_stream[Trajectory](n)

    async def one(k: int, i: int, out: anyio.abc.ObjectSendStream[Trajectory]) -> None:
        idx = first_index + k
        spec = RolloutSpec(
            task=task,
            group=group,
            index=idx,
            temperature=temperature,
            seed_key=seed_key(idx) if seed_key else (group, idx),
            sample_id=sample_ids(idx) if sample_ids else sample_id(group, idx),
        )
        async with out:
            traj = await run_sample(ctx, spec, i)
            try:
                await out.send(traj)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the group already has what it needs

    kept = done = 0
    async with anyio.create_task_group() as tg:
        for k, i in enumerate(engines):
            tg.start_soon(one, k, i, send.clone(), name=f"rollout {group}-{first_index + k}")
        send.close()
        async with recv:
            async for traj in recv:
                done += 1
                if traj.status == "ok":
                    kept += 1
                    on_sample(traj)
                if kept == need or kept + (n - done) < need:
                    tg.cancel_scope.cancel()  # redundant (or hopeless) rollouts: abort them now
                    break
    if kept == need and done < n:
        ctx.counters["rollout/aborted_redundant"] += n - done
    return kept == need
