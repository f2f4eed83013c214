"""A user's reward function, as flashrl loads it by reference (configs/dataset.toml):

    [env.params]
    reward = "examples.arith_reward:score"      # or "./examples/arith_reward.py:score"

flashrl calls ``score(row, response)`` off its event loop (a thread; async functions run on the loop).
``row`` holds ``id``, ``prompt`` (the text the model saw), ``answer`` and the columns listed in
``env.params.extra`` (here ``carry``); ``response`` is the text the model wrote. The returned dict's
``reward`` trains the policy; its other numbers are logged per step as ``reward/<name>`` (the mean
over the samples that report it) in metrics.jsonl, TensorBoard and W&B; ``correct`` decides
held-out accuracy. Raising is not a 0: flashrl counts it as an infrastructure failure, logs the
traceback and retries the rollout.
"""

from __future__ import annotations

import re

_INT = re.compile(r"[+-]?\d{1,12}")


def score(row: dict, response: str) -> dict:
    text = response.strip()
    parsed = _INT.fullmatch(text) is not None
    correct = parsed and int(text) == int(row["answer"])
    out = {
        "reward": 1.0 if correct else 0.0,
        "correct": correct,
        "parsed": float(parsed),  # the share of answers that are a plain integer
        # |error| of the answers that parse, capped so one wild answer does not dominate the mean
        **({"abs_error": float(min(abs(int(text) - int(row["answer"])), 100))} if parsed else {}),
    }
    if row["carry"]:  # accuracy on the problems whose units digits carry (the warm-start slips there)
        out["carry_accuracy"] = float(correct)
    return out
