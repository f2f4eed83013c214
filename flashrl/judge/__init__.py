"""A generative judge beside the policy: a causal LM served by vLLM engine processes of its own gives each
finished episode a verdict (pass/fail, or a score) that trains the policy, the environment's verifier held out as truth.

    build.py    builtin:judge (the built-in model warm-started on verifier-labelled verdicts), cached
    engines.py  JudgeEngines: the judge's engine processes (the policy's engine server), watched, restarted
    client.py   JudgeClient: template -> tokens -> verdict; parse, retry, count
    checks.py   what `flashrl validate` checks of [judge] against lengths (the judge engines' max_model_len)
    the suite   flashrl.rewardmodel.suite.RewardModelSuite(kind="judge"): combined with the verifier, logged

docs/rewards.md tells the whole story.
"""

from __future__ import annotations

from typing import Any

__all__ = ["with_judge"]


async def with_judge(cfg: Any, suite: Any, progress: Any = None, launcher: Any = None, device: str = "cpu",
                     gpus: list[str | None] | None = None) -> Any:
    """``suite`` whose finished episodes the judge ``cfg.judge.model`` also rates (built first when it is
    builtin:judge); its engines start now, in the background, beside the policy's, placed by ``launcher`` (the
    run's, started; None: on this machine, by a local launcher of the judge's own), on ``device``, judge engine
    i on ``gpus[i]`` (cuda, local launcher; None: unpinned)."""
    import asyncio

    from transformers import AutoTokenizer

    from flashrl.judge.build import ensure_judge_model
    from flashrl.judge.checks import judge_max_model_len
    from flashrl.judge.client import JudgeClient
    from flashrl.judge.engines import JudgeEngines
    from flashrl.rewardmodel.suite import RewardModelSuite

    folder = await asyncio.to_thread(ensure_judge_model, cfg, progress)
    tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(folder))
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engines = JudgeEngines(cfg.judge, folder, logs, max_model_len=judge_max_model_len(cfg), seed=cfg.run.seed,
                           launcher=launcher, device=device, gpus=gpus)
    wrapped = RewardModelSuite(suite, JudgeClient(cfg.judge, engines, tok), cfg.reward, kind="judge")
    await wrapped.client.start()
    return wrapped
