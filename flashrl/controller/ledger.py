"""The run's ledger: step records, samples.jsonl lines, the run's meters and histories, and the
controller's checkpoint state made from them (and restored into them on resume).

    train loop ──step_record(s, batch, times)──> StepRecord ──> publisher (the sync adds its times)
    eval task ──eval result─────────────────────────────┘          │
                                                                    v
                                          emit(record) ──> on_step (metrics.jsonl, dashboard)
    checkpoint ──state(version, held, eval_record, ...)──> checkpoint.ControllerState
    resume     ──restore(state)──> counters, histories, emitted_through, the record not yet written

Invariants: exactly one record per step (plus step 0's eval) reaches ``on_step``, in step order
(``emitted_through``: the last step written; a checkpoint stores it, and a record that was held
back when the checkpoint was written goes into it as ``pending_record``, so a resumed run writes it
once, never twice). ``samples_trained`` / ``tokens_trained`` grow only in ``step_record``: once per
trained batch. The suite's counters (flashrl.env.Counting) continue across a resume: the
checkpoint's values plus this process's. Nothing here waits: every method is a plain call on the
controller's event loop.

Meters (``RunMeters``) are the controller's own numbers on the loop clock: per engine the busy
fraction (share of the last RATE_WINDOW_S with >= 1 generate in flight) and generated tokens/s;
overall samples/s (training samples delivered to the buffer). They are made when run() starts
(they read the loop's clock at once) and handed, built, to the rollout context.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from flashrl.checkpoint import CheckpointError, ControllerState, RolloutSnapshot
from flashrl.config import Config
from flashrl.controller.buffer import Group, GroupState, SampleBuffer
from flashrl.controller.scheduler import DataStream, Router
from flashrl.controller.types import Trajectory, env_share, metric_means
from flashrl.core.meters import BusyMeter, RateMeter
from flashrl.core.records import BatchStats, StepRecord
from flashrl.core.staleness import lag_stats
from flashrl.env import Counting, EnvSuite, Stateful
from flashrl.interfaces import EngineClient, Tokenizer
from flashrl.metrics import EngineStat, Snapshot
from flashrl.vision.images import describe

__all__ = ["RATE_WINDOW_S", "Ledger", "RunMeters", "RunSummary", "template_stats"]

log = logging.getLogger(__name__)

# the per-step reward metrics that say how far a model's reward is from the verifier's (flashrl/rewardmodel)
GAP_METRICS = ("rm_gap", "judge_gap")
# a reward model's or judge's scoring, as the suite counts it (flashrl/rewardmodel/client.py, flashrl/judge/client.py):
# (episodes scored, their mean latency in ms since this process started)
LATENCY_COUNTERS = (("rm_scored", "rm_latency_ms"), ("judge_verdicts", "judge_latency_ms"))
# suite counters that say what is true now (a mean, a gauge), not a count: a resumed run's replace the checkpoint's
NOT_SUMMED = ("_latency_ms", "_inflight", "_norm_mean_x1000")  # rm_norm_mean: restored with the suite's state

RATE_WINDOW_S = 10.0  # dashboard rates and busy fractions: "now", not since the start of the run


class RunSummary(msgspec.Struct, kw_only=True):
    """What run() returns: how far the run got, why it stopped, and every counter."""

    steps: int
    version: int
    elapsed_s: float
    samples_trained: int
    tokens_trained: int
    eval_accuracy: float | None
    stop_reason: str  # "steps" | "max_time" | "interrupted" (request_stop: Ctrl-C / SIGTERM)
    counters: dict[str, int]  # the controller's, plus the suite's under "env/<name>" (rounded)
    resumed_from: int | None = None  # the checkpoint step this run started from
    segment_s: float = 0.0  # training time of this run() alone (elapsed_s less the resumed checkpoint's)
    checkpoints: int = 0  # checkpoints written by this run
    checkpoint_s: float = 0.0  # seconds the train loop spent writing them
    last_checkpoint: str | None = None  # the newest checkpoint folder written (None: none, or the last failed)
    # what the held-out evals cost (controller/evals.py): their wall time, summed; what the train loop
    # waited because of them; how long no training rollout was generating while one ran
    eval_s: float = 0.0
    eval_trainer_wait_s: float = 0.0
    eval_gen_wait_s: float = 0.0


class RunMeters:
    """The run's meters, started at ``t0`` on ``clock`` (the loop's): per engine busy and tokens/s, samples/s."""

    def __init__(self, n_engines: int, clock: Callable[[], float], t0: float) -> None:
        self.busy = [BusyMeter(RATE_WINDOW_S, t0) for _ in range(n_engines)]
        self.tokens = [RateMeter(clock=clock, window_s=RATE_WINDOW_S) for _ in range(n_engines)]
        self.samples = RateMeter(clock=clock, window_s=RATE_WINDOW_S)


def template_stats(samples: Sequence[Trajectory]) -> dict[str, float]:
    """The step's rollout/template_* and rollout/retokenize_* metrics (records.BatchStats.template) over the
    samples whose template re-rendering was measured (multi-turn chat trajectories); {} when none was."""
    measured = [t for t in samples if t.template_mismatch >= 0]
    if not measured:
        return {}
    n = len(measured)
    return {
        "template_checked": n,
        "template_mismatch_rate": sum(t.template_mismatch > 0 for t in measured) / n,
        "template_mismatch_tokens": sum(t.template_mismatch for t in measured) / n,
        "retokenize_mismatch_rate": sum(t.retokenize_mismatch > 0 for t in measured) / n,
        "retokenize_mismatch_tokens": sum(t.retokenize_mismatch for t in measured) / n,
    }


def teacher_stats(samples: Sequence[Trajectory]) -> dict[str, float]:
    """The step's rollout/teacher_* metrics over the samples a teacher scored (flashrl/distill): their mean wait
    for the teacher (rollout's end to its scores, ms) and the per-token reverse-KL estimate log pi_student -
    log pi_teacher on their generated tokens (the student's behaviour log-probabilities); {} when none was."""
    scored = [t for t in samples if t.teacher_logp]
    if not scored:
        return {}
    diff = [b - lp for t in scored for b, lp, m in zip(t.behav_logp, t.teacher_logp, t.loss_mask) if m]
    return {
        "teacher_latency_ms": 1000 * sum(t.teacher_s for t in scored) / len(scored),
        "teacher_reverse_kl": sum(diff) / len(diff) if diff else 0.0,
        "teacher_scored": len(scored),
    }


class Ledger:
    """Step records, histories and totals of one run; the controller's part of a checkpoint."""

    def __init__(self, cfg: Config, suite: EnvSuite, tokenizer: Tokenizer, counters: Counter[str],
                 on_step: Callable[[StepRecord], None] | None, counting: Sequence[Counting] = ()) -> None:
        self.cfg = cfg
        self.suite = suite
        # other parts of the run whose counters are logged as the suite's are (env/<name>): the teachers'
        self.counting = list(counting)
        self.tokenizer = tokenizer
        self.counters = counters
        self.on_step = on_step
        self.meters: RunMeters | None = None  # set by run() (the loop clock exists only then)
        self.reward_history: list[tuple[int, float]] = []
        self.gap_history: list[tuple[int, float]] = []  # (step, model reward - verifier), flashrl.rewardmodel
        # (step, mean ms from an episode's end to its reward-model score or verdict, over the episodes scored since
        # the step before); _scored: the suite's (count, summed ms) at the last record
        self.latency_history: list[tuple[int, float]] = []
        self.teacher_kl_history: list[tuple[int, float]] = []  # (step, reverse KL to the teacher), flashrl/distill
        self._scored = (0.0, 0.0)
        self.eval_history: list[tuple[int, float]] = []
        self.last: StepRecord | None = None  # the last trained step's record
        self.samples_trained = 0
        self.tokens_trained = 0
        self.emitted_through = -1  # last step whose record went to on_step (records go out in step order)
        self.checkpoint_s = 0.0  # the last checkpoint's duration, reported in the next step's record
        self.ckpt_wait_s = 0.0  # ... of which waiting for the write before it (time/ckpt_wait_s)
        self.elapsed_before = 0.0  # training time of the run before the checkpoint it resumed from
        self.env_before: dict[str, float] = {}  # the suite's counters at the checkpoint resumed from (they continue)
        self.resumed_from: int | None = None
        self.last_checkpoint: str | None = None  # the newest checkpoint folder written (None: none, or the last failed)
        # a resumed run's record that its checkpoint had not written yet, and whether it waits for its eval
        self.pending: tuple[StepRecord, bool] | None = None
        # the stale-drop counters at the previous step record (a step reports what it adds; a resume
        # starts from the checkpoint's counters, so nothing is counted twice or lost)
        self.dropped_before = (0, 0)
        # steps whose eval has not written their record yet, and later records waiting for it (evals on
        # engines set apart, run.eval_engines, let the train loop run ahead of an eval by any number of steps)
        self._evals_due: list[int] = []
        self._later: list[StepRecord] = []

    # ------------------------------------------------------------------ records
    def step_record(self, s: int, version: int, batch: list[Group], metrics: dict[str, float], *, step_s: float,
                    train_s: float, elapsed: float, sync: dict[str, float]) -> StepRecord:
        """The record of step ``s`` (making ``version``), trained on ``batch``; counts its samples as trained.

        ``metrics``: the trainer's; ``sync``: the step's waits and the weight sync's phases known so far
        (the publisher adds the rest when the sync is done)."""
        samples = [t for g in batch for t in g.samples]
        stale_mean, stale_max = lag_stats(s, (t.version_start for t in samples))
        tokens = sum(t.n_generated for t in samples)
        lineage = [_lineage(t) for t in samples]
        token_lag = sum(s * t.n_generated - vsum for (_, _, vsum), t in zip(lineage, samples))
        dropped = self.dropped_counts()
        d_samples, d_tokens = dropped[0] - self.dropped_before[0], dropped[1] - self.dropped_before[1]
        self.dropped_before = dropped
        rewards = [t.reward for t in samples]
        self.samples_trained += len(samples)
        self.tokens_trained += tokens
        reward_mean = sum(rewards) / len(rewards) if rewards else 0.0
        m = self.meters
        stats = BatchStats(
            reward_mean=reward_mean,
            staleness_mean=stale_mean,
            staleness_max=stale_max,
            step_s=step_s,
            train_s=train_s,
            weight_sync_s=0.0,  # the sync's own time: added when it is done (publisher.py)
            elapsed_s=elapsed,
            samples=len(samples),
            samples_per_s=len(samples) / step_s if step_s > 0 else 0.0,  # trained, over this step
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            run_samples_per_s=self.samples_trained / elapsed if elapsed > 0 else 0.0,  # trained, run average
            run_tokens_per_s=self.tokens_trained / elapsed if elapsed > 0 else 0.0,
            # generated, over the last RATE_WINDOW_S (reading the meters also prunes them)
            rate_samples_per_s=m.samples.rate() if m else 0.0,
            rate_tokens_per_s=sum(r.rate() for r in m.tokens) if m else 0.0,
            turns_mean=sum(t.turns for t in samples) / len(samples) if samples else 0.0,
            response_len_mean=sum(len(t.response_ids) for t in samples) / len(samples) if samples else 0.0,
            tokens=tokens,
            trained_len_mean=tokens / len(samples) if samples else 0.0,
            dropped_samples=d_samples,
            dropped_tokens=d_tokens,
            token_staleness_mean=token_lag / tokens if tokens else 0.0,
            updates_spanned_mean=sum(last - first for first, last, _ in lineage) / len(samples) if samples else 0.0,
            interrupted_frac=sum(last > first for first, last, _ in lineage) / len(samples) if samples else 0.0,
            trainer=dict(metrics),
            reward_metrics=metric_means(samples),
            counters=dict(sorted(self.counters.items())),
            env_counters={k.removeprefix("env/"): v for k, v in self.env_counters().items()},
            template=template_stats(samples) | teacher_stats(samples),
            env_share=env_share(samples),
        )
        # which prompts this step trained (resume checks)
        stats.prompt_uids = [g.uid for g in batch]
        # where the step's time went beyond the trainer's own phases (time/trainer/*): the request's trip
        # (controller encode, transport, fan-out, reply) and the weight sync's parts (flashrl bench steptime)
        if "step_time_s" in metrics:
            stats.transport_s = max(0.0, train_s - float(metrics["step_time_s"]))
        stats.sync = dict(sync)
        if self.checkpoint_s:
            stats.checkpoint_s = self.checkpoint_s  # the checkpoint written before this step
            stats.ckpt_wait_s = self.ckpt_wait_s
            self.checkpoint_s = self.ckpt_wait_s = 0.0
        record = StepRecord(step=s + 1, version=version, batch=stats)
        self.reward_history.append((s + 1, reward_mean))
        gap = next((v for k, v in stats.reward_metrics.items() if k in GAP_METRICS), None)
        if gap is not None:  # a reward model or judge beside the verifier: how far its reward is from the truth
            self.gap_history.append((s + 1, gap))
        latency = self._step_latency_ms()
        if latency is None:  # a distillation teacher's scoring, when no reward model or judge scores
            latency = stats.template.get("teacher_latency_ms")
        if "teacher_reverse_kl" in stats.template:  # distillation: the student's distance to its teacher
            self.teacher_kl_history.append((s + 1, stats.template["teacher_reverse_kl"]))
        if latency is not None:
            self.latency_history.append((s + 1, latency))
        self.last = record
        return record

    def sample_line(self, kind: str, step: int, t: Trajectory, task: Any) -> dict[str, Any]:
        """One rollout as samples.jsonl shows it: text in and out, reward, versions, how it ended, and
        its lineage: ``version_first`` / ``version_last`` (its first and last generated token's
        policy version), ``updates_spanned`` (weight updates during its generation: last - first),
        ``interrupted`` (a weight update landed mid-generation and it resumed on the new weights, its
        tokens so far kept), ``restarts`` (attempts regenerated from scratch: retries, stale aborts),
        ``restored`` (resumes that continued it from a checkpoint's snapshot, its tokens before kept)
        and, for a trained sample (``kind`` "train", trained at step ``step - 1``), ``staleness``
        (trained step - version_first) and ``token_staleness_mean`` (over its tokens, each its own
        version). A sample a distillation teacher scored also gets ``teacher`` (its name) and, per generated token,
        ``response_ids``, ``behav_logp`` (the student's) and ``teacher_logp``. A trained line also gets ``importance_ratio`` (train_lines): the mean over its tokens of
        pi_prox / pi_behav, as the trainer reported it."""
        decode = self.tokenizer.decode
        first, last, vsum = _lineage(t)
        n = t.n_generated
        line = {
            "step": step, "kind": kind, "sample_id": t.sample_id, "task_id": t.task_id,
            "prompt": decode(t.prompt_ids), "response": decode(t.response_ids), "answer": getattr(task, "answer", ""),
            "reward": t.reward, "correct": t.correct, "metrics": dict(t.metrics),
            "policy_versions": sorted({v for v, m in zip(t.versions, t.loss_mask) if m}),
            "finish_reason": t.finish_reason, "turns": t.turns, "response_tokens": n, "engine": t.engine,
            "version_first": first, "version_last": last, "updates_spanned": last - first,
            "interrupted": last > first, "restarts": t.attempts - 1, "restored": t.restored,
        }
        if t.images:  # a vision-language sample: its images by reference (a path, or "png:<sha1>"), never pixels
            line["images"] = [describe(im.ref()) for im in t.images]
        if t.template_mismatch >= 0:  # a multi-turn chat sample: its chat template's re-rendering, measured
            line["template_mismatch_tokens"] = t.template_mismatch
            line["retokenize_mismatch_tokens"] = t.retokenize_mismatch
        if t.teacher_logp:  # distillation: per generated token, the student's behaviour and the teacher's log-prob
            line["teacher"] = t.teacher
            line["response_ids"] = [x for x, m in zip(t.response_ids, t.loss_mask) if m]
            line["behav_logp"] = [x for x, m in zip(t.behav_logp, t.loss_mask) if m]
            line["teacher_logp"] = [x for x, m in zip(t.teacher_logp, t.loss_mask) if m]
        if kind == "train":
            line["staleness"] = step - 1 - first
            line["token_staleness_mean"] = (step - 1) - vsum / n if n else 0.0
        return line

    def train_lines(self, step: int, batch: list[Group], iw: dict[str, float | None] | None = None) -> list[dict[str, Any]]:
        """log.samples_per_step lines of a trained batch, spread over its groups: the first sample of each
        group, then the second, ... ``iw``: the trainer's mean behaviour weight per sample id
        (TrainResult.sample_iw), written as ``importance_ratio`` (null: not reported)."""
        picked = [(g.task, g.samples[j]) for j in range(self.cfg.rollout.group_size) for g in batch if j < len(g.samples)]
        lines = [self.sample_line("train", step, t, task) for task, t in picked[:self.cfg.log.samples_per_step]]
        for line in lines:
            line["importance_ratio"] = (iw or {}).get(line["sample_id"])
        return lines

    def eval_due(self, step: int) -> None:
        """Step ``step``'s record waits for its eval: later records wait for it (records go out in step order)."""
        self._evals_due.append(step)

    def emit(self, record: StepRecord) -> None:
        due = self._evals_due
        if due and record.step > due[0]:
            self._later.append(record)  # after the record of an eval still running
            return
        if due and record.step == due[0]:
            due.pop(0)
        self._write(record)
        if not due or self._later and self._later[0].step < due[0]:
            later = sorted(self._later, key=lambda r: r.step)
            self._later = [r for r in later if due and r.step > due[0]]
            for r in later:
                if not (due and r.step > due[0]):
                    self._write(r)

    def _write(self, record: StepRecord) -> None:
        self.emitted_through = max(self.emitted_through, record.step)
        if self.on_step is not None:
            self.on_step(record)

    # ------------------------------------------------------------------ counters
    def dropped_counts(self) -> tuple[int, int]:
        """(samples, generated tokens) thrown away for their age so far: stale drops in the buffer and
        stale aborts of multi-turn rollouts (stale = drop only; 0 in wait and partial)."""
        c = self.counters
        return c["stale/dropped_samples"] + c["rollout/aborted_stale"], c["stale/dropped_tokens"]

    def env_counters(self) -> dict[str, float]:
        """The suite's own counters (flashrl.env.Counting: envs/faults.py, envs/remote.py) as ``env/<name>``;
        a resumed run's counts continue from the checkpoint's, its means and gauges (``NOT_SUMMED``) are this
        process's."""
        out = dict(self.env_before)
        sources = [self.suite] if isinstance(self.suite, Counting) else []
        for source in [*sources, *self.counting]:
            for k, v in source.counters.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    summed = not k.endswith(NOT_SUMMED)
                    out[f"env/{k}"] = (out.get(f"env/{k}", 0) if summed else 0) + v
        return dict(sorted(out.items()))

    def _step_latency_ms(self) -> float | None:
        """The mean scoring latency of the episodes a reward model or judge scored since the last call (None: none
        scored, or neither serves this run)."""
        counters = self.suite.counters if isinstance(self.suite, Counting) else {}
        for count_key, mean_key in LATENCY_COUNTERS:
            if count_key in counters:
                n = float(counters[count_key])
                total = n * float(counters.get(mean_key, 0.0))
                dn, dt = n - self._scored[0], total - self._scored[1]
                self._scored = (n, total)
                return dt / dn if dn > 0 else None
        return None

    def all_counters(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update({k: round(v) for k, v in self.env_counters().items()})  # e.g. env/delay_s is a float
        return out

    def summary(self, *, version: int, elapsed: float, stop: str, checkpoints: int, checkpoint_s: float) -> RunSummary:
        """What run() returns, from this ledger's totals."""
        return RunSummary(
            steps=version,
            version=version,
            elapsed_s=elapsed,
            samples_trained=self.samples_trained,
            tokens_trained=self.tokens_trained,
            eval_accuracy=self.eval_history[-1][1] if self.eval_history else None,
            stop_reason=stop,
            counters=self.all_counters(),
            resumed_from=self.resumed_from,
            segment_s=elapsed - self.elapsed_before,
            checkpoints=checkpoints,
            checkpoint_s=checkpoint_s,
            last_checkpoint=self.last_checkpoint,
        )

    def snapshot(self, *, now: float, elapsed: float, version: int, status: str, engines: list[EngineClient],
                 engine_versions: list[int], router: Router, buffer: SampleBuffer, last_sync_s: float) -> Snapshot:
        """The dashboard's view at ``now`` (Controller.snapshot gives the controller's parts)."""
        m = self.meters
        stats = [
            EngineStat(
                name=e.name,
                inflight=router.inflight[i],
                busy_fraction=m.busy[i].fraction(now) if m else 0.0,
                tokens_per_s=m.tokens[i].rate() if m else 0.0,
                version=engine_versions[i],
                alive=router.alive[i],
            )
            for i, e in enumerate(engines)
        ]
        groups = buffer.groups.values()
        last = self.last.batch if self.last is not None else None
        return Snapshot(
            run_name=self.cfg.run.name,
            step=version,
            total_steps=self.cfg.run.steps,
            version=version,
            elapsed_s=elapsed,
            samples_per_s=m.samples.rate() if m else 0.0,
            tokens_per_s=sum(e.tokens_per_s for e in stats),
            engines=stats,
            pending_prompts=sum(g.state is GroupState.ADMITTED for g in groups),
            running_samples=sum(router.inflight),
            buffered_groups=len(buffer.complete),
            staleness_mean=float(last.staleness_mean) if last else 0.0,
            staleness_max=int(last.staleness_max) if last else 0,
            trained_tokens=last.tokens if last else 0,
            trained_len_mean=last.trained_len_mean if last else 0.0,
            dropped_samples=last.dropped_samples if last else 0,
            dropped_tokens=last.dropped_tokens if last else 0,
            updates_spanned_mean=last.updates_spanned_mean if last else 0.0,
            interrupted_frac=last.interrupted_frac if last else 0.0,
            reward_mean=float(last.reward_mean) if last else 0.0,
            weight_sync_s=last_sync_s,
            step_s=float(last.step_s) if last else 0.0,
            mismatch_kl=last.trainer.get("mismatch/kl") if last else None,
            moe_disagree=last.trainer.get("moe/disagree") if last else None,
            lr=last.trainer.get("lr") if last else None,
            reward_history=list(self.reward_history),
            gap_history=list(self.gap_history),
            latency_history=list(self.latency_history),
            teacher_kl_history=list(self.teacher_kl_history),
            eval_history=list(self.eval_history),
            counters=self.all_counters(),
            status=status,
            resumed_from=self.resumed_from,
        )

    # ------------------------------------------------------------------ checkpoint state
    def state(self, version: int, elapsed: float, held: StepRecord | None, eval_record: StepRecord | None,
              stream: DataStream, buffer: SampleBuffer,
              cut: tuple[RolloutSnapshot, list[int]] | None = None) -> ControllerState:
        """The controller's part of a checkpoint at ``version`` (call between steps).

        ``held``: a step record the train loop holds back; ``eval_record``: the record a running eval
        will complete. ``cut``: the feed's snapshot of the untrained work and the uids it leaves to
        re-admission (feed.Feed.snapshot, taken in this same step); without one, every outstanding
        group (admitted, generating, complete but untrained) is recorded by uid only and re-admitted
        first on resume (flashrl/checkpoint.py says why).
        """
        pending: dict[str, Any] | None = None
        pending_eval = False
        if self.emitted_through < version:
            if held is not None and held.step == version:
                pending = held.to_dict()
            elif eval_record is not None and eval_record.step == version:
                pending = msgspec.structs.replace(eval_record, eval=None).to_dict()
                pending_eval = True
        outstanding = {g.uid for g in buffer.groups.values()} if cut is None else set(cut[1])
        readmit = sorted(outstanding | set(stream.pending_readmit))
        return ControllerState(
            step=version,
            version=version,
            elapsed_s=elapsed,
            samples_trained=self.samples_trained,
            tokens_trained=self.tokens_trained,
            seed=self.cfg.run.seed,
            train_size=stream.size,
            next_uid=stream.uid,
            readmit=readmit,
            dropped_uids=list(buffer.dropped_uids),
            counters=dict(self.counters),
            env_counters=self.env_counters(),
            env_state=self.suite.checkpoint_state() if isinstance(self.suite, Stateful) else {},
            reward_history=list(self.reward_history),
            eval_history=list(self.eval_history),
            gap_history=list(self.gap_history),
            latency_history=list(self.latency_history),
            metrics_through=min(self.emitted_through, version),
            pending_record=pending,
            pending_eval=pending_eval,
            rollouts=cut[0] if cut is not None else None,
        )

    async def save(self, writer: Any, state: ControllerState, clock: Callable[[], float], *, wait: bool = True) -> None:
        """Write ``state`` with ``writer`` (a checkpoint.CheckpointWriter); a failure is logged, counted
        (``checkpoint/failed``) and survived: the previous checkpoint stays the latest. The time the
        train loop spent in it goes into the next step's record (``checkpoint_s``; of it, the wait for
        an earlier write still in flight: ``ckpt_wait_s``). ``wait=False``: a background checkpoint is
        recorded (``last_checkpoint``, the resume point the summary names) only once complete."""
        t0 = clock()
        heard = False

        def done(path: Path | None, err: CheckpointError | None) -> None:
            nonlocal heard
            heard = True
            if err is not None:
                self.counters["checkpoint/failed"] += 1
                self.last_checkpoint = None
                log.error("%s; training goes on", err)
            else:
                self.last_checkpoint = str(path)
                log.info("checkpoint %s complete, %.2f s after it was requested", path, clock() - t0)

        try:
            await writer.save(state, wait=wait, on_done=done)
        except CheckpointError as e:
            if not heard:  # a failure the writer reported only by raising (the checkpoint it had is intact)
                self.counters["checkpoint/failed"] += 1
                log.error("%s; training goes on", e)
        finally:
            self.checkpoint_s = clock() - t0
            self.ckpt_wait_s = getattr(writer, "last_wait_s", 0.0)

    def restore(self, st: ControllerState) -> None:
        """This ledger's part of a resume (the controller restores version, stream, buffer and staleness)."""
        self.samples_trained = st.samples_trained
        self.tokens_trained = st.tokens_trained
        self.counters.update(st.counters)
        self.dropped_before = self.dropped_counts()  # what the checkpoint's steps already reported
        self.counters["resume/readmitted_groups"] += len(st.readmit)
        self.reward_history = [(int(a), float(b)) for a, b in st.reward_history]
        self.eval_history = [(int(a), float(b)) for a, b in st.eval_history]
        self.gap_history = [(int(a), float(b)) for a, b in st.gap_history]
        self.latency_history = [(int(a), float(b)) for a, b in st.latency_history]
        self.elapsed_before = st.elapsed_s
        self.emitted_through = st.metrics_through
        self.env_before = dict(st.env_counters)
        if st.env_state and isinstance(self.suite, Stateful):
            self.suite.restore_state(st.env_state)
        self.resumed_from = st.step
        self.pending = (StepRecord.from_dict(st.pending_record), st.pending_eval) if st.pending_record is not None else None


def _lineage(t: Trajectory) -> tuple[int, int, int]:
    """(first, last generated token's version, sum of the generated tokens' versions); a sample with no
    generated token: its request's version for both, sum 0."""
    vs = t.generated_versions()
    if not vs:
        return t.version_sent, t.version_sent, 0
    return vs[0], vs[-1], sum(vs)
