"""envs/digits_turns.py: digits read in turns, an image in every later observation (issue 54). No engine: the env
alone, its splits, and builtin:vlm's cache key (shared with envs/digits). The real path of an observation's
image through an engine and the trainer: tests/integration/test_vision_turns_process.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from envs.digits import IMAGE_TOKEN, DigitsSuite
from envs.digits_turns import DigitsTurnsSuite, TurnsParams
from flashrl.env import MultiTurn, StepResult, Task
from flashrl.vision import load_image


def _suite(turns: int = 2, seed: int = 0) -> DigitsTurnsSuite:
    return DigitsTurnsSuite(TurnsParams(train_size=40, turns=turns), seed=seed, eval_size=30)


def _play(suite: DigitsTurnsSuite, task: Task, actions: list[str]) -> tuple[str, list[StepResult]]:
    env = suite.make_env()

    async def body() -> tuple[str, list[StepResult]]:
        prompt = await env.reset(task)
        return prompt, [await env.step(a) for a in actions]

    return asyncio.run(body())


def _numbers(task: Task) -> list[str]:
    return [task.answer] + [m["answer"] for m in task.meta["more"]]


@pytest.mark.parametrize("turns", [2, 3])
def test_every_observation_carries_exactly_one_image_per_image_token(turns: int) -> None:
    suite = _suite(turns)
    task = suite.train_tasks()[5]
    prompt, steps = _play(suite, task, _numbers(task))
    assert prompt.count(IMAGE_TOKEN) == len(task.meta["images"]) == 1
    assert [s.done for s in steps] == [False] * (turns - 1) + [True]
    for k, s in enumerate(steps[:-1], start=1):
        assert s.observation.count(IMAGE_TOKEN) == len(s.images) == 1, s
        assert s.observation == f"{IMAGE_TOKEN}read:"
        assert s.images[0] == task.meta["more"][k - 1]["image"] and load_image(s.images[0]).size == (64, 64)
    assert steps[-1].observation == "" and steps[-1].images == []


def test_each_number_read_right_earns_its_share_and_correct_means_all_of_them() -> None:
    suite = _suite(3)
    task = suite.eval_tasks()[0]
    a, b, c = _numbers(task)
    _, steps = _play(suite, task, [a, "00" if b != "00" else "11", c + "<eos>"])
    assert [s.reward for s in steps] == pytest.approx([1 / 3, 0.0, 1 / 3])
    assert [s.info["metrics"] for s in steps] == [{"turn1": True}, {"turn2": False}, {"turn3": True}]
    assert steps[-1].info["correct"] is False and "correct" not in steps[0].info
    _, steps = _play(suite, task, [a, b, c])
    assert sum(s.reward for s in steps) == pytest.approx(1.0) and steps[-1].info["correct"] is True


def test_the_held_out_numbers_never_appear_in_training_in_any_turn() -> None:
    for seed in (0, 1):
        suite = _suite(2, seed)
        train = {n for t in suite.train_tasks() for n in _numbers(t)}
        held = {n for t in suite.eval_tasks() for n in _numbers(t)}
        assert len(held) == 30 and not train & held
        digits = DigitsSuite(DigitsSuite.Params(train_size=40), seed=seed, eval_size=30)
        assert held == {t.answer for t in digits.eval_tasks()}  # DigitsSuite's held-out split, the same numbers
        assert [t.answer for t in suite.train_tasks()] == [t.answer for t in digits.train_tasks()]
    # a later turn's number is another task's of the split: never the same task twice in an episode
    assert all(t.meta["more"][0]["image"] != t.meta["images"][0] for t in _suite(2).eval_tasks())


def test_the_suite_says_its_turns_and_refuses_a_task_of_another_length_or_a_step_too_many() -> None:
    suite = _suite(2)
    assert isinstance(suite, MultiTurn) and suite.max_turns == 2
    with pytest.raises(ValueError, match=r"task eval-0 has 3 numbers, this env reads 2"):
        _play(suite, _suite(3).eval_tasks()[0], [])
    task = suite.eval_tasks()[0]
    with pytest.raises(RuntimeError, match=r"step\(\) after the episode ended"):
        _play(suite, task, _numbers(task) + ["1"])


def test_builtin_vlm_is_the_digits_one_for_the_same_seed_params_and_eval_size() -> None:
    from flashrl.vision.build import VisionSpec, _key
    from flashrl.vision.warm import VisionWarmStart

    def key(name: str, params: dict[str, Any], seed: int = 0) -> str:
        cfg = SimpleNamespace(run=SimpleNamespace(seed=seed),
                              env=SimpleNamespace(name=name, eval_size=30, params=params))
        return _key(cfg, VisionSpec(), VisionWarmStart())

    digits = key("envs.digits:DigitsSuite", {"jitter": 1})
    assert key("envs.digits_turns:DigitsTurnsSuite", {"jitter": 1, "turns": 3}) == digits
    assert key("envs.digits_turns:DigitsTurnsSuite", {"jitter": 2, "turns": 3}) != digits
    assert key("envs.digits_turns:DigitsTurnsSuite", {"jitter": 1}, seed=1) != digits


# --------------------------------------------------------------------------- its bool metrics on the wire
class _MetricSuite:
    """One image task; the step reports ``metrics`` as given."""

    def __init__(self, metrics: Any) -> None:
        from tests.unit.test_vision_loop import PNG, ImageSuite

        self.task, self.metrics = ImageSuite([PNG]).task, metrics

    def make_env(self) -> Any:
        metrics = self.metrics

        class Env:
            async def reset(self, task: Task) -> str:
                return task.prompt

            async def step(self, action: str) -> StepResult:
                return StepResult(reward=1.0, done=True, info={"metrics": metrics})

            async def close(self) -> None:
                pass

        return Env()


def test_bool_metrics_reach_the_trainer_as_numbers_and_a_metric_that_is_none_is_refused_by_name() -> None:
    from flashrl.wire.protocol import TRAINER_REQUESTS, TrainBatch, TrainStep, encode
    from tests.unit.test_vision_loop import Engine, _sample

    traj, _ = _sample(Engine(), _MetricSuite({"turn1": True, "n": 2}))  # type: ignore[arg-type]
    assert traj.metrics == {"turn1": 1.0, "n": 2.0} and all(type(v) is float for v in traj.metrics.values())
    req = TRAINER_REQUESTS.decode(encode(TrainStep(batch=TrainBatch(step=1, samples=[traj]))))
    assert req.batch.samples[0].metrics == {"turn1": 1.0, "n": 2.0}  # the trainer's decoder takes no bool
    with pytest.raises(ValueError, match=r"info\['metrics'\] \{'note': 'x'\} are not numbers"):
        _sample(Engine(), _MetricSuite({"note": "x", "n": 1}))  # type: ignore[arg-type]
