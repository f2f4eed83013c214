"""An engine's load, for GetLoad: ``LoadMeter`` (requests in flight, tokens/s, busy fraction over the window since
the last report; time injected, no vLLM) and ``stat_logger_factory``, the vLLM stat logger that feeds it the
scheduler's state and the generated tokens of every step."""

from __future__ import annotations

from typing import Any

from flashrl.core.meters import BusyMeter
from flashrl.wire.protocol import LoadReport

__all__ = ["LoadMeter", "stat_logger_factory"]


class LoadMeter:
    """Running/waiting requests, tokens/s and busy fraction for GetLoad (no vLLM; time is injected).

    busy_fraction and tokens_per_s cover the window since the previous ``report`` (the controller is
    the only caller). Busy means at least one Generate in flight, paused time included: a paused
    engine holding requests is occupied, not idle.
    """

    def __init__(self, now: float) -> None:
        self.inflight = 0
        self.generated_tokens = 0
        self.sched_running = 0
        self.sched_waiting = 0
        self.kv_usage = 0.0
        self._busy = BusyMeter(start=now)
        self._busy_at_start = 0.0  # busy seconds when the window started
        self._window_start = now
        self._window_tokens = 0

    def request_started(self, now: float) -> None:
        self._busy.enter(now)
        self.inflight += 1

    def request_finished(self, now: float) -> None:
        self._busy.exit(now)
        self.inflight -= 1

    def tokens(self, n: int) -> None:
        self.generated_tokens += n
        self._window_tokens += n

    def scheduler(self, running: int, waiting: int, kv_usage: float) -> None:
        self.sched_running, self.sched_waiting, self.kv_usage = running, waiting, kv_usage

    def report(self, now: float, engine: str, version: int) -> LoadReport:
        busy_s = self._busy.busy_s(now)
        busy = busy_s - self._busy_at_start
        span = max(now - self._window_start, 1e-9)
        # The scheduler's numbers are from its last step; with nothing in flight they are stale.
        running = min(self.sched_running, self.inflight) if self.inflight else 0
        waiting = self.inflight - running if self.inflight else 0
        rep = LoadReport(
            engine=engine,
            version=version,
            running=running,
            waiting=waiting,
            kv_usage=self.kv_usage if self.inflight else 0.0,
            tokens_per_s=self._window_tokens / span,
            busy_fraction=min(1.0, busy / span),
            generated_tokens=self.generated_tokens,
        )
        self._busy_at_start = busy_s
        self._window_start = now
        self._window_tokens = 0
        return rep


def stat_logger_factory(meter: LoadMeter) -> Any:
    """vLLM's stat logger for this engine: feeds ``meter`` (scheduler state and generated tokens per step),
    and is the only one.

    It subclasses vLLM's ``PrometheusStatLogger`` because vLLM adds that logger to every engine unless a
    custom logger already is one (``StatLoggerManager``), and nothing here serves Prometheus (the engine
    has no HTTP server): its histograms cost ~2% of the engine thread's time on the tiny model. The
    subclass registers no Prometheus metric (no ``super().__init__``) and overrides every method vLLM
    calls on its loggers."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class _MeterLogger(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            self.engine_indexes = engine_indexes or [0]

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                meter.scheduler(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs, scheduler_stats.kv_cache_usage)
            if iteration_stats is not None:
                meter.tokens(iteration_stats.num_generation_tokens)

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return _MeterLogger
