"""Progress of long work (building the built-in model): one phase at a time, on stderr.

    progress = Progress.for_stderr("init-model")     a rich bar on a terminal, plain lines otherwise
    with progress.phase("warm-start", total=4000, unit="steps") as p:
        p.advance(1, loss=0.53)                      the bar moves; fields show beside it
        p.note(probe_accuracy=0.41)                  fields only
        p.finish(steps)                              stopped early: the bar ends at ``steps``

On a terminal each phase is a rich progress bar (steps done of the total, the latest fields, time
elapsed and left). Without one (a log file, CI) each phase writes one line when it starts and one
when it ends, with its count, its last fields and its duration, and every ``every_s`` seconds in
between a line with where it is and the time left: nothing redraws, and nothing is silent for long. ``Progress.off()`` reports nothing; ``say=``
sends the plain lines elsewhere (`flashrl run`: the dashboard's status line, from the build's thread). A phase that raises still ends its bar and writes
"failed after N s".
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO


def _fmt(fields: dict[str, Any]) -> str:
    out = []
    for k, v in fields.items():
        name = k.replace("_", " ")
        out.append(f"{name} {v:.3f}" if isinstance(v, float) else f"{name} {v}")
    return ", ".join(out)


def _left(p: Phase) -> str:
    """", about N s left" from the pace so far, when the phase has a total and has begun."""
    if p.total is None or not p.done or p.done >= p.total:
        return ""
    left = (time.monotonic() - p.t0) / p.done * (p.total - p.done)
    return f", about {left / 60:.0f} min left" if left >= 120 else f", about {left:.0f} s left"


class Phase:
    """One phase in progress; see the module docstring."""

    def __init__(self, progress: Progress, name: str, total: int | None, unit: str) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.unit = unit
        self.done = 0
        self.fields: dict[str, Any] = {}
        self.t0 = time.monotonic()
        self._task: Any = None  # the rich task id, on a terminal

    def advance(self, n: int = 1, **fields: Any) -> None:
        self.done += n
        self.fields.update(fields)
        self.progress._update(self)

    def note(self, **fields: Any) -> None:
        self.fields.update(fields)
        self.progress._update(self)

    def finish(self, done: int | None = None) -> None:
        """The phase ended at ``done`` (default: where it is), even short of its total (an early stop)."""
        if done is not None:
            self.done = done
        self.total = self.done
        self.progress._update(self)

    def summary(self) -> str:
        count = f"{self.done} of {self.total} {self.unit}" if self.total is not None and self.done != self.total \
            else f"{self.done} {self.unit}" if self.done else ""
        return ", ".join(x for x in (count, _fmt(self.fields)) if x)


class Progress:
    """Phases of long work, shown on ``out``: ``live`` a rich bar per phase, else plain lines (or nothing)."""

    def __init__(self, what: str, out: TextIO | None = None, *, live: bool | None = None, enabled: bool = True,
                 every_s: float = 30.0, say: Callable[[str], None] | None = None) -> None:
        from rich.console import Console

        self.what = what  # the prefix of every plain line, e.g. "init-model"
        self.out = out if out is not None else sys.stderr
        self.console = Console(file=self.out)
        self.say = say  # plain lines go here instead of ``out`` (a run's dashboard status line)
        self.live = (self.console.is_terminal if live is None else live) and say is None
        self.enabled = enabled
        self.every_s = every_s  # plain lines: how often a long phase says where it is
        self._bar: Any = None
        self._said = 0.0  # when the last plain line was written

    @classmethod
    def for_stderr(cls, what: str) -> Progress:
        return cls(what, sys.stderr)

    @classmethod
    def off(cls) -> Progress:
        return cls("", enabled=False)

    def line(self, text: str) -> None:
        if self.enabled:
            if self.say is not None:
                self.say(f"{self.what}: {text}")
            else:
                print(f"{self.what}: {text}", file=self.out, flush=True)
            self._said = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "steps") -> Iterator[Phase]:
        p = Phase(self, name, total, unit)
        if not self.enabled:
            yield p
            return
        if self.live:
            self._start_bar(p)
        else:
            ahead = f" (up to {total} {unit})" if total is not None else ""
            self.line(f"{name}{ahead} ...")
        ok = False
        try:
            yield p
            ok = True
        finally:
            seconds = time.monotonic() - p.t0
            if self.live:
                self._stop_bar(p)
            if not self.live or not ok:
                what = "done" if ok else "failed"
                tail = p.summary()
                self.line(f"{name}: {what} in {seconds:.1f} s" + (f"; {tail}" if tail else ""))

    # ------------------------------------------------------------------ the terminal's bar
    def _start_bar(self, p: Phase) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("left"),
                        TimeRemainingColumn(), console=self.console, transient=False)
        self._bar.start()
        p._task = self._bar.add_task(f"{self.what}: {p.name}", total=p.total, info="")

    def _update(self, p: Phase) -> None:
        if self._bar is not None and p._task is not None:
            self._bar.update(p._task, completed=p.done, total=p.total, info=_fmt(p.fields))
        elif self.enabled and not self.live and time.monotonic() - self._said >= self.every_s:
            self.line(f"{p.name}: {p.summary()}{_left(p)}")

    def _stop_bar(self, p: Phase) -> None:
        if self._bar is not None:
            if p.total is None:  # an open-ended phase: show it as complete
                self._bar.update(p._task, total=max(p.done, 1), completed=max(p.done, 1))
            self._bar.stop()
            self._bar = None
