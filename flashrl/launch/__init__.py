"""Launching a run: where its processes start and how `flashrl run` drives them. One entry per job:

    driver.main(cfg, resume)      `flashrl run`: the whole run, every launcher (the one entry of a run)
    processes.local_cluster(...)  the engine pool + trainer group of a run, started through a launcher
    make_launcher(cfg, run_dir)   the launcher cfg.cluster.launcher names (this module):
      base.py                     the interface (Launcher, Proc, Endpoint, LaunchError), addresses
      local.py                    every process on this machine (the default)
      ray.py (+ ray_head.py, ray_proc.py)   placement groups on a Ray cluster, or a private Ray head
      slurm.py (+ slurm_job.py, slurm_node.py)  an sbatch job: the script, the node agents, the launcher

Calls go one way: driver -> processes -> a launcher. A launcher places processes and reports
addresses; it never imports the driver, the controller or the roles (engine and trainer clients
import its ``base`` for the ``Proc``/``Launcher`` types). This module stays light: importing
flashrl.launch.base runs it, from below the roles. ``active()`` lets code started later in a run
(remote env workers, envs/remote.py) start its processes through the same launcher. ray.py and
slurm.py are imported only when chosen (their packages are optional extras); the per-run CURVE
keys they write are flashrl/wire/keys.py's.
"""

from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flashrl.launch.base import Endpoint, Launcher, LaunchError, Proc, Role, proc_name
from flashrl.wire.keys import CurveKeys

if TYPE_CHECKING:
    from flashrl.config import Config

__all__ = ["Active", "CurveKeys", "Endpoint", "LaunchError", "Launcher", "Proc", "Role", "activate", "active",
           "make_launcher", "proc_name"]

_REMOTE = {"ray": ("flashrl.launch.ray", "RayLauncher", "ray"), "slurm": ("flashrl.launch.slurm", "SlurmLauncher", "")}


def make_launcher(cfg: Config, run_dir: str | Path) -> Launcher:
    """The launcher ``cfg.cluster.launcher`` names, built for ``run_dir`` (nothing starts yet)."""
    kind = cfg.cluster.launcher
    if kind == "local":
        from flashrl.launch.local import LocalLauncher

        return LocalLauncher(run_dir, cfg.cluster.interface)
    if kind not in _REMOTE:
        raise LaunchError(f"cluster.launcher = {kind!r}: expected one of 'local', 'ray', 'slurm'")
    module, cls, extra = _REMOTE[kind]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise LaunchError(f"cluster.launcher = {kind!r}: this flashrl has no {kind} launcher yet "
                              f"({module} is missing); use cluster.launcher = \"local\"") from None
        hint = f"pip install 'flashrl[{extra}]'" if extra else f"install {e.name}"
        raise LaunchError(f"cluster.launcher = {kind!r} needs the {e.name} package: {hint}") from None
    launcher: Launcher = getattr(mod, cls)(cfg, Path(run_dir))
    return launcher


@dataclass(frozen=True)
class Active:
    """The launcher of the run in progress, for code that starts processes later (remote env workers)."""

    launcher: Launcher
    logs: Path  # the run's log folder


_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar("flashrl_cluster", default=None)


def activate(launcher: Launcher, logs: Path) -> contextvars.Token[Active | None]:
    """Make ``launcher`` the one ``active()`` returns in this task and the tasks it starts (launch.processes.local_cluster)."""
    return _ACTIVE.set(Active(launcher, logs))


def deactivate(token: contextvars.Token[Active | None]) -> None:
    try:
        _ACTIVE.reset(token)
    except ValueError:  # closed from another task than it was opened in (an exit stack closed elsewhere)
        _ACTIVE.set(None)


def active() -> Active | None:
    """The run's launcher and log folder, or None outside a run (e.g. an env suite used on its own)."""
    return _ACTIVE.get()
