"""The environment suite with a reward model beside its verifier (``[reward] model = ...``).

    controller --reset/step--> RewardModelEnv --step--> the env's own step (the verifier: truth, held out)
                                     | done
                                     +--score(prompt + action)--> RewardModelClient (batched, workers)
                                     v
                 StepResult(reward = combine(model reward, verifier reward), info["correct"] = the verifier's,
                            info["metrics"] = rm_score, rm_reward, verifier, rm_gap, rm_agree)

Nothing in the controller changes: the wrapper is an EnvSuite like any other (flashrl.env), so episodes
are scored while the engines generate others, a failed score is an EnvFailure (retried and counted as
``rollout/retry_env_rm_<reason>``, never a reward of 0), the client's counters are the suite's
(``env/rm_*`` in every step record) and ``aclose`` stops the workers.

The verifier stays the truth: ``info["correct"]`` (held-out accuracy, samples.jsonl) is always the
verifier's, whatever the training reward. Per step the mean of ``reward/rm_gap`` = sigmoid(score) -
verifier reward shows whether the reward model drifts from the truth as the policy learns to please it
(reward hacking), and ``reward/rm_agree`` how often its verdict (score > 0) is the verifier's.

Normalization (``reward.normalize``): the model reward minus the running mean over the training
episodes scored so far, over their running std (Welford); held-out episodes are scored with the current
statistics and do not update them. Limit: an episode is scored once, at its end, on its first prompt and
last action (single-turn tasks; a multi-turn episode's earlier turns keep their own rewards).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flashrl.config import RewardModelConfig
from flashrl.env import Closable, Counting, Env, EnvFailure, EnvSuite, MultiTurn, StepResult, Task
from flashrl.rewardmodel.build import rm_text
from flashrl.rewardmodel.client import RewardModelClient
from flashrl.rewards import RewardFailed

__all__ = ["Combiner", "RewardModelEnv", "RewardModelSuite", "RunningStats"]


class RunningStats:
    """Welford's running mean and (population) std."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self._m2 = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self._m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.n) if self.n > 1 else 0.0


class Combiner:
    """The training reward from the model's score and the verifier's reward (``[reward]``). ``verdicts``: the
    scores are a judge's verdicts in [0, 1], used as they are (reward.transform does not apply)."""

    def __init__(self, rc: RewardModelConfig, verdicts: bool = False) -> None:
        self.rc = rc
        self.verdicts = verdicts
        self.stats = RunningStats()

    def model_reward(self, score: float, train: bool) -> float:
        r = 1.0 / (1.0 + math.exp(-score)) if self.rc.transform == "sigmoid" and not self.verdicts else score
        if not self.rc.normalize:
            return r
        if train:
            self.stats.add(r)
        if self.stats.n < 2:
            return r - self.stats.mean
        return (r - self.stats.mean) / max(self.stats.std, 1e-6)

    def combine(self, model: float, verifier: float) -> float:
        rc = self.rc
        if rc.combine == "gate":
            return rc.model_weight * model if verifier >= rc.gate_threshold else rc.gate_reward
        return rc.model_weight * model + rc.verifier_weight * verifier


class RewardModelEnv:
    """One episode of the wrapped env, its last step also scored by the reward model."""

    def __init__(self, inner: Env, suite: RewardModelSuite) -> None:
        self.inner = inner
        self.suite = suite
        self.prompt = ""
        self.train = True

    async def reset(self, task: Task) -> str:
        self.train = task.id not in self.suite.eval_ids
        self.prompt = await self.inner.reset(task)
        return self.prompt

    async def step(self, action: str) -> StepResult:
        res = await self.inner.step(action)
        if not res.done or (not self.train and not self.suite.score_evals):
            return res
        try:
            score = await self.suite.client.score(self.suite.text(self.prompt, action))
        except RewardFailed as e:
            raise EnvFailure(e.reason, e.detail) from None
        info = dict(res.info)
        ok = info.get("correct")
        correct = ok if isinstance(ok, bool) else res.reward >= 1.0
        model = self.suite.combiner.model_reward(score, self.train)
        reward = self.suite.combiner.combine(model, res.reward)
        k = self.suite.kind
        prob = score if k == "judge" else 1.0 / (1.0 + math.exp(-score))  # the model's "correct", in [0, 1]
        metrics = dict(info.get("metrics") or {})
        metrics.update({f"{k}_score": score, f"{k}_reward": model, "verifier": res.reward,
                        f"{k}_gap": prob - res.reward, f"{k}_agree": float((prob > 0.5) == correct)})
        info.update(correct=correct, metrics=metrics)
        return StepResult(observation=res.observation, reward=reward, done=True, info=info)

    async def close(self) -> None:
        await self.inner.close()


class RewardModelSuite:
    """``inner`` with its episodes scored by ``client`` (see the module doc). Closable and Counting."""

    def __init__(self, inner: EnvSuite, client: Any, rc: RewardModelConfig, kind: str = "rm") -> None:
        """``client``: a RewardModelClient (``kind`` "rm": scores text, logits) or a judge's client (``kind``
        "judge": ``score`` takes (prompt, response) text as its template wants it, returns a verdict in [0, 1])."""
        self.inner = inner
        self.client = client
        self.kind = kind
        self.combiner = Combiner(rc, verdicts=kind == "judge")
        self.score_evals = rc.score_evals
        self.eval_ids = {t.id for t in inner.eval_tasks()}
        self._closed = False
        if isinstance(inner, MultiTurn):
            self.max_turns = inner.max_turns

    def text(self, prompt: str, action: str) -> Any:
        """What the model is asked about: the reward model reads one text, the judge its template's parts."""
        return (prompt, action) if self.kind == "judge" else rm_text(prompt, action)

    def train_tasks(self) -> Sequence[Task]:
        return self.inner.train_tasks()

    def eval_tasks(self) -> Sequence[Task]:
        return self.inner.eval_tasks()

    def make_env(self) -> RewardModelEnv:
        return RewardModelEnv(self.inner.make_env(), self)

    @property
    def counters(self) -> Mapping[str, float]:
        out: dict[str, float] = dict(self.inner.counters) if isinstance(self.inner, Counting) else {}
        out.update(self.client.counters)
        if self.combiner.rc.normalize:
            out["rm_norm_mean_x1000"] = 1000 * self.combiner.stats.mean
        return out

    async def aclose(self) -> None:
        if self._closed:  # the controller closes it, and the driver once more when the run failed early
            return
        self._closed = True
        try:
            await self.client.aclose()
        finally:
            if isinstance(self.inner, Closable):
                await self.inner.aclose()


def wrap(inner: EnvSuite, model_folder: Any, rc: RewardModelConfig) -> RewardModelSuite:
    """``inner`` scored by the reward model in ``model_folder``, served as ``rc`` says (worker processes)."""
    from flashrl.rewardmodel.client import ProcessScorer

    backend = ProcessScorer(model_folder, workers=rc.workers, threads=rc.threads, device=rc.device,
                            startup_timeout_s=rc.startup_timeout_s, runner=rc.runner, kv_cache_gib=rc.kv_cache_gib)
    client = RewardModelClient(backend, max_batch=rc.max_batch, batch_wait_s=rc.batch_wait_ms / 1000,
                               timeout_s=rc.timeout_s, retries=rc.retries, cache_size=rc.cache_size)
    return RewardModelSuite(inner, client, rc)
