"""Reward models beside the policy: a scalar reward model (a Hugging Face sequence-classification folder)
served in worker processes of its own, its scores combined with the environment's verifier.

    build.py   builtin:rm, built from the environment's verifier and cached; check_folder for yours
    worker.py  the worker process: loads the model, scores batches (msgspec JSON lines on stdin/stdout)
    client.py  RewardModelClient: batches episodes, keeps workers alive, retries, counts
    suite.py   RewardModelSuite: wraps the env suite; every finished episode scored, combined, logged

docs/rewards.md tells the whole story (combining, normalization, failure semantics, placement).
"""

from __future__ import annotations

from typing import Any

__all__ = ["with_reward_model"]


async def with_reward_model(cfg: Any, suite: Any, progress: Any = None) -> Any:
    """``suite`` wrapped so that every finished episode is also scored by ``cfg.reward.model`` (built first
    when it is ``builtin:rm``); its workers are started now (they load while the engines start)."""
    import asyncio

    from flashrl.rewardmodel.build import ensure_reward_model
    from flashrl.rewardmodel.suite import wrap

    folder = await asyncio.to_thread(ensure_reward_model, cfg, progress=progress)
    wrapped = wrap(suite, folder, cfg.reward)
    await wrapped.client.start()
    return wrapped
