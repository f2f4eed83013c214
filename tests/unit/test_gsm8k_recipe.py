"""The GPU recipe's pieces, checked on the CPU: configs/gsm8k-qwen.toml (the recipe itself is not run here).

Its keys are ones flashrl accepts (config and the dataset environment's params), and the math reward
scores a boxed answer against a GSM8K final answer as the recipe's data preparation makes it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from flashrl.config import load

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "gsm8k-qwen.toml"


def test_recipe_keys_are_valid_and_use_the_chat_template() -> None:
    from envs.dataset import DatasetParams

    cfg = load(RECIPE)
    assert cfg.env.name == "dataset" and cfg.model.chat_template == "on" and cfg.model.system_prompt
    params = msgspec.convert(cfg.env.params, DatasetParams, strict=True)  # every [env.params] key exists
    assert params.reward == "math" and params.prompt == "question"


def test_math_reward_scores_a_boxed_gsm8k_answer() -> None:
    pytest.importorskip("math_verify")
    from flashrl.rewards import math_verify_reward

    final = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072".split("####")[-1].strip().replace(",", "")
    assert final == "1072"  # the recipe's preparation: the number after "####", commas removed
    assert math_verify_reward({"answer": final}, "So she sold \\boxed{1072} clips.")["reward"] == 1.0
    assert math_verify_reward({"answer": final}, "So she sold \\boxed{1071} clips.")["reward"] == 0.0


def test_engines_get_their_own_gpus_when_there_are_enough() -> None:
    from flashrl.launch.processes import engine_gpu

    eight = [str(k) for k in range(8)]
    assert [engine_gpu(i, 4, 4, eight) for i in range(4)] == ["4", "5", "6", "7"]  # trainer ranks hold 0-3
    assert [engine_gpu(i, 1, 2, ["3", "5", "6"]) for i in range(2)] == ["5", "6"]  # CUDA_VISIBLE_DEVICES ids
    assert engine_gpu(0, 1, 1, ["0"]) is None  # one GPU for both: not pinned, shared
