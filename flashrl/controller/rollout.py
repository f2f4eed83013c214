"""Rollout coroutines: one trajectory (generic multi-turn), one sample with retries, one group.

    run_group(uid, need, extra)                       one asyncio task per rollout; each reports its
      ├─ run_sample(index k) x (need + extra) ──┐     result to the group's tally as it finishes:
      │    retry loop (infra failures, stale)   │     first ``need`` ok samples (finish or launch order) -> on_sample()
      │      run_trajectory(engine i, attempt)  │     then the group cancels the rest: each cancelled
      └────── _GroupState.finish(traj) <────────┘     generate sends engine.abort([request_id])
                                                      unfillable (ok + still running < need) -> False

    run_trajectory:  env.reset(task) -> encode once -> ┌> [permit] engine.generate [/permit]
                                                       │   decode -> env.step(action)  (turn deadline)
                                                       └── not done, turns < max_turns, room left:
                                                           append generated ids (mask 1) + obs ids (mask 0)

A rollout stays on the engine it was routed to for all its turns (its prefix stays in that
engine's cache) and moves only when retried. Token ids are concatenated turn after turn; nothing
is re-tokenized from text. With a chat model (the tokenizer's ``encode_prompt`` /
``encode_observation``, flashrl/models/chat.py) the prompt is the chat template's rendering and each
observation is the template's turn: the assistant turn's closing, user(observation), the next
generation prompt. Requests carry the model's stop tokens (``tokenizer.stop_token_ids``). Generated tokens keep the engine's logprob and per-token policy
version; observation tokens get mask 0, logprob 0.0, version -1. A finished multi-turn chat
trajectory is also compared with the template's re-rendering of its conversation
(``Trajectory.template_mismatch``): a template that rewrites history (Qwen3 dropping past
``<think>`` blocks) shows there, while the trained ids stay the generated ones.

Engine concurrency model (``rollout.env_async``): every engine has ``engine.max_num_seqs`` permits
(scheduler.Router.slot). With env_async = true a rollout holds a permit only inside
engine.generate, so while it waits on its environment the engine serves another rollout. With
env_async = false it takes the permit before env.reset and keeps it until the trajectory ends:
the engine slot idles while the environment steps, as in a loop that calls a blocking env.

Failure tiers, each counted under its own name (nothing is lost silently):
  infrastructure, retried up to rollout.max_retries, re-routed to the least-loaded live engine:
      EnvFailure(reason)         -> rollout/retry_env_<reason>
      env call past turn_timeout -> rollout/retry_env_timeout
      transport.PeerDead         -> engine/retried_requests (the engine is marked dead first:
                                    engine/deaths; the controller restarts it when it can)
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

Cost (the controller must push >= 20K samples per CPU second through this path): one task per
rollout and nothing else, with the toolkit of flashrl/aio.py. Three causes of a cancel stay apart:
a stale abort (``aio.TaskCancel``), the trajectory deadline (``aio.Deadlines``: asyncio.timeout's
semantics on one shared timer), and the caller's cancel (redundancy, shutdown), which always
propagates. An env call is first run to its first
suspension inline (``aio.first_step``): one that completes at once (the common case) costs no
timer; one that suspends then gets its deadline (turn_timeout_s). Cleanups (env.close,
engine.abort) are ``aio.shielded``: run to their end even under a cancel, bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flashrl.aio import (
    Deadlines,
    Resumed,
    TaskCancel,
    as_coroutine,
    cancel_and_wait,
    first_step,
    shielded,
    timeout,
)
from flashrl.config import Config
from flashrl.controller.scheduler import Router, mark_engine_dead, request_seed, sample_id
from flashrl.controller.types import Trajectory
from flashrl.core.meters import BusyMeter, RateMeter
from flashrl.core.staleness import Staleness
from flashrl.env import EnvFailure, EnvSuite, StepResult, Task
from flashrl.interfaces import ChatTokenizer, EngineClient, Tokenizer
from flashrl.wire.protocol import Generate, Generated
from flashrl.wire.transport import PeerDead, RemoteError

__all__ = ["RolloutContext", "RolloutSpec", "run_group", "run_sample", "run_trajectory"]

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on telling an engine to drop a request nobody will read
ENV_CLOSE_TIMEOUT_S = 5.0


class RolloutSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to roll out: the task, the group and index (ids, seeds), the sampling temperature."""

    task: Task
    group: int
    index: int
    temperature: float
    seed_key: tuple[int, int]  # (prompt uid, sample index) for training; (-1 - k, version) for eval
    sample_id: str = ""


PROMPT_CACHE = 4096  # prompts whose token ids RolloutContext keeps (oldest out first)


@dataclass(eq=False)
class RolloutContext:
    """Everything a rollout needs, shared by all of them (single event loop: no locks)."""

    cfg: Config
    tokenizer: Tokenizer
    suite: EnvSuite
    engines: Sequence[EngineClient]
    router: Router
    version: Callable[[], int]
    counters: Counter[str] = field(default_factory=Counter)
    live: dict[str, int] = field(default_factory=dict)  # request id -> engine, while generating
    # per engine: time with >= 1 generate in flight (the controller's, started with its run: the busy
    # fractions of its dashboard); none given: meters of this context's own (stand-alone rollouts)
    busy: list[BusyMeter] = field(default_factory=list)
    token_rates: list[RateMeter] = field(default_factory=list)  # per engine; empty: not metered
    # the run's staleness rule (shared with the buffer, which advances its next_step); None turns
    # the stale early abort off
    staleness: Staleness | None = None
    # who handles an engine death: the controller's supervisor (supervisor.EngineSupervisor.engine_dead:
    # marks it dead, counts it, restarts it when a launcher can); None: this context marks it dead in
    # the router itself (stand-alone rollouts, no restarts)
    on_engine_dead: Callable[[int, BaseException], None] | None = None
    # awaited when every engine is down, until one is back (given only when engines can be restarted)
    wait_engine: Callable[[], Coroutine[Any, Any, None]] | None = None
    # attempts watched for staleness (multi-turn training rollouts past their first turn):
    # what cancels the attempt -> the version of its first generated token
    watched: dict[TaskCancel, int] = field(default_factory=dict, init=False)
    # the trajectory deadline of every attempt in flight (rollout.trajectory_timeout_s): one timer
    deadlines: Deadlines = field(init=False)
    # the tokenizer when it renders turns itself (interfaces.ChatTokenizer), else None: decided once
    chat: ChatTokenizer | None = field(init=False)
    # the prompt's token ids by its text: a group's samples (and replicas, retries) share their prompt,
    # which was tokenized once per sample (a fifth of the controller's CPU on the embedded default)
    _prompts: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False)

    def prompt_ids(self, obs: str) -> list[int]:
        """The first observation's token ids (chat-rendered when the tokenizer has a chat template)."""
        ids = self._prompts.get(obs)
        if ids is None:
            ids = tuple(self.chat.encode_prompt(obs) if self.chat is not None else self.tokenizer.encode(obs))
            if len(self._prompts) >= PROMPT_CACHE:
                self._prompts.pop(next(iter(self._prompts)))  # the oldest
            self._prompts[obs] = ids
        return list(ids)

    def __post_init__(self) -> None:
        self.deadlines = Deadlines(self.cfg.rollout.trajectory_timeout_s)
        self.chat = self.tokenizer if isinstance(self.tokenizer, ChatTokenizer) else None
        if not self.busy:
            self.busy = [BusyMeter() for _ in self.engines]

    def engine_dead(self, i: int, err: BaseException) -> None:
        """Engine ``i`` is gone (its request raised PeerDead): no more rollouts or weights for it.
        Counted once per death under ``engine/deaths`` (scheduler.mark_engine_dead); restarted when
        the handler given as ``on_engine_dead`` can."""
        if self.on_engine_dead is not None:
            self.on_engine_dead(i, err)
        else:
            mark_engine_dead(self.router, self.counters, self.engines, i, err)

    def abort_stale(self) -> int:
        """Cancel every watched trajectory that became too stale to train; return how many.

        The controller calls this whenever ``staleness.next_step`` grows (a batch was taken).
        """
        rule = self.staleness
        if rule is None:
            return 0
        n = 0
        for scope, version_start in self.watched.items():
            if not scope.cancel_called and rule.doomed(version_start):
                scope.cancel()
                n += 1
        return n


def _correct(res: StepResult, reward: float) -> bool:
    if "correct" in res.info:
        return bool(res.info["correct"])
    return reward >= 1.0


# --------------------------------------------------------------------------- one trajectory
async def _env_call(ctx: RolloutContext, traj: Trajectory, aw: Awaitable[Any]) -> Any:
    """One env call (reset or step), run inline to its first suspension (aio.first_step): one that
    completes there takes no loop time, so it cannot miss its deadline; only one that suspends gets
    the timer of rollout.turn_timeout_s (``_env_rest``)."""
    call = as_coroutine(aw)
    try:
        done, out = first_step(call)
    except TimeoutError:
        raise _env_timeout(ctx) from None
    return out if done else await _env_rest(ctx, traj, call, out)


async def _env_rest(ctx: RolloutContext, traj: Trajectory, call: Coroutine[Any, Any, Any], first: Any) -> Any:
    """The rest of an env call that suspended, bounded by rollout.turn_timeout_s."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with timeout(ctx.cfg.rollout.turn_timeout_s):
            return await Resumed(call, first)
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
                await shielded(engine.abort([rid]), ABORT_TIMEOUT_S)
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
    if ctx.token_rates:
        ctx.token_rates[i].add(len(out.token_ids))
    return out


async def run_trajectory(ctx: RolloutContext, spec: RolloutSpec, i: int, attempt: int = 0) -> Trajectory:
    """One attempt of one rollout on engine ``i``. Raises EnvFailure / PeerDead / RemoteError.

    Its turns may be cancelled by ``RolloutContext.abort_stale`` (``aio.TaskCancel``): the
    trajectory then comes back with status "failed", failure "stale".
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
        att = TaskCancel(task)
        try:
            await _turn_loop(ctx, spec, i, attempt, env, traj, held is not None, att, loop)
        except asyncio.CancelledError:
            # Ours (the stale abort) only if no other cancel is pending on the task: a deadline or
            # the caller's cancel always goes on up.
            if att.claim():
                traj.status, traj.failure = "failed", "stale"
            else:
                raise
        finally:
            if ctx.watched:
                ctx.watched.pop(att, None)
            if held is not None:
                held.release()
    finally:
        try:
            await shielded(env.close(), ENV_CLOSE_TIMEOUT_S)
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
    att: TaskCancel,
    loop: asyncio.AbstractEventLoop,
) -> None:
    cfg = ctx.cfg
    rule = ctx.staleness if spec.group >= 0 else None  # training rollouts only
    tok = ctx.tokenizer
    max_len = cfg.model.max_model_len
    obs = await _env_call(ctx, traj, env.reset(spec.task))
    # The prompt tokenized once per distinct text (ctx.prompt_ids): chat-rendered when the tokenizer has a chat template.
    chat = ctx.chat
    traj.prompt_ids = ctx.prompt_ids(obs)
    if len(traj.prompt_ids) >= max_len:
        traj.status, traj.failure = "failed", "prompt_too_long"
        return
    uid, idx = spec.seed_key
    top_p = cfg.rollout.top_p if spec.group >= 0 else 1.0
    stop_ids = chat.stop_token_ids if chat is not None else []  # the model's generation_config.json eos list
    # chat models: each generated turn's ids and the observation appended after it (None: none was), for
    # the template re-rendering check at the end (_measure_template)
    conversation: list[tuple[Sequence[int], str | None]] | None = [] if chat is not None else None
    while True:
        room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
        if room <= 0:
            traj.finish_reason = "max_model_len"
            break
        req = Generate(
            request_id=f"{spec.sample_id}.{attempt}.{traj.turns}",
            prompt_ids=traj.prompt_ids + traj.response_ids,
            max_tokens=min(cfg.rollout.max_new_tokens, room),
            temperature=spec.temperature,
            top_p=top_p,
            seed=request_seed(cfg.run.seed, uid, idx, traj.turns),
            stop_token_ids=stop_ids,
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
        res = await _env_call(ctx, traj, env.step(tok.decode(ids if type(ids) is list else list(ids))))
        traj.reward += res.reward
        traj.correct = _correct(res, traj.reward)
        if res.info and "metrics" in res.info:
            traj.metrics.update(res.info["metrics"])
        if res.done or traj.turns >= cfg.rollout.max_turns:
            traj.finish_reason = out.finish_reason if res.done else "max_turns"
            if conversation is not None:
                conversation.append((ids, None))
            break
        room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
        # The observation turn as the chat template renders it after this generated turn (or raw text).
        obs_ids = chat.encode_observation(res.observation, ids) if chat is not None else tok.encode(res.observation)
        obs_ids = list(obs_ids)[: max(room, 0)]
        traj.response_ids += obs_ids
        traj.loss_mask += [0] * len(obs_ids)
        traj.behav_logp += [0.0] * len(obs_ids)
        traj.versions += [-1] * len(obs_ids)
        if conversation is not None:
            conversation.append((ids, res.observation))
        if rule is not None and att not in ctx.watched and traj.n_generated > 0:
            # version_start is now exact (the first generated token's version), and more turns follow.
            if rule.doomed(traj.version_start):
                traj.status, traj.failure = "failed", "stale"
                return
            ctx.watched[att] = traj.version_start
    if chat is not None and conversation and conversation[0][1] is not None:
        _measure_template(chat, obs, conversation, traj)


def _measure_template(chat: ChatTokenizer, prompt: str, conversation: list[tuple[Sequence[int], str | None]],
                      traj: Trajectory) -> None:
    """A multi-turn chat trajectory against its text re-rendering (ChatTokenizer.template_mismatch): the
    tokens by which the template's rendering of the finished conversation differs from the trained ids
    (which stay as generated either way), and how many of those decoding and re-encoding the generated
    turns alone would change. Reported per step as rollout/template_* and rollout/retokenize_*."""
    try:
        m = chat.template_mismatch(prompt, conversation, traj.prompt_ids + traj.response_ids)
    except Exception as e:  # a metric: a template that cannot re-render a conversation must not end the run
        global _template_warned
        if not _template_warned:
            _template_warned = True
            log.warning("chat template: re-rendering a finished conversation failed (%s: %s); rollout/template_* "
                        "are not measured for such samples", type(e).__name__, e)
        return
    if m is not None:
        traj.template_mismatch, traj.retokenize_mismatch = m


_template_warned = False  # _measure_template's warning, once per process


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
    task = asyncio.current_task()
    assert task is not None
    while True:
        name = ctx.engines[i].name
        try:
            with ctx.deadlines.scope(task):  # the attempt's deadline: TimeoutError below
                traj = await run_trajectory(ctx, spec, i, attempt)
            if traj.status == "failed" and traj.failure == "stale":
                reason = "stale"
                ctx.counters["stale/dropped_tokens"] += traj.n_generated  # generated, then thrown away
            else:
                if traj.status == "failed":
                    ctx.counters[f"rollout/failed_{traj.failure}"] += 1
                return traj
        except EnvFailure as e:
            reason = f"env_{e.reason}"
            log.info("rollout %s: environment failure on attempt %d: %s", spec.sample_id, attempt, e)
        except PeerDead as e:
            reason = "engine_dead"
            ctx.engine_dead(i, e)
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
            ctx.counters["engine/retried_requests" if reason == "engine_dead" else f"rollout/retry_{reason}"] += 1
            retries += 1
        attempt += 1
        if ctx.router.all_dead and ctx.wait_engine is not None:
            await ctx.wait_engine()  # every engine is restarting: wait for one (raises if none can come back)
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
    """Run ``need + extra`` rollouts of ``task``; hand ``need`` ok ones to ``on_sample``: the first to finish,
    or with ``rollout.redundant_keep = "launch_order"`` the first in launch order (``_GroupState``).

    Returns True when ``need`` samples were delivered, False when the group cannot be filled
    (the caller drops it and counts it). The remaining rollouts are cancelled either way, which
    aborts their engine requests and frees their permits and engine counts; run_group returns
    (or raises) only once every one of its tasks has ended. A rollout that raises (a bug) cancels
    the others and its error is raised here.
    """
    n = need + extra
    router = ctx.router
    if router.all_dead and ctx.wait_engine is not None:
        await ctx.wait_engine()
    if ctx.cfg.scheduler.replication:
        engines = [router.pick() for _ in range(n)]  # each sample to the least-loaded engine
    else:
        first = router.pick()
        for _ in range(n - 1):
            router.take(first)
        engines = [first] * n
    loop = asyncio.get_running_loop()
    in_launch_order = ctx.cfg.rollout.redundant_keep == "launch_order" and extra > 0
    state = _GroupState(need, n, on_sample, loop.create_future(), first_index if in_launch_order else None)
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
        # Cancel the rest (their aborts are shielded) and wait for every one: the group never leaves
        # rollouts behind. A task cancelled before it ran never entered run_sample: release its count.
        await cancel_and_wait(tasks, lambda k: ctx.router.release(engines[k]))
    if state.error is not None:
        raise state.error
    if state.kept == need and state.done < n:
        ctx.counters["rollout/aborted_redundant"] += n - state.done
    return state.kept == need


class _GroupState:
    """One run_group's tally. Samples report into it from their own tasks, in the order they finish
    (no stream, no wake-up of the group task per sample); ``decided`` resolves once the group has
    ``need`` ok samples, can no longer get them, or a rollout raised.

    Which ``need`` are kept (``rollout.redundant_keep``):
      finish_order (``first_index`` None): the first ``need`` ok samples to finish. Fastest, but the kept
        set is selected on finishing time: trajectories that end early (few turns, fast env calls, an
        early win or an early give-up) are over-represented in what the policy trains on.
      launch_order (``first_index`` given): the ``need`` ok samples of lowest launch position
        (``traj.index - first_index``). A sample is delivered only once every sample launched before it
        has finished, so the kept set depends on which samples failed, never on how long any took: the
        extra rollouts stand in for failed (or timed-out) ones only. Invariant: the kept samples are
        exactly the first ``need`` ok ones in launch order among those decided.
    """

    __slots__ = ("need", "n", "on_sample", "decided", "kept", "done", "error", "first_index", "results", "cursor", "ok")

    def __init__(self, need: int, n: int, on_sample: Callable[[Trajectory], object], decided: asyncio.Future[None],
                 first_index: int | None = None) -> None:
        self.need = need
        self.n = n
        self.on_sample = on_sample
        self.decided = decided
        self.kept = 0
        self.done = 0
        self.error: BaseException | None = None
        self.first_index = first_index
        self.results: list[Trajectory | None] = [None] * n if first_index is not None else []
        self.cursor = 0  # launch_order: every position below it is finished and delivered (or failed)
        self.ok = 0  # ok samples finished, delivered or not

    def finish(self, traj: Trajectory) -> None:
        if self.decided.done():
            return  # finished after the group had what it needed (counted as aborted)
        self.done += 1
        if traj.status == "ok":
            self.ok += 1
        if self.first_index is None:
            if traj.status == "ok":
                self.kept += 1
                self.on_sample(traj)
        else:
            self.results[traj.index - self.first_index] = traj
            while self.cursor < self.n and self.kept < self.need and (t := self.results[self.cursor]) is not None:
                if t.status == "ok":
                    self.kept += 1
                    self.on_sample(t)
                self.cursor += 1
        if self.kept == self.need or self.ok + (self.n - self.done) < self.need:
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
