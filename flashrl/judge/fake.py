"""A stand-in for JudgeEngines (tests, the simulator): verdict tokens from a function of the prompt's ids, and
engine failures ("engine_died", "engine_timeout", "engine_error") and refusals ("refused") on demand, counted as
JudgeEngines counts them.

    fake = FakeJudgeEngines(lambda ids: [ord("P")], fail=["engine_died"])
    client = JudgeClient(JudgeConfig(model="x"), fake, tokenizer)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from flashrl.aio import BusyTime
from flashrl.judge.engines import JudgeEngineFailed, JudgeRefused
from flashrl.wire.protocol import Generated

__all__ = ["FakeJudgeEngines"]


class FakeJudgeEngines:
    def __init__(self, fn: Callable[[list[int]], list[int]], *, fail: list[str] | None = None,
                 max_model_len: int = 1 << 20, eos: int | None = None) -> None:
        self.fn = fn
        self.max_model_len = max_model_len  # as JudgeEngines': the longest prompt + answer an engine takes
        self.eos = eos  # the EOS id: an answer cut at max_tokens before it finishes "length" (None: never)
        self.fail = list(fail or [])
        self.counts: Counter[str] = Counter()
        self.busy = BusyTime(1)  # nothing counted: the fake answers at once
        self.requests: list[tuple[list[int], float]] = []  # (prompt ids, temperature)
        self.closed = False

    def pids(self) -> list[int]:
        return []

    async def start(self, wait: bool = False) -> None:
        self.counts["judge_engines_started"] += 1

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int) -> Generated:
        self.requests.append((list(prompt_ids), temperature))
        if self.fail:
            reason = self.fail.pop(0)
            if reason == "refused":  # the engine's Error reply for this request alone
                raise JudgeRefused(f"fake refusal of {len(prompt_ids)} prompt tokens")
            if reason == "engine_died":
                self.counts["judge_engine_died"] += 1
                self.counts["judge_engine_restarts"] += 1
            raise JudgeEngineFailed(reason, f"fake {reason}")
        out = self.fn(prompt_ids)
        cut = len(out) > max_tokens and self.eos is not None and self.eos not in out[:max_tokens]
        return Generated(request_id=f"judge-{seed}", token_ids=out[:max_tokens], finish_reason="length" if cut else "stop")

    async def aclose(self) -> None:
        self.closed = True
