"""A run's folder, runs/<name>/, made ready for a run (``prepare_run_dir``), and the marks a run leaves there for
the supervisor that restarts it (flashrl/supervise.py): the exit code of a failure a restart would meet again
(``FINAL_EXIT``), the failure itself (``FAILURE_FILE``), and the environment variable that marks a restart
(``RESTART_ENV``). Which errors are final: launch/driver.py ``final_failure``.

A fresh start keeps what an earlier run under the same name left, renamed aside (never mixed in, never
deleted); a restart by --supervise never sets a complete checkpoint aside. What counts as a complete
checkpoint is resuming.newest_complete's rule, the one a resume uses.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from flashrl.config import Config
from flashrl.resuming import Resume, continue_metrics, newest_complete, prepare_folder

log = logging.getLogger("flashrl.launch")

FINAL_EXIT = 3  # the run failed for a reason a restart would meet again (final_failure): --supervise stops at once
FAILURE_FILE = "failure.json"  # runs/<name>/: the error a run ended with for good (exit 2 or FINAL_EXIT), for the supervisor
RESTART_ENV = "FLASHRL_SUPERVISED_RESTART"  # set by --supervise on a restart: never set a complete checkpoint aside


class FreshStartRefused(RuntimeError):
    """A restart by --supervise (RESTART_ENV) without --resume found a complete checkpoint: setting it aside
    would throw the run's progress away, so the run does not start (exit 2)."""


def _aside(path: Path, stem: str, suffix: str = "") -> Path:
    """A free name beside ``path`` to set it aside as: <stem>.<its mtime>[.n]<suffix> (two in one second
    never overwrite each other)."""
    base = f"{stem}.{int(path.stat().st_mtime)}"
    dest, n = path.with_name(base + suffix), 1
    while dest.exists():
        dest, n = path.with_name(f"{base}.{n}{suffix}"), n + 1
    return dest


def prepare_run_dir(cfg: Config, resume: Resume | None, *, restart: bool = False) -> int:
    """Get ``runs/<name>/`` ready for a run: fresh, or continuing ``resume``. Returns the metrics lines dropped.

    Fresh: earlier metrics/samples .jsonl and checkpoints/ are renamed aside (kept, never mixed in); a
    complete checkpoint set aside is named, with the command that continues it. ``restart`` (a restart by
    --supervise, never the user's own command): a complete checkpoint is never set aside, FreshStartRefused
    instead (the supervisor resumes such a run; reaching this is a bug, stopped loudly rather than a run's
    progress thrown away). Resume: metrics.jsonl and samples.jsonl are cut back to the checkpoint's step,
    killed saves are removed and newer checkpoints set aside (resuming.prepare_folder). Restarting after a
    failure in the same process (run.auto_resume) is ``r = resuming.prepare_resume(cfg)``, this,
    ``run_local(cfg, r)``.
    """
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FAILURE_FILE).unlink(missing_ok=True)  # this run's own end, if any, is recorded afresh
    ckpts = run_dir / "checkpoints"
    if resume is not None:
        # metrics.jsonl (and samples.jsonl) continue: lines written after the checkpoint are dropped
        dropped = continue_metrics(run_dir / "metrics.jsonl", resume)
        continue_metrics(run_dir / "samples.jsonl", resume, through=resume.step)
        prepare_folder(ckpts, resume)
        return dropped
    kept = newest_complete(ckpts)[0] if ckpts.is_dir() else None
    if kept is not None and restart:
        raise FreshStartRefused(
            f"{ckpts} holds a complete checkpoint ({kept.path}, step {kept.step}) and this restart by --supervise "
            f"has no --resume: not setting it aside. Continue it with `flashrl run CONFIG --resume {kept.path}`")
    for stem in ("metrics", "samples"):
        old = run_dir / f"{stem}.jsonl"
        if old.exists():  # a rerun under the same name keeps the earlier records, never mixes them
            old.rename(_aside(old, stem, ".jsonl"))
    if ckpts.exists():  # ... and the earlier checkpoints (resume them with --resume PATH)
        dest = _aside(ckpts, "checkpoints")
        ckpts.rename(dest)
        if kept is not None:
            msg = (f"fresh start (no --resume): the earlier checkpoints, up to step {kept.step}, are set aside as "
                   f"{dest}; continue that run instead with `flashrl run CONFIG --resume {dest / Path(kept.path).name}`")
            log.warning(msg)
            print(f"warning: {msg}", file=sys.stderr)
    return 0
