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

Train or held out: the controller makes each held-out episode with ``make_eval_env()`` (flashrl.env.HeldOutAware;
held-out rollouts are the negative groups), never judged by the task's id: a dataset without an id column
names rows "{path}:{row}", so a train and an eval split read from one folder share ids.

Normalization (``reward.normalize``): a training episode's model reward r becomes z = (r - mean) / std over
the training episodes scored *before* it (Welford; before two there is no std: z = r - mean, the first is r
itself, never a forced 0); it then joins the statistics. Held-out episodes are scored with the current
statistics and do not update them. The statistics are the suite's checkpoint state (flashrl.env.Stateful):
saved with every checkpoint and put back on resume (episodes scored before the checkpoint whose groups the
resume regenerates are counted again).

Combination (``reward.combine``), m the model reward (r or z):
    sum:   model_weight * m + verifier_weight * verifier
    gate:  max(gate_reward, 0) + model_weight * u(m)  where the verifier passes (reward >= gate_threshold),
           gate_reward                                 where it fails,
    u(m) in [0, 1]: m itself where it is already there (sigmoid(score), a judge's verdict; not normalized),
    else sigmoid(m) (a raw or normalized reward); a reward model's u at least U_MIN = 2e-9. model_weight > 0
    (flashrl validate), so a verifier-passed episode is never ranked below a failed one, whatever the reward
    model says and whatever the statistics: strictly above for a reward model (unless model_weight x 2e-9 is
    lost to float rounding next to a huge gate_reward), level for a judge's verdict of 0. With gate_reward <= 0
    (the default 0) a pass is model_weight x u, as it was before the order was guaranteed.

Limit: an episode is scored once, at its end, on its first prompt and last action (single-turn tasks; a
multi-turn episode's earlier turns keep their own rewards).
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

__all__ = ["Combiner", "RewardModelEnv", "RewardModelSuite", "RunningStats", "sigmoid"]


U_MIN = 2e-9  # the gate's least model share of a pass (~ sigmoid(-20)): above a fail even next to gate_reward 1e6 x w


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x), without overflow at either end."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class RunningStats:
    """Welford's running mean and (population) std; ``state()`` / ``load()`` for checkpoints."""

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

    def z(self, x: float) -> float:
        """``x`` against the values so far: (x - mean) / std; before two values, x - mean (the first: x)."""
        if self.n < 2:
            return x - self.mean
        return (x - self.mean) / max(self.std, 1e-6)

    def state(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "m2": self._m2}

    def load(self, state: Mapping[str, Any]) -> None:
        n, mean, m2 = int(state["n"]), float(state["mean"]), float(state["m2"])
        if n < 0 or not (math.isfinite(mean) and math.isfinite(m2)) or m2 < 0:
            raise ValueError(f"running statistics: n={n}, mean={mean}, m2={m2} are not a Welford state")
        self.n, self.mean, self._m2 = n, mean, m2


class Combiner:
    """The training reward from the model's score and the verifier's reward (``[reward]``; the formulas are the
    module doc's). ``verdicts``: the scores are a judge's verdicts in [0, 1], used as they are (reward.transform
    does not apply)."""

    def __init__(self, rc: RewardModelConfig, verdicts: bool = False) -> None:
        self.rc = rc
        self.verdicts = verdicts
        self.stats = RunningStats()

    def model_reward(self, score: float, train: bool) -> float:
        """r = sigmoid(score) or the score (a verdict: as is); normalized: z against the training episodes before
        this one, then (``train``) r joins them."""
        r = sigmoid(score) if self.rc.transform == "sigmoid" and not self.verdicts else score
        if not self.rc.normalize:
            return r
        z = self.stats.z(r)
        if train:
            self.stats.add(r)
        return z

    def unit(self, model: float) -> float:
        """The model reward in [0, 1] for the gate: as is where it is a probability or a verdict, else squashed;
        a reward model's at least U_MIN (a pass it scores near 0 still ranks above a fail)."""
        if self.verdicts and not self.rc.normalize:
            return model
        u = model if not self.rc.normalize and self.rc.transform == "sigmoid" else sigmoid(model)
        return max(u, U_MIN)

    def combine(self, model: float, verifier: float) -> float:
        rc = self.rc
        if rc.combine == "gate":  # every pass above every fail (model_weight > 0: config._check)
            return max(rc.gate_reward, 0.0) + rc.model_weight * self.unit(model) if verifier >= rc.gate_threshold else rc.gate_reward
        return rc.model_weight * model + rc.verifier_weight * verifier


class RewardModelEnv:
    """One episode of the wrapped env, its last step also scored by the reward model; ``train`` False: a held-out
    episode (the controller says which, flashrl.env.HeldOutAware)."""

    def __init__(self, inner: Env, suite: RewardModelSuite, train: bool = True) -> None:
        self.inner = inner
        self.suite = suite
        self.prompt = ""
        self.train = train

    async def reset(self, task: Task) -> str:
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
        prob = score if k == "judge" else sigmoid(score)  # the model's "correct", in [0, 1]
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

    def make_eval_env(self) -> RewardModelEnv:
        """A held-out episode: scored (``score_evals``) with the current statistics, never added to them."""
        return RewardModelEnv(self.inner.make_env(), self, train=False)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a resume must continue (flashrl.env.Stateful): the normalization's running statistics."""
        return {"norm": self.combiner.stats.state()} if self.combiner.rc.normalize else {}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        if self.combiner.rc.normalize and "norm" in state:
            self.combiner.stats.load(state["norm"])

    @property
    def counters(self) -> Mapping[str, float]:
        out: dict[str, float] = dict(self.inner.counters) if isinstance(self.inner, Counting) else {}
        out.update(self.client.counters)
        if self.combiner.rc.normalize:
            out["rm_norm_mean_x1000"] = 1000 * self.combiner.stats.mean  # a gauge (restored, not summed: ledger)
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
