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

Checkpoint cuts (``RolloutContext(cuts=True)``: the controller of a partial-mode run that writes
checkpoints): every training rollout is registered while it runs (``ctx.rollouts``: sample id ->
its current attempt's Trajectory, gone in the same step that hands the sample to the group, or, in
launch order, that holds it back behind an earlier-launched one: ``ctx.held`` until it is handed over)
and each of its engine requests too (``ctx.tracked``). ``ctx.cut()`` closes the gate (no training
request starts), aborts every tracked request, and waits until each has answered and folded its
tokens so far into its Trajectory; the caller then reads every prefix in one synchronous step, and
``ctx.go_on()`` reopens the gate: each interrupted rollout continues with a request for the rest of
its turn (prompt + its tokens so far, ``max_tokens`` less them, seeded by ``request_seed(...,
done)``), exactly as after a weight update, each token keeping its own version and logprob. A
rollout restored from a checkpoint (``RolloutSpec.resume``) starts the same way from its saved
prefix (or with its environment step, when its generation had come back). An interrupt's "abort"
answer is never taken for the end of a turn.

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
CUT_TIMEOUT_S = 10.0  # bound on a checkpoint cut's wait for the interrupted requests' answers
CUT_RETRY_S = 0.5  # a cut asks again for the requests that have not answered after this long
ENV_CLOSE_TIMEOUT_S = 5.0


class RolloutSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to roll out: the task, the group and index (ids, seeds), the sampling temperature."""

    task: Task
    group: int
    index: int
    temperature: float
    seed_key: tuple[int, int]  # (prompt uid, sample index) for training; (-1 - k, version) for eval
    sample_id: str = ""
    resume: Trajectory | None = None  # a checkpoint's unfinished rollout of this index: continue it (first attempt)


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
    # checkpoint cuts (module docstring): on, the training rollouts and their requests are registered
    cuts: bool = False
    gate: asyncio.Event | None = field(default=None, init=False)  # set: training requests may start
    # sample id -> (prompt uid, sample index, its attempt's Trajectory so far or its saved prefix or None)
    rollouts: dict[str, tuple[int, int, Trajectory | None]] = field(default_factory=dict, init=False)
    tracked: dict[str, int] = field(default_factory=dict, init=False)  # training request id -> engine
    # sample id -> a finished sample that waits for an earlier-launched one of its group before it is handed
    # over (rollout.redundant_keep = "launch_order"): off ``rollouts``, not yet in the buffer, so a cut
    # saves it from here (with cuts only)
    held: dict[str, Trajectory] = field(default_factory=dict, init=False)
    interrupts: dict[str, asyncio.Future[None]] = field(default_factory=dict, init=False)  # cut's, unanswered

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
        if self.cuts:
            self.gate = asyncio.Event()
            self.gate.set()

    async def cut(self, timeout_s: float = CUT_TIMEOUT_S) -> int:
        """Stop every training rollout's generation at its current token (module docstring): close
        the gate, abort each tracked request, wait (at most ``timeout_s``) until each answered and its
        tokens are in its Trajectory. Returns how many did not answer in time (their tokens since the
        request began are not in the cut). The gate stays closed until ``go_on()``."""
        assert self.gate is not None, "RolloutContext(cuts=True) is needed for checkpoint cuts"
        self.gate.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        waits: dict[asyncio.Future[None], tuple[str, int]] = {}
        for rid, i in self.tracked.items():
            fut = loop.create_future()
            self.interrupts[rid] = fut
            waits[fut] = (rid, i)
        late = set(waits)
        while late:
            by_engine: dict[int, list[str]] = {}
            for fut in late:
                rid, i = waits[fut]
                by_engine.setdefault(i, []).append(rid)
            await asyncio.gather(*(self._abort(i, rids) for i, rids in by_engine.items()))
            left = deadline - loop.time()
            if left <= 0:
                break
            # asked again after CUT_RETRY_S: should an abort reach an engine before the request it names (an
            # engine need not order two messages of one tick), it found nothing to abort
            _, late = await asyncio.wait(late, timeout=min(CUT_RETRY_S, left))
        if late:
            self.counters["checkpoint/unsettled_rollouts"] += len(late)
            log.warning("checkpoint cut: %d of %d requests did not answer their abort within %.0f s; their tokens "
                        "since the previous cut are not saved", len(late), len(waits), timeout_s)
        return len(late)

    def go_on(self) -> None:
        """Reopen the gate after a cut: the interrupted rollouts continue from their tokens so far."""
        if self.gate is not None:
            self.gate.set()

    async def _abort(self, i: int, rids: list[str]) -> None:
        try:
            await shielded(self.engines[i].abort(rids), ABORT_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dead engine answers its requests with PeerDead: they check in that way
            log.debug("checkpoint cut: abort on %s failed: %s", self.engines[i].name, e)

    def checkin(self, rid: str) -> bool:
        """A training request ended (answered or raised): True when a cut had interrupted it; the cut
        stops waiting for it (call once its tokens are in its Trajectory)."""
        fut = self.interrupts.pop(rid, None) if self.interrupts else None
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(None)
        return True

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
    gate = ctx.gate if traj.group >= 0 else None  # checkpoint cuts: training requests only
    try:
        if gate is not None:
            while not gate.is_set():  # a cut is reading the prefixes: start nothing until it is done
                await gate.wait()
            ctx.tracked[rid] = i  # no await from here to the request: a cut sees every request sent
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
            if gate is not None:
                del ctx.tracked[rid]
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
    # chat models: each generated turn's ids and the observation appended after it (None: none was), for
    # the template re-rendering check at the end (_measure_template)
    conversation: list[tuple[Sequence[int], str | None]] | None = [] if chat is not None else None
    pending_step = False  # a restored rollout whose generation had come back: its env step comes first
    if spec.resume is not None:
        pending_step = _continue(ctx, spec.resume, traj)
    if ctx.gate is not None and spec.group >= 0:  # from now on a cut reads this attempt (its prefix, if restored)
        ctx.rollouts[spec.sample_id] = (spec.group, spec.index, traj)
    while True:
        if pending_step:
            pending_step = False
            ids: list[int] = traj.response_ids
        else:
            room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
            if room <= 0:
                traj.finish_reason = "max_model_len"
                break
            turn_start = len(traj.response_ids) if traj.turns else 0  # a restored prefix is this turn's
            traj.finish_reason = await _gen_turn(ctx, spec, i, attempt, traj, turn_start, hold, loop)
            traj.turns += 1
            ids = traj.response_ids[turn_start:]
        res = await _env_call(ctx, traj, env.step(tok.decode(ids)))
        traj.reward += res.reward
        traj.correct = _correct(res, traj.reward)
        if res.info and "metrics" in res.info:
            traj.metrics.update(res.info["metrics"])
        if res.done or traj.turns >= cfg.rollout.max_turns:
            if not res.done:
                traj.finish_reason = "max_turns"  # else the last generation's
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
        if cfg.engine.top_logprobs:
            traj.top_logprobs += [[] for _ in obs_ids]
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


def _continue(ctx: RolloutContext, saved: Trajectory, traj: Trajectory) -> bool:
    """Seed attempt ``traj`` with a checkpoint's unfinished rollout ``saved`` (single-turn part only:
    ``saved.turns`` <= 1, no observation token). Its prompt must be the one the environment gave now
    (else the prefix is of another prompt: dropped, counted in resume/regenerated_tokens). Returns True
    when its generation had come back (the environment step comes next)."""
    if not saved.response_ids:
        return False
    if saved.prompt_ids != traj.prompt_ids:
        ctx.counters["resume/regenerated_tokens"] += len(saved.response_ids)
        log.warning("rollout %s: its environment gave another prompt than the checkpoint's; its %d saved tokens "
                    "are generated again", saved.sample_id, len(saved.response_ids))
        return False
    traj.response_ids = list(saved.response_ids)
    traj.loss_mask = list(saved.loss_mask)
    traj.behav_logp = list(saved.behav_logp)
    traj.versions = list(saved.versions)
    traj.top_logprobs = list(saved.top_logprobs)
    traj.restored = saved.restored + 1
    if saved.turns:
        traj.turns, traj.finish_reason = saved.turns, saved.finish_reason
        return True
    return False


async def _gen_turn(ctx: RolloutContext, spec: RolloutSpec, i: int, attempt: int, traj: Trajectory, turn_start: int,
                    hold: bool, loop: asyncio.AbstractEventLoop) -> str:
    """Generate the rest of the current turn into ``traj`` (its tokens from ``turn_start`` on are this
    turn's so far); its finish reason. A checkpoint cut's interrupt (module docstring) folds the tokens
    so far in and asks for the rest, as long as rollout.max_new_tokens and model.max_model_len leave room."""
    cfg = ctx.cfg
    uid, idx = spec.seed_key
    top_p = cfg.rollout.top_p if spec.group >= 0 else 1.0
    chat = ctx.chat
    stop_ids = chat.stop_token_ids if chat is not None else []  # the model's generation_config.json eos list
    part = 0
    while True:
        done = len(traj.response_ids) - turn_start
        room = cfg.model.max_model_len - len(traj.prompt_ids) - len(traj.response_ids)
        max_tokens = min(cfg.rollout.max_new_tokens - done, room)
        if max_tokens <= 0:  # a prefix that already fills the turn
            return "length"
        req = Generate(
            request_id=f"{spec.sample_id}.{attempt}.{traj.turns}" + (f".{part}" if part else ""),
            prompt_ids=traj.prompt_ids + traj.response_ids,
            max_tokens=max_tokens,
            temperature=spec.temperature,
            top_p=top_p,
            seed=request_seed(cfg.run.seed, uid, idx, traj.turns, done),
            stop_token_ids=stop_ids,
            top_logprobs=cfg.engine.top_logprobs,
        )
        try:
            out = await _generate(ctx, i, req, traj, hold, loop)
        except BaseException:
            ctx.checkin(req.request_id)  # nothing to fold: a cut reads the Trajectory as it is
            raise
        n = len(out.token_ids)
        top = len(out.top_logprobs) if req.top_logprobs else n
        if not (n == len(out.logprobs) == len(out.versions) == top):
            ctx.checkin(req.request_id)
            raise RuntimeError(
                f"engine {ctx.engines[i].name} answered {req.request_id} with {n} tokens, {len(out.logprobs)} "
                f"logprobs, {len(out.versions)} versions, {top} top-k lists: the engine must return one of each per token"
            )
        traj.response_ids += out.token_ids
        traj.loss_mask += [1] * n
        traj.behav_logp += out.logprobs
        traj.versions += out.versions
        traj.top_logprobs += out.top_logprobs
        if ctx.checkin(req.request_id) and out.finish_reason == "abort":
            part += 1  # a checkpoint cut took the tokens so far: go on (after it: the gate, in _generate)
            continue
        return out.finish_reason


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
        if spec.sample_id in ctx.rollouts:  # the failed attempt's tokens are not a prefix the next one continues
            ctx.rollouts[spec.sample_id] = (spec.group, spec.index, spec.resume)
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
    resumes: Sequence[Trajectory] = (),
    finished: Sequence[Trajectory] = (),
) -> bool:
    """Run ``need + extra`` rollouts of ``task``; hand ``need`` ok ones to ``on_sample``: the first to finish,
    or with ``rollout.redundant_keep = "launch_order"`` the first in launch order (``_GroupState``).

    ``resumes``: a checkpoint's unfinished rollouts of this group (each its own sample index),
    continued from their prefixes; ``finished``: its finished samples that were held back (launch order:
    an earlier-launched rollout had not finished), tallied as finished before anything runs. With them,
    ``need + extra - len(resumes) - len(finished)`` fresh rollouts (none when that is negative) take the
    indices from ``first_index`` on. Launch order is the order of the sample indices: restored ones
    (below ``first_index``, with gaps where samples were delivered or failed) before the fresh ones.

    Returns True when ``need`` samples were delivered, False when the group cannot be filled
    (the caller drops it and counts it). The remaining rollouts are cancelled either way, which
    aborts their engine requests and frees their permits and engine counts; run_group returns
    (or raises) only once every one of its tasks has ended. A rollout that raises (a bug) cancels
    the others and its error is raised here.
    """
    fresh = max(0, need + extra - len(resumes) - len(finished))
    n = fresh + len(resumes)  # rollouts to run (the finished ones are tallied, not run)
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
    tracked = ctx.gate is not None and group >= 0
    order = None
    if in_launch_order:
        order = sorted([*(t.index for t in resumes), *(t.index for t in finished),
                        *range(first_index, first_index + fresh)])
    state = _GroupState(need, n + len(finished), on_sample, loop.create_future(), order,
                        ctx.held if tracked else None)
    for t in finished:
        state.finish(t)
    tasks: list[asyncio.Task[None]] = []
    sids: list[str] = []
    for k, i in enumerate(engines):
        resume = resumes[k] if k < len(resumes) else None
        idx = resume.index if resume is not None else first_index + k - len(resumes)
        spec = RolloutSpec(
            task=task,
            group=group,
            index=idx,
            temperature=temperature,
            seed_key=seed_key(idx) if seed_key else (group, idx),
            sample_id=sample_ids(idx) if sample_ids else sample_id(group, idx),
            resume=resume,
        )
        if tracked:
            ctx.rollouts[spec.sample_id] = (group, idx, resume)
            sids.append(spec.sample_id)
        tasks.append(loop.create_task(_report(ctx, spec, i, state)))
    try:
        await state.decided
    finally:
        # Cancel the rest (their aborts are shielded) and wait for every one: the group never leaves
        # rollouts behind. A task cancelled before it ran never entered run_sample: release its count.
        await cancel_and_wait(tasks, lambda k: ctx.router.release(engines[k]))
        for sid in sids:  # the ones cancelled before they ran (_report unregisters the others)
            ctx.rollouts.pop(sid, None)
        state.release_held()  # samples still held back when the group decided: never handed over
    if state.error is not None:
        raise state.error
    if state.kept == need and state.done < state.n:
        ctx.counters["rollout/aborted_redundant"] += state.n - state.done
    return state.kept == need


class _GroupState:
    """One run_group's tally. Samples report into it from their own tasks, in the order they finish
    (no stream, no wake-up of the group task per sample); ``decided`` resolves once the group has
    ``need`` ok samples, can no longer get them, or a rollout raised.

    Which ``need`` are kept (``rollout.redundant_keep``):
      finish_order (``first_index`` None): the first ``need`` ok samples to finish. Fastest, but the kept
        set is selected on finishing time: trajectories that end early (few turns, fast env calls, an
        early win or an early give-up) are over-represented in what the policy trains on.
      launch_order (``order`` given: the group's ``n`` sample indices in launch order, ascending): the
        ``need`` ok samples of lowest launch position (a sample's slot is its index's place in ``order``:
        a resumed group's restored indices have gaps and lie below its fresh ones). A sample is delivered
        only once every sample launched before it has finished, so the kept set depends on which samples
        failed, never on how long any took: the extra rollouts stand in for failed (or timed-out) ones
        only. Invariant: the kept samples are exactly the first ``need`` ok ones in launch order among
        those decided. A finished ok sample waiting for an earlier one is in ``held`` (when given: the
        context's, which a checkpoint cut saves) from the step it finished to the step it is delivered
        or the group decides without it.
    """

    __slots__ = ("need", "n", "on_sample", "decided", "kept", "done", "error", "slots", "results", "cursor", "ok",
                 "held")

    def __init__(self, need: int, n: int, on_sample: Callable[[Trajectory], object], decided: asyncio.Future[None],
                 order: Sequence[int] | None = None, held: dict[str, Trajectory] | None = None) -> None:
        self.need = need
        self.n = n
        self.on_sample = on_sample
        self.decided = decided
        self.kept = 0
        self.done = 0
        self.error: BaseException | None = None
        self.slots: dict[int, int] | None = None  # launch_order: sample index -> launch position
        if order is not None:
            if len(order) != n or len(set(order)) != n:
                raise ValueError(f"launch order {list(order)}: {n} distinct sample indices expected")
            self.slots = {idx: k for k, idx in enumerate(order)}
        self.results: list[Trajectory | None] = [None] * n if order is not None else []
        self.cursor = 0  # launch_order: every position below it is finished and delivered (or failed)
        self.ok = 0  # ok samples finished, delivered or not
        self.held = held

    def finish(self, traj: Trajectory) -> None:
        if self.decided.done():
            return  # finished after the group had what it needed (counted as aborted)
        self.done += 1
        if traj.status == "ok":
            self.ok += 1
        if self.slots is None:
            if traj.status == "ok":
                self.kept += 1
                self.on_sample(traj)
        else:
            slot = self.slots.get(traj.index)
            if slot is None or self.results[slot] is not None:
                raise RuntimeError(f"sample {traj.sample_id}: index {traj.index} is not one launch position of its "
                                   f"group's ({sorted(self.slots)}) or finished twice")
            self.results[slot] = traj
            if self.held is not None and slot > self.cursor and traj.status == "ok":
                self.held[traj.sample_id] = traj  # waits for an earlier launch (in the same step as its unregistering)
            while self.cursor < self.n and self.kept < self.need and (t := self.results[self.cursor]) is not None:
                if self.held is not None:
                    self.held.pop(t.sample_id, None)
                if t.status == "ok":
                    self.kept += 1
                    self.on_sample(t)
                self.cursor += 1
        if self.kept == self.need or self.ok + (self.n - self.done) < self.need:
            self.decided.set_result(None)  # redundant (or hopeless) rollouts: abort them now
            self.release_held()

    def release_held(self) -> None:
        """The group decided: none of its samples waits to be handed over any more."""
        if self.held:
            for t in self.results[self.cursor:]:
                if t is not None:
                    self.held.pop(t.sample_id, None)

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
    finally:
        # in the step that handed the sample to its group (buffer.add): a cut sees it there or here, never
        # in neither or both
        if ctx.rollouts:
            ctx.rollouts.pop(spec.sample_id, None)
