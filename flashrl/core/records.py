"""Step records: what one training step (and its held-out eval) measured, typed.

    controller ---StepRecord---> on_step ---> metrics.MetricsWriter ---to_dict()---> metrics.jsonl
                                          ---> dashboard.Dashboard.step (last_record)
    controller ledger.last (StepRecord) ---> Snapshot (staleness, reward, step and sync times, mismatch)
    checkpoint ControllerState.pending_record  <---to_dict() / from_dict()---  a record not yet written

A ``StepRecord`` has the fields every record has (``step``, ``version``); a trained step's batch
statistics and timings (``batch``: ``BatchStats``), the held-out eval when one ran at that step
(``eval``: ``EvalStats``) and the run's memory (``memory_gib``, written by ``flashrl run``). The parts
whose keys are open-ended are typed dicts: the trainer's metrics, per-trajectory reward metrics,
controller counters, the suite's counters and the weight-sync phases.

``to_dict()`` is the metrics.jsonl line, keys and order exactly as the benches and tools read them:

    <trainer metrics>  step version reward/mean staleness/mean staleness/max time/step_s time/train_s
    time/weight_sync_s time/elapsed_s samples samples_per_s tokens_per_s run/samples_per_s
    run/tokens_per_s rate/samples_per_s rate/tokens_per_s turns/mean response_len/mean tokens/trained
    len/trained_mean dropped/samples dropped/tokens staleness/token_mean lineage/updates_spanned_mean
    lineage/interrupted_frac
    reward/<metric> count/<counter> env/<counter> rollout/<template check> prompt_uids time/train/transport_s
    time/sync/<phase> engine/<stepping|commands|busy> time/checkpoint_s time/ckpt_wait_s time/ckpt_write_s
    time/eval_wait_s rollout/env_share eval/accuracy
    eval/reward_mean eval/reward/<metric> time/eval_s time/eval/trainer_wait_s time/eval/gen_wait_s
    eval/engine_share mem/total_gib cpu/total_s

``rollout/template_*`` / ``rollout/retokenize_*`` (steps that trained multi-turn chat samples only):
how far the chat template's re-rendering of each trained conversation is from its trained tokens
(``BatchStats.template``; controller/rollout.py, models/chat.py ``template_mismatch``).

What evals cost: ``time/eval_wait_s`` (every trained step) is what that step's train loop waited
because of an eval (controller/evals.py); an eval's own line adds its wall time (``time/eval_s``),
what the train loop waited because of it (``time/eval/trainer_wait_s``), how long no training
rollout was generating while it ran (``time/eval/gen_wait_s``) and its share of the tokens generated
while it ran (``eval/engine_share``).

A trainer metric whose name the record uses itself (``OWN_KEYS``: "samples", "reward/mean", ...)
is written as ``train/<name>``; a reward metric whose ``reward/<name>`` is an own key as
``reward/extra_<name>``. ``from_dict`` reads a line back (trainer metrics are the keys before
``step``), so ``StepRecord.from_dict(line).to_dict() == line``.

Pure: no sockets, torch, tasks or clocks.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["OWN_KEYS", "BatchStats", "EvalStats", "StepRecord"]

# Keys the record writes itself; a trainer metric of the same name goes under "train/<key>".
OWN_KEYS = frozenset(
    {"step", "version", "reward/mean", "staleness/mean", "staleness/max", "time/step_s", "time/train_s",
     "time/weight_sync_s", "time/elapsed_s", "samples_per_s", "tokens_per_s", "samples", "eval/accuracy",
     "run/samples_per_s", "run/tokens_per_s", "rate/samples_per_s", "rate/tokens_per_s", "prompt_uids",
     "time/checkpoint_s", "tokens/trained", "len/trained_mean", "dropped/samples", "dropped/tokens",
     "staleness/token_mean", "lineage/updates_spanned_mean", "lineage/interrupted_frac", "time/eval_wait_s",
     "time/ckpt_wait_s", "time/ckpt_write_s"}
)

# BatchStats' fixed fields and their metrics.jsonl keys, in line order.
_BATCH_KEYS: dict[str, str] = {
    "reward/mean": "reward_mean",
    "staleness/mean": "staleness_mean",
    "staleness/max": "staleness_max",
    "time/step_s": "step_s",
    "time/train_s": "train_s",
    "time/weight_sync_s": "weight_sync_s",
    "time/elapsed_s": "elapsed_s",
    "samples": "samples",
    "samples_per_s": "samples_per_s",
    "tokens_per_s": "tokens_per_s",
    "run/samples_per_s": "run_samples_per_s",
    "run/tokens_per_s": "run_tokens_per_s",
    "rate/samples_per_s": "rate_samples_per_s",
    "rate/tokens_per_s": "rate_tokens_per_s",
    "turns/mean": "turns_mean",
    "response_len/mean": "response_len_mean",
    "tokens/trained": "tokens",
    "len/trained_mean": "trained_len_mean",
    "dropped/samples": "dropped_samples",
    "dropped/tokens": "dropped_tokens",
    "staleness/token_mean": "token_staleness_mean",
    "lineage/updates_spanned_mean": "updates_spanned_mean",
    "lineage/interrupted_frac": "interrupted_frac",
}
# The other keys that read back into one field each (from_dict): BatchStats' optional or later
# fields, and EvalStats' (to_dict writes them where the module doc says, around the prefixed ones).
_BATCH_MORE_KEYS: dict[str, str] = {
    "time/train/transport_s": "transport_s",
    "time/checkpoint_s": "checkpoint_s",
    "time/ckpt_wait_s": "ckpt_wait_s",
    "time/ckpt_write_s": "ckpt_write_s",
    "time/eval_wait_s": "eval_wait_s",
    "rollout/env_share": "env_share",
}
_EVAL_KEYS: dict[str, str] = {
    "eval/accuracy": "accuracy",
    "eval/reward_mean": "reward_mean",
    "time/eval_s": "eval_s",
    "time/eval/trainer_wait_s": "trainer_wait_s",
    "time/eval/gen_wait_s": "gen_wait_s",
    "eval/engine_share": "engine_share",
}


def _metric_key(prefix: str, name: str) -> str:
    key = prefix + name
    return key if key not in OWN_KEYS else prefix + "extra_" + name


def _metric_name(prefix: str, key: str) -> str:
    name = key[len(prefix):]
    if name.startswith("extra_") and prefix + name[len("extra_"):] in OWN_KEYS:
        return name[len("extra_"):]
    return name


class BatchStats(msgspec.Struct, kw_only=True):
    """A trained step: its batch, where its time went, and the counters at its end."""

    reward_mean: float
    staleness_mean: float
    staleness_max: int
    step_s: float  # since the previous step ended
    train_s: float  # the trainer's train_step call
    weight_sync_s: float  # publishing the new version to the engines
    elapsed_s: float  # since the run began (a resumed run: since the first run began)
    samples: int
    samples_per_s: float  # trained, over this step
    tokens_per_s: float
    run_samples_per_s: float  # trained, run average
    run_tokens_per_s: float
    rate_samples_per_s: float  # generated, over the controller's rate window
    rate_tokens_per_s: float
    turns_mean: float
    response_len_mean: float
    # Lineage of the trained samples (defaults: lines written before these existed read back as 0).
    tokens: int = 0  # generated tokens trained at this step (observation tokens not counted)
    trained_len_mean: float = 0.0  # generated tokens per trained sample (the length bias shows here)
    dropped_samples: int = 0  # samples thrown away for their age since the previous step (0 outside stale = drop)
    dropped_tokens: int = 0  # their generated tokens
    token_staleness_mean: float = 0.0  # mean over trained tokens of step - the token's own version
    updates_spanned_mean: float = 0.0  # weight updates a trained sample's generation spanned (last - first version)
    interrupted_frac: float = 0.0  # share of trained samples whose generation a weight update interrupted
    trainer: dict[str, float] = {}  # the trainer's metrics (loss, grad_norm, mismatch/kl, time/trainer/*, ...)
    reward_metrics: dict[str, float] = {}  # mean per-trajectory metric (a reward function's extras), by name
    counters: dict[str, int] = {}  # the controller's counters
    env_counters: dict[str, float] = {}  # the suite's counters (flashrl.env.Counting), by name
    # the trained multi-turn chat samples against the template's re-rendering of their conversations
    # (Ledger.step_record): template_checked (samples measured), template_mismatch_rate (share whose
    # re-rendering differs), template_mismatch_tokens (mean differing tokens), retokenize_mismatch_rate /
    # _tokens (the same for decoding and re-encoding the generated turns alone); written as rollout/<key>;
    # empty when no trained sample was measured
    template: dict[str, float] = {}
    prompt_uids: list[int] | None = None  # which prompts this step trained (resume checks)
    transport_s: float | None = None  # the train request's trip beyond the trainer's own step time
    sync: dict[str, float] = {}  # weight-sync phases in seconds: quiesce_s, prepare_s, trainer/*, send_s, engine/*
    # the least busy engine between the previous sync and this step's, fractions of the wall time:
    # stepping (vLLM's step), commands (adding requests, aborts, weight loads), busy (their sum)
    engine: dict[str, float] = {}
    checkpoint_s: float | None = None  # the checkpoint written before this step: the time the train loop spent in it
    # ... of which it waited for the previous checkpoint's background write to finish (a save waits for the one in flight)
    ckpt_wait_s: float | None = None
    ckpt_write_s: float | None = None  # background checkpoint writes that completed during this step: their whole duration
    eval_wait_s: float = 0.0  # what this step waited because of an eval (a batch that could not be fresh before it ended)
    # the trained trajectories' time inside env.reset/env.step over their whole time (start to end),
    # summed over the batch: how much of an agentic rollout's life is the environment's (0 single-turn)
    env_share: float = 0.0


class EvalStats(msgspec.Struct, kw_only=True):
    """The held-out eval of a step's weights."""

    accuracy: float
    reward_mean: float
    reward_metrics: dict[str, float] = {}
    eval_s: float = 0.0  # wall time, from its first request's readiness to its result
    trainer_wait_s: float = 0.0  # the train loop's waits because of this eval
    gen_wait_s: float = 0.0  # seconds no training rollout was generating while it ran
    engine_share: float | None = None  # its tokens / every token generated while it ran (None: not metered)


class StepRecord(msgspec.Struct, kw_only=True):
    """One metrics.jsonl line: step 0's eval, or a trained step (``batch``) with its eval if one ran."""

    step: int
    version: int
    batch: BatchStats | None = None
    eval: EvalStats | None = None
    memory_gib: float | None = None  # mem/total_gib (flashrl run's GPU memory reading)
    cpu_s: float | None = None  # cpu/total_s: CPU seconds the run's processes used so far (user + system, all of them)

    def to_dict(self) -> dict[str, Any]:
        """The metrics.jsonl line (see the module doc for keys and order)."""
        b = self.batch
        out: dict[str, Any] = {}
        if b is not None:
            for k, v in b.trainer.items():
                out[f"train/{k}" if k in OWN_KEYS else k] = v
        out["step"] = self.step
        out["version"] = self.version
        if b is not None:
            for key, field in _BATCH_KEYS.items():
                out[key] = getattr(b, field)
            out.update({_metric_key("reward/", k): v for k, v in b.reward_metrics.items()})
            out.update({f"count/{k}": v for k, v in b.counters.items()})
            out.update({f"env/{k}": v for k, v in b.env_counters.items()})
            out.update({f"rollout/{k}": v for k, v in b.template.items()})
            if b.prompt_uids is not None:
                out["prompt_uids"] = list(b.prompt_uids)
            if b.transport_s is not None:
                out["time/train/transport_s"] = b.transport_s
            out.update({f"time/sync/{k}": v for k, v in b.sync.items()})
            out.update({f"engine/{k}": v for k, v in b.engine.items()})
            if b.checkpoint_s is not None:
                out["time/checkpoint_s"] = b.checkpoint_s
            if b.ckpt_wait_s is not None:
                out["time/ckpt_wait_s"] = b.ckpt_wait_s
            if b.ckpt_write_s is not None:
                out["time/ckpt_write_s"] = b.ckpt_write_s
            out["time/eval_wait_s"] = b.eval_wait_s
            out["rollout/env_share"] = b.env_share
        if self.eval is not None:
            e = self.eval
            out["eval/accuracy"] = e.accuracy
            out["eval/reward_mean"] = e.reward_mean
            out.update({_metric_key("eval/reward/", k): v for k, v in e.reward_metrics.items()})
            out["time/eval_s"] = e.eval_s
            out["time/eval/trainer_wait_s"] = e.trainer_wait_s
            out["time/eval/gen_wait_s"] = e.gen_wait_s
            if e.engine_share is not None:
                out["eval/engine_share"] = e.engine_share
        if self.memory_gib is not None:
            out["mem/total_gib"] = self.memory_gib
        if self.cpu_s is not None:
            out["cpu/total_s"] = self.cpu_s
        return out

    @classmethod
    def from_dict(cls, line: dict[str, Any]) -> StepRecord:
        """The record of a metrics.jsonl line written by ``to_dict`` (a checkpoint's pending record)."""
        if "step" not in line or "version" not in line:
            raise ValueError(f"a step record needs 'step' and 'version', got keys {sorted(line)}")
        keys = list(line)
        before = keys[:keys.index("step")]  # the trainer's metrics come first
        trainer = {k[len("train/"):] if k.startswith("train/") and k[len("train/"):] in OWN_KEYS else k: line[k]
                   for k in before}
        fixed: dict[str, Any] = {}
        reward: dict[str, float] = {}
        counters: dict[str, int] = {}
        env: dict[str, float] = {}
        template: dict[str, float] = {}
        sync: dict[str, float] = {}
        engine: dict[str, float] = {}
        ev: dict[str, Any] = {}
        eval_metrics: dict[str, float] = {}
        memory: float | None = None
        cpu: float | None = None
        for k in keys[keys.index("step"):]:
            v = line[k]
            if k in ("step", "version"):
                continue
            if k in _BATCH_KEYS:
                fixed[_BATCH_KEYS[k]] = v
            elif k == "prompt_uids":
                fixed["prompt_uids"] = list(v)
            elif k in _BATCH_MORE_KEYS:
                fixed[_BATCH_MORE_KEYS[k]] = v
            elif k in _EVAL_KEYS:
                ev[_EVAL_KEYS[k]] = v
            elif k == "mem/total_gib":
                memory = v
            elif k == "cpu/total_s":
                cpu = v
            elif k.startswith("eval/reward/"):
                eval_metrics[_metric_name("eval/reward/", k)] = v
            elif k.startswith("time/sync/"):
                sync[k[len("time/sync/"):]] = v
            elif k.startswith("engine/"):
                engine[k[len("engine/"):]] = v
            elif k.startswith("count/"):
                counters[k[len("count/"):]] = v
            elif k.startswith("env/"):
                env[k[len("env/"):]] = v
            elif k.startswith("rollout/"):
                template[k[len("rollout/"):]] = v
            elif k.startswith("reward/"):
                reward[_metric_name("reward/", k)] = v
            else:
                raise ValueError(f"step record key {k!r} after 'step' is not one a step record writes")
        batch = None
        if fixed or trainer:
            missing = [k for k, f in _BATCH_KEYS.items() if f not in fixed]
            if missing:
                raise ValueError(f"step record of step {line['step']} lacks {missing}")
            batch = BatchStats(**fixed, trainer=trainer, reward_metrics=reward, counters=counters,
                               env_counters=env, template=template, sync=sync, engine=engine)
        evs = None
        if ev:
            evs = EvalStats(**ev, reward_metrics=eval_metrics)
        return cls(step=int(line["step"]), version=int(line["version"]), batch=batch, eval=evs, memory_gib=memory,
                   cpu_s=cpu)
