"""Resuming a run: which checkpoint it starts from (``find_checkpoint``, ``prepare_resume``: a verified one,
a corrupt newest one passed over), which config changes it may make (``checkpoint.SAFE_TO_CHANGE``), and
the run folder put back to that checkpoint (``continue_metrics``, ``prepare_folder``). The checkpoint's
format, writer and checks are flashrl/checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec

from flashrl.checkpoint import (
    _STEP_RE,
    CONFIG_FILE,
    CONTROLLER_FILE,
    SAFE_TO_CHANGE,
    TRAINER_DIR,
    CheckpointError,
    ControllerState,
    list_checkpoints,
    read_latest,
    verify,
)
from flashrl.config import Config, ConfigError, load
from flashrl.core.lr_schedule import scheduled_lr

log = logging.getLogger("flashrl.checkpoint")



class Resume(msgspec.Struct, kw_only=True):
    """A verified checkpoint to start a run from (``prepare_resume``)."""

    path: str  # the step-N folder
    state: ControllerState
    skipped: list[str] = []  # newer checkpoints found corrupt and passed over (with why)

    @property
    def trainer_dir(self) -> Path:
        return Path(self.path) / TRAINER_DIR

    @property
    def step(self) -> int:
        return self.state.step


def find_checkpoint(run_dir: Path, explicit: Path | None = None) -> Resume:
    """The checkpoint to resume: ``explicit`` (a step folder, a checkpoints folder or a run folder), else
    the latest of ``run_dir``. Without an explicit step folder, a corrupt newest checkpoint is skipped
    for the one before (named in ``skipped`` and the log); an explicit corrupt one is an error."""
    if explicit is not None:
        explicit = Path(explicit)
        if (explicit / CONTROLLER_FILE).exists() or _STEP_RE.match(explicit.name):
            return Resume(path=str(explicit), state=verify(explicit))
        root = explicit / "checkpoints" if (explicit / "checkpoints").is_dir() else explicit
    else:
        root = Path(run_dir) / "checkpoints"
    if not list_checkpoints(root):
        where = explicit if explicit is not None else run_dir
        raise CheckpointError(f"--resume: no checkpoint in {root} (nothing to resume in {where}); "
                              "run without --resume to start fresh, or pass --resume PATH to a step-<N> folder")
    r, skipped = newest_complete(root)
    if r is None:
        raise CheckpointError(f"--resume: every checkpoint in {root} is unusable:\n  " + "\n  ".join(skipped))
    return r


def newest_complete(root: Path) -> tuple[Resume | None, list[str]]:
    """The checkpoint of ``root`` (a checkpoints folder) a resume takes: the one ``latest`` names, else (no
    pointer: deleted, or a crash between a folder's rename and the pointer's write) the newest complete
    ``step-N`` folder; a corrupt one is passed over for the one before. None when none is usable; with
    why each was passed over. The one rule for what counts as saved progress: ``flashrl run --resume``,
    run.auto_resume, the supervisor's restart and a fresh start's set-aside all ask it."""
    found = list_checkpoints(root)
    latest = read_latest(root) if found else None
    order = [p for _, p in reversed(found)]
    if latest is not None and latest in order:  # the pointer wins; newer folders are never half-written
        order = order[order.index(latest):]
    skipped: list[str] = []
    for p in order:
        try:
            state = verify(p)
        except CheckpointError as e:
            log.error("checkpoint %s is unusable (%s); trying the one before", p, e)
            skipped.append(str(e))
            continue
        return Resume(path=str(p), state=state, skipped=skipped), skipped
    return None, skipped


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)


def config_changes(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, new value) for every key that differs and may not change on resume."""
    a, b = _flatten(msgspec.to_builtins(old)), _flatten(msgspec.to_builtins(new))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not _safe(k)]


def prepare_resume(cfg: Config, explicit: Path | None = None) -> Resume:
    """Find, verify and check a checkpoint against ``cfg`` before anything starts (CheckpointError if not).

    The entry point for every resume: ``flashrl run --resume``, and run.auto_resume after a failure.
    """
    r = find_checkpoint(cfg.run_dir, explicit)
    try:
        old = load(Path(r.path) / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(f"{Path(r.path) / CONFIG_FILE}: cannot be read back ({e})") from None
    changed = config_changes(old, cfg)
    if changed:
        what = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed)
        raise CheckpointError(
            f"cannot resume {r.path}: the config changed in keys that change what is trained ({what}). "
            f"Put back the checkpoint's values (its config is {Path(r.path) / CONFIG_FILE}) or start a new run "
            f"(another run.name). Keys that may change on resume: {', '.join(SAFE_TO_CHANGE)}"
        )
    done = finished(cfg, r)
    if done:
        raise CheckpointError(done)
    jump = lr_jump(old, cfg, r.state.step)
    if jump:
        log.warning("%s", jump)
    return r


def finished(cfg: Config, r: Resume) -> str:
    """Why checkpoint ``r`` leaves nothing to train under ``cfg`` (its run.steps, run.max_time_s), with the
    fix; '' when it does. A resume refuses such a checkpoint; the supervisor ends a run at one (finished)."""
    if r.state.step >= cfg.run.steps:
        return (f"{r.path} is at step {r.state.step} and run.steps = {cfg.run.steps}: nothing left to train; "
                f"raise run.steps (e.g. --set run.steps={r.state.step * 2}) to continue")
    if cfg.run.max_time_s > 0 and r.state.elapsed_s >= cfg.run.max_time_s:
        return (f"{r.path} has used {r.state.elapsed_s:.0f} s of run.max_time_s = {cfg.run.max_time_s:g}: "
                "raise run.max_time_s (or set it to 0) to continue")
    return ""


class RestartPlan(msgspec.Struct, frozen=True):
    """What a restart of ``cfg``'s run does (``restart_plan``): "resume" from ``checkpoint`` (a step-N
    folder), "fresh" (no complete checkpoint: the run starts over), or "finished" (the newest complete
    checkpoint leaves nothing to train: ``why``)."""

    action: str
    checkpoint: str = ""
    step: int = 0
    why: str = ""

    def describe(self) -> str:
        """What the restart's command does, for the supervisor's log."""
        if self.action == "resume":
            return f"--resume from {Path(self.checkpoint).name}"
        if self.action == "fresh":
            return f"fresh start: {self.why}"
        return f"finished: {self.why}"


def restart_plan(cfg: Config) -> RestartPlan:
    """How a run that died continues, by the rule a resume uses (``newest_complete``): a complete step-N
    folder counts with or without ``latest``. A ``latest`` that cannot be read raises CheckpointError (its
    message says the fix), as a resume would."""
    root = cfg.run_dir / "checkpoints"
    r, skipped = newest_complete(root)
    if r is None:
        why = f"no complete checkpoint in {root}" + (f" ({len(skipped)} unusable: {'; '.join(skipped)})"
                                                      if skipped else "")
        return RestartPlan(action="fresh", why=why)
    done = finished(cfg, r)
    return RestartPlan(action="finished" if done else "resume", checkpoint=r.path, step=r.step, why=done)


def lr_jump(old: Config, new: Config, step: int) -> str:
    """A warning when a resume at ``step`` changes the lr the schedule gives (run.steps changed under a decay),
    else ''. The schedule decays to its end at run.steps, so extending a decayed run raises the lr again."""
    if step <= 0:
        return ""
    was, now = scheduled_lr(old.trainer, old.run.steps, step), scheduled_lr(new.trainer, new.run.steps, step)
    if math.isclose(was, now, rel_tol=1e-9, abs_tol=0.0):
        return ""
    return (f"run.steps {old.run.steps} -> {new.run.steps} with trainer.lr_decay = {new.trainer.lr_decay!r}: the lr "
            f"of the next step goes from {was:.3g} (the checkpoint's schedule) to {now:.3g}, and decays to "
            f"{scheduled_lr(new.trainer, new.run.steps, new.run.steps - 1):.3g} at step {new.run.steps}; keep run.steps = "
            f"{old.run.steps} to finish the checkpoint's schedule")


def continue_metrics(metrics: Path, resume: Resume, *, through: int | None = None) -> int:
    """Make ``metrics`` hold exactly the lines up to the checkpoint's ``metrics_through`` step.

    Lines after it (written after the checkpoint, by the run that then died) are dropped, so the resumed
    run appends with no duplicate and no missing step. When resuming into another run folder, the lines
    come from the checkpoint's own run (``<run>/checkpoints/step-N`` -> ``<run>/metrics.jsonl``). Returns
    how many lines were dropped. The file is replaced atomically. ``through``: another last step to
    keep (samples.jsonl keeps the rollouts of the steps the checkpoint trained).
    """
    if through is None:
        through = resume.state.metrics_through
    ckpt_run = Path(resume.path).resolve().parent.parent
    source = metrics
    if ckpt_run != metrics.parent.resolve():  # a fork into another run folder: its lines come from the checkpoint's run
        source = ckpt_run / metrics.name
        if metrics.exists():  # whatever this folder held before is kept aside, never mixed in
            metrics.rename(metrics.with_name(f"{metrics.stem}.{int(metrics.stat().st_mtime)}{metrics.suffix}"))
    lines = source.read_text().splitlines() if source.exists() else []
    keep: list[str] = []
    dropped = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            step = int(msgspec.json.decode(line).get("step", 0))
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            dropped += 1  # a torn last line from a killed run
            continue
        if step <= through:
            keep.append(line)
        else:
            dropped += 1
    metrics.parent.mkdir(parents=True, exist_ok=True)
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, metrics)
    return dropped


def prepare_folder(root: Path, resume: Resume) -> list[Path]:
    """Before a resumed run writes checkpoints into ``root``: delete ``step-N.tmp`` folders left by a
    killed save, and set aside (``step-N.abandoned``, kept for inspection) every checkpoint newer than
    the one resumed from: corrupt ones that were skipped, or a later timeline when an older checkpoint
    was chosen with --resume PATH. Returns the folders set aside."""
    if not root.is_dir():
        return []
    for p in root.glob("step-*.tmp"):
        with contextlib.suppress(OSError):
            shutil.rmtree(p)
    moved = []
    if Path(resume.path).parent.resolve() == root.resolve():
        for step, p in list_checkpoints(root):
            if step > resume.step:
                dest = p.with_name(f"{p.name}.abandoned")
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(p, dest)
                moved.append(dest)
                log.warning("checkpoint %s is newer than the resumed %s: set aside as %s", p, resume.path, dest)
    return moved
