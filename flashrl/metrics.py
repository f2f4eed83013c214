"""Run metrics: the live ``Snapshot`` the dashboard renders, and ``metrics.jsonl`` (one object per step).

    controller ---snapshot()---> Snapshot ---> dashboard.py (rich live view, or plain lines)
    controller ---StepRecord---> MetricsWriter ---> runs/<name>/metrics.jsonl   (+ TensorBoard, W&B: [log] keys)
    controller ---on_samples---> SamplesWriter ---> runs/<name>/samples.jsonl   (`flashrl samples RUN_DIR` shows it)
    rollouts   ---add(n)------> core.meters.RateMeter (on the event-loop clock) ---rate()---> Snapshot.*_per_s

A step's record is a flashrl.core.records.StepRecord; its line is ``StepRecord.to_dict()``. Every
trained step's line has at least: step, reward/mean, time/step_s, staleness/mean; and eval/accuracy
whenever the held-out split was evaluated at that step.

Nothing here owns a task or a thread: the controller calls these from its loop.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec

from flashrl.core.records import StepRecord

log = logging.getLogger(__name__)


class EngineStat(msgspec.Struct, kw_only=True):
    """One engine's line on the dashboard."""

    name: str
    inflight: int = 0
    busy_fraction: float = 0.0
    tokens_per_s: float = 0.0
    version: int = 0
    alive: bool = True


class Snapshot(msgspec.Struct, kw_only=True):
    """Everything a user reads on the dashboard, at one instant."""

    run_name: str = ""
    step: int = 0
    total_steps: int = 0
    version: int = 0
    elapsed_s: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    engines: list[EngineStat] = []
    # queue depths
    pending_prompts: int = 0  # admitted, not yet started
    running_samples: int = 0  # rollouts in flight
    buffered_groups: int = 0  # complete groups waiting for the trainer
    # last batch
    staleness_mean: float = 0.0
    staleness_max: int = 0
    trained_tokens: int = 0  # generated tokens the last step trained
    trained_len_mean: float = 0.0  # per trained sample (the length bias of scheduler.stale = "drop" shows here)
    dropped_samples: int = 0  # thrown away for their age during the last step (0 outside drop)
    dropped_tokens: int = 0
    updates_spanned_mean: float = 0.0  # weight updates a trained sample's generation spanned, mean
    interrupted_frac: float = 0.0  # share of trained samples a weight update interrupted mid-generation
    reward_mean: float = 0.0
    weight_sync_s: float = 0.0
    step_s: float = 0.0
    mismatch_kl: float | None = None  # train/inference mismatch of the last step (mismatch/kl); None: not measured
    moe_disagree: float | None = None  # a MoE policy's routing disagreement, engine vs trainer (moe/disagree); None: not measured
    lr: float | None = None  # the last step's learning rate (trainer.lr and its schedule); None: no step yet
    # history for sparklines: (step, value)
    reward_history: list[tuple[int, float]] = []
    # a reward model's (or judge's) reward minus the verifier's, mean per step (reward/rm_gap): reward hacking shows here
    gap_history: list[tuple[int, float]] = []
    # ms from an episode's end to its reward-model score or judge verdict, mean per step: what scoring costs
    latency_history: list[tuple[int, float]] = []
    # on-policy distillation: the per-token reverse KL from the student to its teacher on the trained batch, per step
    teacher_kl_history: list[tuple[int, float]] = []
    eval_history: list[tuple[int, float]] = []
    # counters: dropped / retried / failed rollouts and why (nothing is lost silently)
    counters: dict[str, int] = {}
    status: str = "starting"
    resumed_from: int | None = None  # the checkpoint step this run resumed from
    # what the held-out evals cost so far (controller/evals.py): their wall time, summed; what the train loop
    # waited because of them; how long no training rollout was generating while one ran; one running now
    eval_s: float = 0.0
    eval_trainer_wait_s: float = 0.0
    eval_gen_wait_s: float = 0.0
    eval_running: bool = False


# ----------------------------------------------------------------------------------------------
# rates and summaries


class Summary(msgspec.Struct, kw_only=True, frozen=True):
    """count/mean/std/min/max of a list of numbers; all zero for an empty list."""

    count: int = 0
    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0

    def as_dict(self, prefix: str) -> dict[str, float]:
        """``{"<prefix>/mean": ..., "<prefix>/std": ..., "<prefix>/min": ..., "<prefix>/max": ...}``."""
        return {f"{prefix}/mean": self.mean, f"{prefix}/std": self.std,
                f"{prefix}/min": self.min, f"{prefix}/max": self.max}


def summarize(values: Iterable[float]) -> Summary:
    """Population std (ddof=0): a batch's staleness or reward is the whole population, not a sample."""
    xs = [float(v) for v in values]
    if not xs:
        return Summary()
    mean = math.fsum(xs) / len(xs)
    var = math.fsum((x - mean) ** 2 for x in xs) / len(xs)
    return Summary(count=len(xs), mean=mean, std=math.sqrt(var), min=min(xs), max=max(xs))


# ----------------------------------------------------------------------------------------------
# metrics.jsonl (and tensorboard when installed)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite fields of a record (bools and strings are not plotted)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _open_tensorboard(log_dir: Path) -> Any | None:
    """A tensorboard SummaryWriter, or None (with one log line saying how to get it) if not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        log.info("tensorboard is not installed; metrics go to metrics.jsonl only "
                 "(pip install tensorboard to also write %s)", log_dir)
        return None
    # torch's writer is the one tensorboard itself documents; imported only here so a run without
    # tensorboard never pays for importing torch in the controller.
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def open_wandb(run_dir: Path, name: str, project: str, mode: Literal["offline", "online"], config: dict[str, Any]) -> Any:
    """A W&B run writing under ``run_dir/wandb`` (mode "offline": no network; `wandb sync` uploads later)."""
    import wandb

    return wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config,
                      settings=wandb.Settings(silent=True, console="off"))


class MetricsWriter:
    """Append one JSON object per line to ``path``; flushed per line so a crash loses nothing.

    The same records go, as scalars at the record's ``step``, to TensorBoard event files in
    ``tensorboard_dir`` (skipped, with one log line, when tensorboard is not installed) and to the
    W&B run ``wandb_run`` (see ``open_wandb``), when given.
    """

    def __init__(self, path: Path, *, tensorboard_dir: Path | None = None, wandb_run: Any | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a", buffering=1)
        self._enc = msgspec.json.Encoder()
        self._tb = _open_tensorboard(tensorboard_dir) if tensorboard_dir is not None else None
        self._wandb = wandb_run

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def write(self, record: StepRecord | dict[str, Any]) -> None:
        """One line: a step record's ``to_dict()`` (or a plain dict, written as given)."""
        if isinstance(record, StepRecord):
            record = record.to_dict()
        # msgspec never emits a raw newline inside a JSON document, so one record is one line.
        self._f.write(self._enc.encode(record).decode() + "\n")
        self._f.flush()
        if self._tb is not None:
            step = record.get("step")
            for key, value in _scalars(record).items():
                if key != "step":
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            scalars = {k: v for k, v in _scalars(record).items() if k != "step"}
            step = record.get("step")
            self._wandb.log(scalars, step=int(step) if isinstance(step, int) else None)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            run.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SamplesWriter:
    """``samples.jsonl``: one JSON object per rollout shown (Controller.on_samples), flushed per batch."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a", buffering=1)
        self._enc = msgspec.json.Encoder()

    def write(self, lines: list[dict[str, Any]]) -> None:
        self._f.write("".join(self._enc.encode(x).decode() + "\n" for x in lines))
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [msgspec.json.decode(line) for line in path.read_text().splitlines() if line.strip()]
