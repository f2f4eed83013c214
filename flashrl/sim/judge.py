"""The simulator's judge stage: a generative judge's engines as simulated engines, for the real JudgeClient.

    SimJudgeEngines(engines, tok, p_pass, seed, overhead_s)  implements what JudgeClient asks of JudgeEngines
      generate(ids, max_tokens, ...) -> after ``overhead_s`` (the request's way to the engine process and
                                         back, outside its steps and its busy time), the least-loaded
                                         SimEngine runs the verdict as one more request
                                         (its continuous batching, prefill and decode times, on virtual
                                         time) -> the tokens: spaces, then "1" (pass) or "0" (fail), the
                                         verdict drawn from (seed, request) with probability p_pass
      counts, busy (aio.BusyTime), pids, start, aclose: as JudgeEngines keeps them
    SimJudgeTokenizer(tok)                         a SimTokenizer with the keyword arguments JudgeClient passes
    ReusedVerdicts(client, reuse, p_pass, seed)    the client with a share ``reuse`` of the episodes answered at
                                                   once, counted as judge_cached (judge.cache_size's reuse)

What it models: the judge's requests queue and batch on engines of their own, beside the policy's, and
each takes its prompt's prefill and its verdict's decode steps; a verdict's length is the engines' length
model (set it to the fitted tokens per verdict, ``dist = "constant"``). What it does not: what the judge
says (a fixed pass rate, not the answer's correctness), engine deaths (the real JudgeEngines' restarts are
tested on real processes), which texts repeat (a real run's judge.cache_size reuses the verdict of a text
asked before; here a fitted share ``reuse`` of the episodes, drawn per episode, takes no engine time).
``flashrl bench calibrate`` fits the tokens per verdict, the pass rate and the reused share from a real
run's ``env/judge_*`` counters (flashrl/bench/calibrate.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from flashrl.aio import BusyTime
from flashrl.sim.engine import SimEngine, uniform
from flashrl.sim.envs import SimTokenizer
from flashrl.wire.protocol import Generate, Generated

__all__ = ["ReusedVerdicts", "SimJudgeEngines", "SimJudgeTokenizer", "judge_engines"]


class SimJudgeTokenizer:
    """``tok`` as JudgeClient calls a Hugging Face tokenizer (``add_special_tokens``, ``skip_special_tokens``)."""

    def __init__(self, tok: SimTokenizer) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids)


class ReusedVerdicts:
    """``client`` (a JudgeClient) with a share ``reuse`` of its episodes answered at once: drawn from (seed, the
    episode's number), the verdict a pass with probability ``p_pass``, counted as ``judge_cached``."""

    def __init__(self, client: Any, reuse: float, *, p_pass: float, seed: int = 0) -> None:
        if not 0.0 <= reuse < 1.0:
            raise ValueError(f"reuse must be in [0, 1), got {reuse}")
        self.client = client
        self.reuse = reuse
        self.p_pass = p_pass
        self.seed = seed
        self.cached = 0
        self._n = 0

    @property
    def counters(self) -> dict[str, float]:
        return {**self.client.counters, "judge_cached": self.cached}

    def pids(self) -> list[int]:
        return list(self.client.pids())

    async def start(self) -> None:
        await self.client.start()

    async def score(self, item: tuple[str, str]) -> float:
        self._n += 1
        n = str(self._n).encode()
        if uniform(self.seed, n, b"reuse") < self.reuse:
            self.cached += 1
            return 1.0 if uniform(self.seed, n, b"reused verdict") < self.p_pass else 0.0
        return float(await self.client.score(item))

    async def aclose(self) -> None:
        await self.client.aclose()


class SimJudgeEngines:
    def __init__(self, engines: list[SimEngine], tok: SimTokenizer, *, p_pass: float, seed: int = 0,
                 overhead_s: float = 0.0) -> None:
        if not engines:
            raise ValueError("SimJudgeEngines needs at least one engine")
        if not 0.0 <= p_pass <= 1.0:
            raise ValueError(f"p_pass must be in [0, 1], got {p_pass}")
        if overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
        self.overhead_s = overhead_s
        self.engines = engines
        self.tok = tok
        self.p_pass = p_pass
        self.seed = seed
        self.counts: Counter[str] = Counter()
        self.busy = BusyTime(len(engines))  # verdicts in flight per engine, busy time summed (as JudgeEngines)
        self._n = 0

    def pids(self) -> list[int]:
        return []

    async def start(self, wait: bool = False) -> None:
        self.counts["judge_engines_started"] += len(self.engines)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int) -> Generated:
        i = self.busy.least_loaded(range(len(self.engines)))
        self._n += 1
        rid = f"judge-{self._n}"
        if self.overhead_s:  # outside the engine's busy time: calibrate fits that to the engine's work (scale)
            await asyncio.sleep(self.overhead_s)
        with self.busy.request(i):
            out = await self.engines[i].generate(Generate(request_id=rid, prompt_ids=list(prompt_ids),
                                                          max_tokens=max_tokens, temperature=temperature, seed=seed))
        n = max(1, len(out.token_ids))
        verdict = "1" if uniform(self.seed, rid.encode(), b"verdict") < self.p_pass else "0"
        return Generated(request_id=rid, token_ids=self.tok.encode(" " * (n - 1) + verdict))

    async def aclose(self) -> None:
        for e in self.engines:
            await e.close()


def judge_engines(n: int, latency: Any, verdict_tokens: float, tok: SimTokenizer, *, p_pass: float,
                  seed: int = 0, overhead_s: float = 0.0) -> SimJudgeEngines:
    """``n`` simulated judge engines with the policy engine's ``latency`` model, verdicts of
    ``verdict_tokens`` tokens (rounded, at least 1), ``overhead_s`` per request outside the engine's steps."""
    from flashrl.sim.engine import LengthModel

    lengths = LengthModel(dist="constant", median=max(1.0, round(verdict_tokens)))
    engines = [SimEngine(f"judge{i}", latency, lengths, seed=seed + 1000 + i, vocab_size=tok.vocab_size)
               for i in range(n)]
    return SimJudgeEngines(engines, tok, p_pass=p_pass, seed=seed, overhead_s=overhead_s)
