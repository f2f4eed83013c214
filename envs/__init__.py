"""The built-in environments: plug-ins on flashrl's environment API (flashrl/env.py).

flashrl finds them by import path, like a user's own class (flashrl/plugins.py: ``BUILTIN_ENVS``);
nothing in flashrl imports this package statically. The names below are kept for code written
against them: they are flashrl.plugins' own.
"""

from __future__ import annotations

from flashrl.plugins import BUILTIN_ENVS as ENVIRONMENTS
from flashrl.plugins import make_suite, suite_class, warm_start_overrides

__all__ = ["ENVIRONMENTS", "make_suite", "suite_class", "warm_start_overrides"]
