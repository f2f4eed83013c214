"""What the user sees while ``flashrl run`` trains: a rich live view, one plain line per step, or nothing.

    controller loop ---update(snapshot)---> Dashboard --rich--> rich.live.Live (own refresh thread, 4 Hz)
                                                     --plain-> one line per new step on the console
                                                     --off---> nothing

``render(snapshot)`` is a pure function of the ``Snapshot`` (no clock, no I/O), so tests render a
snapshot into a recording console and read the text. ``update()`` only hands the new renderable to
``Live``, which redraws it from its own thread; the controller's loop never waits on the terminal.

Limits: the live view is sized for terminals of 100+ columns; narrower ones wrap. Histories are
down-sampled (bucket means) to the sparkline width, so a spike of one step may look lower.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal

import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from flashrl.core.records import StepRecord
from flashrl.metrics import Snapshot

Mode = Literal["rich", "plain", "off"]

_BARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
REFRESH_HZ = 4.0
_BAD_STATUS = ("fail", "error", "crash", "dead")


# ----------------------------------------------------------------------------------------------
# formatting helpers (pure)


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """One bar character per value (bucket means when there are more values than ``width``).

    Scaled between the min and max of what is shown; a flat series is a row of middle bars.
    Non-finite values (a NaN reward) show as a space, so a gap is visible rather than hidden.
    """
    if width < 1:
        raise ValueError(f"sparkline width must be >= 1, got {width}")
    xs = [float(v) for v in values]
    if len(xs) > width:
        buckets: list[float] = []
        for i in range(width):
            part = [x for x in xs[i * len(xs) // width:(i + 1) * len(xs) // width] if math.isfinite(x)]
            buckets.append(math.fsum(part) / len(part) if part else math.nan)
        xs = buckets
    finite = [x for x in xs if math.isfinite(x)]
    if not finite:
        return " " * len(xs)
    lo, hi = min(finite), max(finite)
    out = []
    for x in xs:
        if not math.isfinite(x):
            out.append(" ")
        elif hi == lo:
            out.append(_BARS[len(_BARS) // 2 - 1])
        else:
            out.append(_BARS[min(len(_BARS) - 1, int((x - lo) / (hi - lo) * len(_BARS)))])
    return "".join(out)


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour); whole seconds, because the view refreshes at 4 Hz."""
    s = max(0, int(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _step_text(s: Snapshot) -> str:
    return f"{s.step}/{s.total_steps}" if s.total_steps else str(s.step)


def _latest(history: Sequence[tuple[int, float]]) -> float | None:
    return history[-1][1] if history else None


_PROBLEM_WORDS = ("fail", "retr", "drop", "dead", "death", "restart", "abort", "skip", "stale", "error", "timeout")
_PROBLEM_NAMES = ("late",)  # whole words only: "latency" and "template" are not problems


def is_problem_counter(name: str) -> bool:
    """Does this counter count lost, repeated or failed work (as opposed to progress)?"""
    low = name.lower()
    return any(word in low for word in _PROBLEM_WORDS) or any(w in _PROBLEM_NAMES for w in re.split(r"[^a-z0-9]+", low))


def format_plain(s: Snapshot) -> str:
    """The plain-mode progress line, e.g.

    ``step 12/60 v12 reward 0.41 acc 0.38 stale 0.8/2 12.3 samples/s 456 tok/s step 1.50s sync 0.12s lr 1.0e-04``

    ``acc`` is the latest held-out accuracy (``-`` before the first eval); ``stale`` is mean/max
    policy-version lag of the last batch; ``lr`` the last step's learning rate (once a step has trained);
    ``mismatch`` (when measured) the last step's mismatch/kl
    between engine and trainer logprobs; ``route-disagree`` (a MoE policy) the last step's moe/disagree. Non-zero problem counters (dropped, retried, failed, dead,
    ...; see ``is_problem_counter``) follow as ``name=count`` (sorted), so a CI log shows every lost
    or repeated rollout; progress counters (admitted/trained groups) are left to metrics.jsonl.
    """
    acc = _latest(s.eval_history)
    parts = [
        f"step {_step_text(s)}",
        f"v{s.version}",
        f"reward {s.reward_mean:.2f}",
        f"acc {acc:.2f}" if acc is not None else "acc -",
        f"stale {s.staleness_mean:.1f}/{s.staleness_max}",
        f"{s.samples_per_s:.1f} samples/s",
        f"{s.tokens_per_s:.0f} tok/s",
        f"step {s.step_s:.2f}s",
        f"sync {s.weight_sync_s:.2f}s",
    ]
    if s.lr is not None:
        parts.append(f"lr {s.lr:.1e}")
    if s.mismatch_kl is not None:
        parts.append(f"mismatch {s.mismatch_kl:.1e}")
    if s.moe_disagree is not None:
        parts.append(f"route-disagree {s.moe_disagree:.3f}")
    if s.gap_history:
        parts.append(f"model-gap {s.gap_history[-1][1]:+.2f}")
    if s.latency_history:
        parts.append(f"score {s.latency_history[-1][1]:.0f}ms")
    parts += [f"{k}={v}" for k, v in sorted(s.counters.items()) if v and is_problem_counter(k)]
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# the rich view (pure)


def eval_cost_text(s: Snapshot) -> tuple[str, str, str]:
    """What the held-out evals cost so far: ``4 in 1.2s`` (+ `` running`` while one runs); what the train
    loop waited for them, ``0.05s (0.4%)`` (of the elapsed time); how long no training rollout was
    generating while one ran, ``0.01s``."""
    share = s.eval_trainer_wait_s / s.elapsed_s if s.elapsed_s > 0 else 0.0
    evals = f"{len(s.eval_history)} in {s.eval_s:.1f}s" + (" running" if s.eval_running else "")
    return evals, f"{s.eval_trainer_wait_s:.2f}s ({share:.1%})", f"{s.eval_gen_wait_s:.2f}s"


def _header(s: Snapshot) -> Text:
    t = Text()
    t.append(s.run_name or "flashrl", style="bold")
    t.append(f"   step {_step_text(s)}   policy v{s.version}   elapsed {format_duration(s.elapsed_s)}   ")
    if s.resumed_from is not None:
        t.append(f"resumed from step {s.resumed_from}   ", style="bold")
    t.append(f"{s.samples_per_s:.1f} samples/s   {s.tokens_per_s:.0f} tokens/s")
    return t


def _engines_table(s: Snapshot) -> Table:
    table = Table(title="engines", title_justify="left", expand=True)
    for col, justify in (("engine", "left"), ("inflight", "right"), ("busy", "right"),
                         ("tok/s", "right"), ("version", "right"), ("alive", "center")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for e in s.engines:
        behind = s.version - e.version
        version = Text(f"v{e.version}", style="yellow" if behind > 0 else "")
        table.add_row(
            e.name,
            str(e.inflight),
            f"{100 * e.busy_fraction:.0f}%",
            f"{e.tokens_per_s:.0f}",
            version,
            Text("yes", style="green") if e.alive else Text("DEAD", style="bold red"),
        )
    if not s.engines:
        table.add_row("(no engines yet)", "", "", "", "", "")
    return table


def _pipeline_table(s: Snapshot) -> Table:
    table = Table(title="pipeline", title_justify="left", show_header=False, expand=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("pending prompts", str(s.pending_prompts))
    table.add_row("running samples", str(s.running_samples))
    table.add_row("buffered groups", str(s.buffered_groups))
    table.add_row("staleness mean/max", f"{s.staleness_mean:.2f} / {s.staleness_max}")
    # the last batch's lineage: what it trained, what was thrown away for its age, what spanned updates
    table.add_row("trained tokens / length", f"{s.trained_tokens} / {s.trained_len_mean:.1f}")
    table.add_row("dropped samples / tokens", Text(f"{s.dropped_samples} / {s.dropped_tokens}",
                                                   style="bold red" if s.dropped_samples else ""))
    table.add_row("updates spanned / interrupted", f"{s.updates_spanned_mean:.2f} / {s.interrupted_frac:.0%}")
    table.add_row("step time", f"{s.step_s:.2f}s")
    table.add_row("weight sync", f"{s.weight_sync_s:.2f}s")
    if s.eval_history or s.eval_running:
        evals, wait, idle = eval_cost_text(s)
        table.add_row("evals", evals)
        table.add_row("eval: trainer wait", wait)
        table.add_row("eval: gen idle", idle)
    if s.lr is not None:
        table.add_row("lr", f"{s.lr:.2e}")
    if s.mismatch_kl is not None:
        # engine vs trainer logprobs of the same tokens (trainer Mismatch): ~0 unless weights or sampling disagree
        table.add_row("train/infer KL", Text(f"{s.mismatch_kl:.1e}", style="bold red" if s.mismatch_kl > 1e-2 else ""))
    if s.moe_disagree is not None:
        # a MoE policy: the share of on-policy tokens the trainer's router sends elsewhere than the engine did
        table.add_row("route disagree", f"{s.moe_disagree:.3f}")
    return table


def _curve_row(label: str, history: Sequence[tuple[int, float]], latest: float | None, at: int | None) -> Text:
    """``label  ▁▂▄▆█  0.38 @12 (first 0.05 @0)``: the first value is shown so the rise is readable."""
    t = Text(f"{label:<14}")
    if not history and latest is None:
        return t.append("-", style="dim")
    t.append(sparkline([v for _, v in history]) if history else "", style="cyan")
    if latest is not None:
        t.append(f"  {latest:.3f}" + (f" @{at}" if at is not None else ""), style="bold")
    if len(history) > 1:
        t.append(f"  (first {history[0][1]:.3f} @{history[0][0]})", style="dim")
    return t


def _curves(s: Snapshot) -> Panel:
    # The last batch's reward is the freshest number; the history may lag it by one step.
    rows = [
        _curve_row("reward", s.reward_history, s.reward_mean if s.reward_history or s.step else None, s.step),
        _curve_row("held-out acc", s.eval_history, _latest(s.eval_history),
                   s.eval_history[-1][0] if s.eval_history else None),
    ]
    if s.gap_history:  # a reward model or judge beside the verifier: its reward minus the truth's
        rows.append(_curve_row("model-verifier", s.gap_history, s.gap_history[-1][1], s.gap_history[-1][0]))
    if s.teacher_kl_history:  # distillation: how far the student still is from its teacher, per token
        rows.append(_curve_row("teacher KL", s.teacher_kl_history, s.teacher_kl_history[-1][1],
                               s.teacher_kl_history[-1][0]))
    if s.latency_history:  # ... and what its scoring takes, from an episode's end to its score (ms)
        rows.append(_curve_row("score ms", s.latency_history, s.latency_history[-1][1], s.latency_history[-1][0]))
    return Panel(Group(*rows), title="learning", title_align="left")


def _counters(s: Snapshot) -> Text:
    """One line per counter group (the part before ``/``): ``rollout: failed_env_error=2  retry_timeout=1``.

    Every counter is shown, zeros dimmed; failures and dead engines in red, so nothing is lost silently.
    """
    t = Text("counters  ")
    if not s.counters:
        return t.append("none", style="dim")
    groups: dict[str, list[tuple[str, int]]] = {}
    for key, value in sorted(s.counters.items()):
        group, _, name = key.rpartition("/")
        groups.setdefault(group, []).append((name, value))
    for i, (group, items) in enumerate(groups.items()):
        if i:
            t.append("\n" + " " * len("counters  "))
        if group:
            t.append(f"{group}: ", style="bold")
        for j, (name, value) in enumerate(items):
            bad = value and ("fail" in name or "dead" in name or "fail" in group or "dead" in group)
            t.append(("  " if j else "") + f"{name}={value}",
                     style="red" if bad else ("" if value else "dim"))
    return t


def _status(s: Snapshot) -> Text:
    bad = any(word in s.status.lower() for word in _BAD_STATUS)
    return Text("status    ").append(s.status, style="bold red" if bad else "bold green")


def render(snapshot: Snapshot) -> RenderableType:
    """The whole live view for one snapshot. Pure: same snapshot, same picture."""
    side = Table.grid(expand=True, padding=(0, 2))
    side.add_column(ratio=3)
    side.add_column(ratio=2)
    side.add_row(_engines_table(snapshot), _pipeline_table(snapshot))
    return Group(_header(snapshot), side, _curves(snapshot), _counters(snapshot), _status(snapshot))


# ----------------------------------------------------------------------------------------------
# the live object


def choose_mode(config_value: str, console: Console) -> Mode:
    """``run.dashboard`` -> the mode to use: ``auto`` is rich on a terminal and plain otherwise (CI logs)."""
    if config_value == "auto":
        return "rich" if console.is_terminal and not console.is_dumb_terminal else "plain"
    if config_value in ("rich", "plain", "off"):
        return config_value  # type: ignore[return-value]
    raise ValueError(f"run.dashboard must be one of auto, rich, plain, off; got {config_value!r}")


class Dashboard:
    """``start()`` once, ``update(snapshot)`` as often as you like, ``stop()`` once (also on error).

    rich: a ``Live`` view refreshed at ``REFRESH_HZ`` by rich's own thread; stdout/stderr written
    meanwhile (warnings) are printed above it. plain: a line when ``update()`` sees a step it has not
    printed (at most one per call, so steps finishing between two updates share a line; every step
    is in metrics.jsonl), a line per ``status()`` message, and a final status line at ``stop()``.
    off: nothing.
    """

    def __init__(self, mode: Mode, console: Console | None = None) -> None:
        if mode not in ("rich", "plain", "off"):
            raise ValueError(f"Dashboard mode must be rich, plain or off (see choose_mode), got {mode!r}")
        self.mode: Mode = mode
        self.console = console if console is not None else Console()
        self._live: Live | None = None
        self._last: Snapshot | None = None
        self._updated = False  # has the controller sent a snapshot (not only status() messages)?
        self._printed_step: int | None = None
        self.last_record: StepRecord | None = None

    @classmethod
    def for_config(cls, value: str, console: Console | None = None) -> Dashboard:
        """The dashboard ``run.dashboard`` asks for, on ``console`` (stdout by default)."""
        console = console if console is not None else Console()
        return cls(choose_mode(value, console), console)

    def start(self) -> None:
        if self.mode == "rich" and self._live is None:
            self._live = Live(render(self._last or Snapshot()), console=self.console,
                              refresh_per_second=REFRESH_HZ, transient=False)
            self._live.start()

    def status(self, text: str) -> None:
        """Show a status message (e.g. "starting 2 engine(s)") before or between snapshots."""
        self._last = msgspec.structs.replace(self._last or Snapshot(), status=text)
        if self.mode == "rich" and self._live is not None:
            self._live.update(render(self._last))
        elif self.mode == "plain":
            self._print(f"status {text}")

    def step(self, record: StepRecord) -> None:
        """A finished step's metrics record; kept for callers, the view itself reads snapshots."""
        self.last_record = record

    def update(self, snapshot: Snapshot) -> None:
        self._last = snapshot
        self._updated = True
        if self.mode == "rich" and self._live is not None:
            self._live.update(render(snapshot))
        elif (self.mode == "plain" and snapshot.step != self._printed_step and snapshot.step > 0
              and snapshot.step != snapshot.resumed_from):  # a resumed run prints from its first new step
            self._printed_step = snapshot.step
            self._print(format_plain(snapshot))

    def stop(self) -> None:
        if self._live is not None:
            if self._last is not None:
                self._live.update(render(self._last), refresh=True)
            self._live.stop()
            self._live = None
        elif self.mode == "plain" and self._last is not None and self._updated:
            last = self._last
            if last.step > 0 and last.step != self._printed_step:
                self._printed_step = last.step
                self._print(format_plain(last))
            self._print(f"status {last.status} after {format_duration(last.elapsed_s)}")
        self._last = None  # a second stop() prints nothing
        self._updated = False

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
