"""The controller: admission, rollouts, the sample buffer, training steps and weight syncs."""

from flashrl.controller.controller import Controller, RunSummary

__all__ = ["Controller", "RunSummary"]
