"""The guessing game (envs/guess.py) and the fault wrapper through the real rollout coroutine.

Fake engines on the virtual clock (flashrl.sim.fake): the token layout is asserted exactly, and
injected env faults become the rollout's counted retries and failures.
"""

from __future__ import annotations

from typing import Any

import msgspec

from envs import make_suite
from flashrl.config import Config
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.env import Task
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeTokenizer
from flashrl.wire.protocol import Generate

TOK = FakeTokenizer()
TASK = Task(id="guess-x", prompt="Guess 0-9:\n", answer="7")


def _run(env_params: dict[str, Any], guesses: list[str], **rollout: Any) -> tuple[Any, FakeEngine, RolloutContext]:
    def script(req: Generate, version: int) -> tuple[list[int], float]:
        turn = int(req.request_id.split(".")[-1])
        return TOK.encode(guesses[turn]) + [TOK.eos_token_id], 1.0

    cfg = msgspec.convert({"rollout": {"max_turns": 4, "max_new_tokens": 3} | rollout, "model": {"max_model_len": 128}}, Config)
    eng = FakeEngine("e0", script)
    ctx = RolloutContext(
        cfg=cfg, tokenizer=TOK, suite=make_suite("guess", env_params, 0, 4), engines=[eng],
        router=Router(1, cfg.engine.max_num_seqs), version=lambda: 0,
    )  # fmt: skip
    spec = RolloutSpec(task=TASK, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    return run_virtual(lambda: run_sample(ctx, spec, 0)).result, eng, ctx


def test_guess_episode_token_layout_with_delays() -> None:
    params = {"max_number": 9, "max_turns": 4, "discount": 0.5, "faults": {"delay": {"kind": "constant", "seconds": 2.0}}}
    t, eng, ctx = _run(params, ["4", "6", "7"])
    g = [TOK.encode(x) + [TOK.eos_token_id] for x in ("4", "6", "7")]
    obs = TOK.encode(" higher\n")
    assert t.status == "ok" and t.turns == 3 and t.reward == 0.25
    assert t.prompt_ids == TOK.encode("Guess 0-9:\n")
    assert t.response_ids == g[0] + obs + g[1] + obs + g[2]
    assert t.loss_mask == [1, 1] + [0] * 8 + [1, 1] + [0] * 8 + [1, 1]
    assert [v for v, m in zip(t.versions, t.loss_mask) if not m] == [-1] * 16
    assert [v for v, m in zip(t.versions, t.loss_mask) if m] == [0] * 6
    assert all(lp == 0.0 for lp, m in zip(t.behav_logp, t.loss_mask) if not m)
    # token in, token out: each turn's prompt is the previous ids, never re-tokenized text
    assert eng.requests[1].prompt_ids == t.prompt_ids + g[0] + obs
    assert eng.requests[2].prompt_ids == t.prompt_ids + g[0] + obs + g[1] + obs
    assert t.env_s == 8.0 and t.gen_s == 3.0  # reset + 3 steps at 2 s each; 3 turns at 1 s each
    assert ctx.suite.counters["calls"] == 4


def test_hanging_env_is_cut_by_the_turn_deadline_and_counted() -> None:
    t, _, ctx = _run({"faults": {"hang": 1.0}}, ["5"], turn_timeout_s=3.0, max_retries=1)
    assert t.status == "failed" and t.failure == "env_timeout" and t.attempts == 2
    assert ctx.counters["rollout/retry_env_timeout"] == 1 and ctx.counters["rollout/failed_env_timeout"] == 1
    assert ctx.suite.counters["hang"] == 2


def test_garbage_observation_becomes_a_counted_env_failure() -> None:
    t, _, ctx = _run({"faults": {"garbage": 1.0}}, ["5"], max_retries=0)
    assert t.status == "failed" and t.failure == "env_garbage"
    assert ctx.counters["rollout/failed_env_garbage"] == 1
    assert sum(v for k, v in ctx.suite.counters.items() if k.startswith("rejected:")) == 1
