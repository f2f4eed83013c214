"""Rollout coroutines: one trajectory (generic multi-turn) and one sample with its retries (a group of
them: group.py).

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
      an image that does not load, or images that do not pair
      with the prompt's (or an observation's) image tokens
      (a VLM, ctx.vision)                                 -> rollout/failed_bad_image (the row and file logged)
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

Checkpoint cuts (``RolloutContext.cut``, a cut.CheckpointCut: partial mode with checkpoints): each
training attempt tells the cut what it would save of it (``started``), each training request passes its
gate (``request``, ``ended``) and, once its answer is folded in, checks in: an interrupt's "abort" answer
is never taken for the end of a turn; the rollout asks for the rest of its turn (prompt + its tokens so
far, ``max_tokens`` less them, seeded by ``request_seed(..., done)``), exactly as after a weight update.
A rollout restored from a checkpoint (``RolloutSpec.resume``) starts the same way from its saved prefix
(or with its environment step, when its generation had come back).

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
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any

from flashrl.aio import Resumed, TaskCancel, as_coroutine, first_step, shielded, timeout
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.scheduler import request_seed
from flashrl.controller.types import Trajectory
from flashrl.env import EnvFailure, HeldOutAware, StepResult
from flashrl.interfaces import ChatTokenizer
from flashrl.moe.routes import check_routes, route_rows
from flashrl.wire.protocol import Generate, Generated
from flashrl.wire.trajectory import Image
from flashrl.wire.transport import PeerDead, RemoteError

__all__ = ["run_sample", "run_trajectory"]

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on telling an engine to drop a request nobody will read
ENV_CLOSE_TIMEOUT_S = 5.0


def _correct(res: StepResult, reward: float) -> bool:
    if "correct" in res.info:
        return bool(res.info["correct"])
    return reward >= 1.0


# --------------------------------------------------------------------------- one trajectory
def env_metrics(metrics: Any) -> dict[str, float]:
    """``info["metrics"]`` as the wire's floats (a bool counts 0/1: the trainer's decoder takes no bool);
    ValueError naming the key for a value that is no number (it would not reach the trainer at all)."""
    if not isinstance(metrics, dict):
        raise ValueError(f"env.step: info['metrics'] is {type(metrics).__name__}, not a dict of numbers")
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (bool, int, float)) or not isinstance(k, str)}
    if bad:
        raise ValueError(f"env.step: info['metrics'] {bad!r} are not numbers; give each metric a number (a bool counts 0/1)")
    return {k: float(v) for k, v in metrics.items()}


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
    cut = ctx.cut_for(traj.group)
    try:
        if cut is not None:
            await cut.request(rid, i)  # waits while a cut reads; no await from here to the request
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
            if cut is not None:
                cut.ended(rid)
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
    suite = ctx.suite  # a held-out rollout (negative group) is said to a suite that tells them apart
    env = suite.make_eval_env() if spec.group < 0 and isinstance(suite, HeldOutAware) else suite.make_env()
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
    if ctx.vision is not None and not await _attach_images(ctx, spec, traj):
        return
    if len(traj.prompt_ids) >= max_len:
        traj.status, traj.failure = "failed", "prompt_too_long"
        return
    # chat models: each generated turn's ids and the observation appended after it (None: none was), for
    # the template re-rendering check at the end (_measure_template)
    conversation: list[tuple[Sequence[int], str | None]] | None = [] if chat is not None else None
    pending_step = False  # a restored rollout whose generation had come back: its env step comes first
    if spec.resume is not None:
        pending_step = _continue(ctx, spec.resume, traj)
    if (cut := ctx.cut_for(spec.group)) is not None:  # from now on a cut reads this attempt (its prefix, if restored)
        cut.started(spec.sample_id, spec.group, spec.index, traj)
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
            traj.metrics.update(env_metrics(res.info["metrics"]))
        if res.done or traj.turns >= cfg.rollout.max_turns:
            if not res.done:
                traj.finish_reason = "max_turns"  # else the last generation's
            if conversation is not None:
                conversation.append((ids, None))
            break
        room = max_len - len(traj.prompt_ids) - len(traj.response_ids)
        # The observation turn as the chat template renders it after this generated turn (or raw text).
        obs_ids = chat.encode_observation(res.observation, ids) if chat is not None else tok.encode(res.observation)
        if ctx.vision is not None or res.images:  # a VLM's observation may carry images: expanded, references kept
            seen = await _observation_images(ctx, spec, traj, list(obs_ids), res.images)
            if seen is None:
                return
            obs_ids, pictured = seen
            if pictured and len(obs_ids) > room:  # an image expansion is never cut: the trajectory ends before it
                traj.finish_reason = "max_model_len"
                if conversation is not None:
                    conversation.append((ids, None))
                break
            if pictured:
                traj.images = [*traj.images, *pictured]  # a new list: a checkpoint's snapshot may share the old one
        obs_ids = list(obs_ids)[: max(room, 0)]
        traj.response_ids += obs_ids
        traj.loss_mask += [0] * len(obs_ids)
        traj.behav_logp += [0.0] * len(obs_ids)
        traj.versions += [-1] * len(obs_ids)
        if cfg.engine.top_logprobs:
            traj.top_logprobs += [[] for _ in obs_ids]
        if ctx.routes is not None:
            traj.routes += [b""] * len(obs_ids)
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


async def _attach_images(ctx: RolloutContext, spec: RolloutSpec, traj: Trajectory) -> bool:
    """A vision-language prompt: the task's image references onto ``traj`` and its prompt expanded (what the
    trainer forwards; the engine is sent it compacted). False: the row cannot be served (its images and its
    image tokens do not pair up): the sample fails as "bad_image", the row named in the log."""
    refs, err = await ctx.vision.refs(spec.task, traj.prompt_ids)
    if err:
        log.warning("sample %s skipped: %s", spec.sample_id, err)
        traj.status, traj.failure = "failed", "bad_image"
        return False
    if refs:
        traj.images = refs
        traj.prompt_ids = ctx.vision.expand(traj.prompt_ids)
    return True


async def _observation_images(ctx: RolloutContext, spec: RolloutSpec, traj: Trajectory, obs_ids: list[int],
                              images: Sequence[Any]) -> tuple[list[int], list[Image]] | None:
    """A multi-turn observation of a vision-language policy: its ids expanded and its images (``StepResult.images``,
    one image token in its text each) as wire references, for the caller to append once it fits. None: they do
    not pair up or are of an unsupported type: the sample fails as "bad_image", the row and turn named in the log."""
    if ctx.vision is None:
        raise ValueError(f"task {spec.task.id}: the environment's observation carries {len(images)} image(s) "
                         "(StepResult.images) but the policy is a text-only model; use a vision-language model "
                         "(model.path = \"builtin:vlm\" or an Idefics3 folder) or give the observation as text")
    where = f"row {spec.task.id} turn {traj.turns + 1}"
    refs, err = await ctx.vision.observed(images, obs_ids, where, source="the observation's StepResult.images")
    if err:
        log.warning("sample %s skipped: %s", spec.sample_id, err)
        traj.status, traj.failure = "failed", "bad_image"
        return None
    return (ctx.vision.expand(obs_ids), refs) if refs else (obs_ids, [])


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
    why = "its environment gave another prompt than the checkpoint's" if saved.prompt_ids != traj.prompt_ids else ""
    routes = None if why else _saved_routes(ctx, saved)
    if not why and routes is None:
        why = (f"it was saved with {len(saved.routes)} MoE routes for its {len(saved.response_ids)} tokens, this run's "
               "engines capture one per token (the checkpoint's run captured none: [moe] capture or the model changed)")
    if why:
        ctx.counters["resume/regenerated_tokens"] += len(saved.response_ids)
        log.warning("rollout %s: %s; its %d saved tokens are generated again", saved.sample_id, why,
                    len(saved.response_ids))
        return False
    traj.response_ids = list(saved.response_ids)
    traj.loss_mask = list(saved.loss_mask)
    traj.behav_logp = list(saved.behav_logp)
    traj.versions = list(saved.versions)
    traj.top_logprobs = list(saved.top_logprobs)
    traj.routes = routes or []  # each token's route from the engine that sampled it (r3 replays them)
    traj.restored = saved.restored + 1
    if saved.turns:
        traj.turns, traj.finish_reason = saved.turns, saved.finish_reason
        return True
    return False


def _saved_routes(ctx: RolloutContext, saved: Trajectory) -> list[bytes] | None:
    """The routes to continue ``saved`` with: its own rows, checked (flashrl/moe/routes.py ``check_routes``: a
    malformed or all-zero one raises RoutesError naming the checkpoint), when this run's engines capture routes;
    [] when they capture none (no route for any of its tokens); None when it has not one row per token of this
    run's shape (its tokens are then generated again: no token trains without the route that sampled it)."""
    if ctx.routes is None:
        return []
    n = len(saved.response_ids)
    if len(saved.routes) != n or any(len(r) != ctx.routes.row_bytes for r in saved.routes):
        return None
    check_routes(b"".join(saved.routes), n, ctx.routes, f"(checkpoint's rollout {saved.sample_id})")
    return list(saved.routes)


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
        sent = traj.prompt_ids + traj.response_ids
        req = Generate(
            request_id=f"{spec.sample_id}.{attempt}.{traj.turns}" + (f".{part}" if part else ""),
            # a prompt with images goes compacted: the engine expands each image token itself (vision/tokens.py)
            prompt_ids=ctx.vision.compact(sent) if traj.images else sent,
            max_tokens=max_tokens,
            temperature=spec.temperature,
            top_p=top_p,
            seed=request_seed(cfg.run.seed, uid, idx, traj.turns, done),
            stop_token_ids=stop_ids,
            top_logprobs=cfg.engine.top_logprobs,
            images=traj.images,
            # a VLM's image tokens are never sampled, in every turn (one sampled before a later turn's image would
            # break that image's expansion); the trainer applies the same bias to every row (trainer/step.py)
            banned_token_ids=list(ctx.vision.banned) if ctx.vision is not None else [],
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
        if traj.images and out.prompt_ids != sent:  # token-exactness: the trainer forwards what the engine served
            ctx.checkin(req.request_id)
            raise RuntimeError(f"engine {ctx.engines[i].name} expanded {req.request_id}'s images into other prompt ids "
                               f"than the processor's ({len(out.prompt_ids)} ids, expected {len(sent)})")
        traj.response_ids += out.token_ids
        traj.loss_mask += [1] * n
        traj.behav_logp += out.logprobs
        traj.versions += out.versions
        traj.top_logprobs += out.top_logprobs
        if ctx.routes is not None:  # checked: a malformed or all-zero answer ends the run, naming the engine
            traj.routes += route_rows(out.routes, n, ctx.routes, ctx.engines[i].name)
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


# --------------------------------------------------------------------------- one sample
async def run_sample(ctx: RolloutContext, spec: RolloutSpec, engine: int) -> Trajectory:
    """One sample (``generate_sample``), then, for a training sample of a run that distills, its teacher's
    scores (flashrl/distill: after its engine permit is given back, so scoring overlaps other rollouts' generation).
    A sample whose scores could not be had fails (rollout/failed_teacher_<reason>): never trained without them."""
    traj = await generate_sample(ctx, spec, engine)
    if traj.status != "ok" or spec.group < 0 or ctx.teachers is None:
        return traj
    failed = await ctx.teachers.score_or_reason(traj, spec.task.meta)
    if failed:
        ctx.counters[f"rollout/failed_teacher_{failed}"] += 1
        return _failed(spec, f"teacher_{failed}", traj.attempts, traj.engine)
    return traj


async def generate_sample(ctx: RolloutContext, spec: RolloutSpec, engine: int) -> Trajectory:
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
            if e.kind == "bad_image":  # an image of the row did not load or decode: skipped, counted, never a crash
                log.warning("sample %s (task %s) skipped: %s", spec.sample_id, spec.task.id, e)
                ctx.counters["rollout/failed_bad_image"] += 1
                return _failed(spec, "bad_image", attempt + 1, name)
            log.warning("engine %s refused %s: %s", name, spec.sample_id, e)
            ctx.counters["rollout/failed_engine_error"] += 1
            return _failed(spec, "engine_error", attempt + 1, name)
        finally:
            ctx.router.release(i)
        if (cut := ctx.cut_for(spec.group)) is not None:  # the failed attempt's tokens are no prefix to continue
            cut.started(spec.sample_id, spec.group, spec.index, spec.resume)
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
