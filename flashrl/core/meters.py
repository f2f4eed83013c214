"""Meters of the hot path: amounts per second and busy fractions over a sliding window. Pure: time
always comes in (an injected clock or a ``now`` argument: the event loop's, virtual in the simulator).

    RateMeter   samples/s, tokens/s (the controller's dashboard and step records)
    BusyMeter   fraction of the window with >= 1 request in flight (per engine, in the controller),
                and busy seconds ever (the engine's own load report, the real-mode bench's probe)
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

__all__ = ["BusyMeter", "RateMeter"]


class RateMeter:
    """Amount per second over a sliding window (samples/s with ``add()``, tokens/s with ``add(n)``).

    ``clock`` returns seconds (e.g. ``asyncio.get_running_loop().time`` or ``anyio.current_time``);
    the meter never reads wall time, so it reads right on the simulator's virtual clock.
    Until ``window_s`` has passed since the meter was made, the rate is over the time since then,
    so the first seconds of a run do not read low. Events exactly ``window_s`` old have left.
    """

    def __init__(self, *, clock: Callable[[], float], window_s: float = 10.0) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"RateMeter window_s must be a finite number > 0 seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self._clock = clock
        self._start = clock()
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._in_window = 0.0
        self.total = 0.0  # everything ever added, for counters and the final summary

    def add(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"RateMeter.add amount must be >= 0, got {amount!r}")
        self._events.append((self._clock(), float(amount)))
        self._in_window += amount
        self.total += amount

    def rate(self) -> float:
        now = self._clock()
        horizon = now - self.window_s
        while self._events and self._events[0][0] <= horizon:
            self._in_window -= self._events.popleft()[1]
        if not self._events:
            self._in_window = 0.0  # drop float drift from the running sum
        span = min(self.window_s, now - self._start)
        if span <= 0:
            return 0.0
        return max(self._in_window, 0.0) / span


class BusyMeter:
    """Fraction of the last ``window_s`` seconds during which at least one request was in flight.

    ``enter(now)`` / ``exit(now)`` bracket every request; ``fraction(now)`` reads the window. Busy
    periods are kept as closed intervals plus the open one, pruned once they leave the window, so
    memory stays bounded by the busy periods of one window even when nobody reads the meter. Until
    ``window_s`` has passed since ``start``, the fraction is over the time since ``start`` (as
    metrics.RateMeter does), so a run's first seconds do not read low. Time only ever comes in as
    an argument: it is the event loop's clock, virtual in the simulator.
    """

    def __init__(self, window_s: float = 10.0, start: float = 0.0) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"BusyMeter window_s must be a finite number > 0 seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self.start = start
        self.active = 0
        self._since = start  # start of the open busy period (meaningful while active > 0)
        self._closed: collections.deque[tuple[float, float]] = collections.deque()
        self._closed_s = 0.0  # every closed busy period's length, ever (busy_s)

    def enter(self, now: float) -> None:
        if self.active == 0:
            self._since = now
        self.active += 1

    def exit(self, now: float) -> None:
        if self.active <= 0:
            raise RuntimeError("BusyMeter.exit() without a matching enter()")
        self.active -= 1
        if self.active == 0:
            self._closed.append((self._since, now))
            self._closed_s += now - self._since
            self._prune(now - self.window_s)

    def _prune(self, horizon: float) -> None:
        while self._closed and self._closed[0][1] <= horizon:
            self._closed.popleft()

    def fraction(self, now: float) -> float:
        horizon = now - self.window_s
        self._prune(horizon)
        busy = sum(end - max(begin, horizon) for begin, end in self._closed)
        if self.active:
            busy += now - max(self._since, horizon)
        span = min(self.window_s, now - self.start)
        if span <= 0:
            return 1.0 if self.active else 0.0
        return min(1.0, max(0.0, busy / span))

    def busy_s(self, now: float) -> float:
        """Seconds with at least one request in flight since ``start``, up to ``now`` (the open period too)."""
        return self._closed_s + (now - self._since if self.active else 0.0)
