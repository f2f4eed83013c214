"""Verdicts: the judge's prompt from its template, its answer parsed, failures retried.

    score((prompt, response)) -> 1.0 (pass) | 0.0 (fail) | judge.unparsable_reward (after the parse retries, or
                                 refused); verdict = "score": (score - score_min) / (score_max - score_min), in [0, 1]
        text = judge.template.format(prompt=..., response=response up to its EOS mark, stripped, FENCE's tags
               removed: the default template fences the response in <response>...</response>, and a response
               cannot close the fence itself and write text the judge would take for the template's)
        ids  = the judge's tokenizer (no special tokens) -> JudgeEngines.generate (vLLM batches the concurrent
               requests itself: every episode's verdict is one request, in flight beside the policy's)
        an engine that died / hung / refused -> retried on a live (or restarted) engine, judge.retries times
               (judge_retries, judge_engine_<reason>), then RewardFailed -> EnvFailure: never a verdict of 0
        a text the judge cannot read (its tokens + judge.max_new_tokens past the engines' max_model_len, or the
               engine answered Error for it: vLLM's input check) -> judge_refused, judge.unparsable_reward at once:
               the same text would be refused again, so it is neither retried nor an engine failure
        the judge's answer cut at judge.max_new_tokens (finish "length") -> unparsable: only an answer the judge
               finished is read (a judge that copies the response it judges, cut off right after a "1" the
               response wrote, would otherwise pass it)
        a verdict neither pattern matches (or, scores: no number in range) -> judge_unparsable; "retry": asked again at temperature 1
               (judge_parse_retries), up to judge.parse_retries times; then (or at once with "default")
               judge.unparsable_reward (judge_defaulted)
        the same judge text again (greedy judge, judge.cache_size > 0) -> the verdict already given, or the one
               being given (ScoreMemo; judge_cached): only a greedy verdict that parsed at once is kept

``parse_verdict`` and ``parse_score`` are the parsers on their own (unit-tested).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from flashrl.config import JudgeConfig
from flashrl.env import cut_at_eos
from flashrl.judge.engines import JudgeEngineFailed, JudgeRefused
from flashrl.rewardmodel.memo import ScoreMemo
from flashrl.rewards import RewardFailed
from flashrl.wire.protocol import Generated

__all__ = ["FENCE", "JudgeClient", "judge_text", "parse_score", "parse_verdict", "verdict_parser"]

log = logging.getLogger("flashrl.judge")

FENCE = ("<response>", "</response>")  # the default judge.template's fence around the policy's response


def judge_text(template: str, prompt: str, response: str) -> str:
    """The judge's text: ``template`` with the policy's prompt and its response (up to its EOS mark, stripped,
    without FENCE's tags: whatever the template, the response cannot open or close the fence)."""
    body = cut_at_eos(response)
    for tag in FENCE:
        body = body.replace(tag, "")
    return template.format(prompt=prompt, response=body.strip())


def parse_verdict(text: str, pass_re: re.Pattern[str], fail_re: re.Pattern[str]) -> float | None:
    """1.0 for pass, 0.0 for fail, None when the text is neither (or both patterns match: ambiguous)."""
    ok, bad = pass_re.search(text) is not None, fail_re.search(text) is not None
    if ok == bad:
        return None
    return 1.0 if ok else 0.0


def parse_score(text: str, score_re: re.Pattern[str], lo: float, hi: float) -> float | None:
    """The score ``score_re``'s first group holds in its last match, mapped from [lo, hi] to [0, 1]; None when
    there is no match, it is not a number, or it lies outside [lo, hi] (garbage, not a verdict to clip)."""
    matches = list(score_re.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    try:
        x = float(last.group(1))
    except (TypeError, ValueError):
        return None
    if not lo <= x <= hi:  # also NaN
        return None
    return (x - lo) / (hi - lo)


def verdict_parser(jc: JudgeConfig) -> Callable[[str], float | None]:
    """judge.verdict's reader: text -> the verdict in [0, 1], or None (unparsable)."""
    if jc.verdict == "score":
        score_re, lo, hi = re.compile(jc.score_pattern), jc.score_min, jc.score_max
        return lambda text: parse_score(text, score_re, lo, hi)
    pass_re, fail_re = re.compile(jc.pass_pattern), re.compile(jc.fail_pattern)
    return lambda text: parse_verdict(text, pass_re, fail_re)


class JudgeClient:
    def __init__(self, jc: JudgeConfig, engines: Any, tokenizer: Any) -> None:
        self.jc = jc
        self.engines = engines  # JudgeEngines, or anything with its generate/start/aclose/counts/pids/busy (aio.BusyTime)
        # and, optionally, its max_model_len
        self.tok = tokenizer
        self.parse = verdict_parser(jc)
        self.counts: Counter[str] = Counter()
        self.latency_s = 0.0
        self._ids = itertools.count()
        # a sampled verdict is a draw, not the judge's answer to the text: only a greedy judge's are shared
        self.memo = ScoreMemo(jc.cache_size if jc.temperature == 0 else 0)

    @property
    def counters(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counts)
        out.update(self.engines.counts)
        out["judge_busy_s"] = round(self.engines.busy.busy_s, 3)
        out["judge_inflight"] = sum(self.engines.busy.inflight)
        out["judge_cached"] = self.memo.reused
        if self.counts["judge_verdicts"]:
            out["judge_latency_ms"] = 1000 * self.latency_s / self.counts["judge_verdicts"]
        return out

    def pids(self) -> list[int]:
        return list(self.engines.pids())

    async def start(self) -> None:
        await self.engines.start()

    async def score(self, item: tuple[str, str]) -> float:
        prompt, response = item
        text = judge_text(self.jc.template, prompt, response)
        return await self.memo.get(text, lambda: self._verdict(text))

    def _refused(self, why: str) -> tuple[float, bool]:
        """A text the judge cannot read: judge.unparsable_reward, counted apart (never an engine failure)."""
        self.counts["judge_refused"] += 1
        if self.counts["judge_refused"] == 1:  # the first said; the rest counted (env/judge_refused)
            log.warning("judge: a verdict refused for its input (it gets judge.unparsable_reward = %s; counted as "
                        "env/judge_refused): %s", self.jc.unparsable_reward, why)
        return self.jc.unparsable_reward, False

    async def _verdict(self, text: str) -> tuple[float, bool]:
        """The judge's verdict on ``text`` and whether it may be given again (greedy, parsed at the first try)."""
        clock = asyncio.get_running_loop().time  # time.monotonic on a real loop; virtual time in the simulator
        ids = self.tok.encode(text, add_special_tokens=False)
        limit = getattr(self.engines, "max_model_len", None)  # JudgeEngines' (a stand-in may have none)
        if limit is not None and len(ids) + self.jc.max_new_tokens > limit:
            return self._refused(f"{len(ids)} tokens + judge.max_new_tokens = {self.jc.max_new_tokens} > the judge's "
                                 f"max_model_len = {limit}")
        t0 = clock()
        tries = 1 + (self.jc.parse_retries if self.jc.on_unparsable == "retry" else 0)
        for attempt in range(tries):
            temperature = self.jc.temperature if attempt == 0 else 1.0  # greedy again would say the same
            try:
                got = await self._generate(ids, temperature)
            except JudgeRefused as e:
                return self._refused(str(e))
            out = list(got.token_ids)
            self.counts["judge_tokens"] += len(out)
            # an answer cut at max_new_tokens is no verdict: what it ends with may be the response it copied
            verdict = None if got.finish_reason == "length" else self.parse(self.tok.decode(out, skip_special_tokens=True))
            if verdict is not None:
                self.counts["judge_verdicts"] += 1
                self.counts["judge_pass"] += int(verdict > 0.5)  # pass; a score in the upper half of its range
                self.latency_s += clock() - t0
                return verdict, attempt == 0
            self.counts["judge_unparsable"] += 1
            if attempt + 1 < tries:
                self.counts["judge_parse_retries"] += 1
        self.counts["judge_defaulted"] += 1
        self.counts["judge_verdicts"] += 1
        self.latency_s += clock() - t0
        return self.jc.unparsable_reward, False

    async def _generate(self, ids: list[int], temperature: float) -> Generated:
        failure: JudgeEngineFailed | None = None
        for attempt in range(self.jc.retries + 1):
            try:
                got = await self.engines.generate(ids, max_tokens=self.jc.max_new_tokens, temperature=temperature,
                                                  seed=next(self._ids))
            except JudgeEngineFailed as e:
                failure = e
                self.counts[f"judge_{e.reason}"] += 1
                if attempt < self.jc.retries:
                    self.counts["judge_retries"] += 1
                    # one line per verdict would flood the log when an engine with hundreds in flight dies (its
                    # death is logged once, by the engine's watcher); the counters carry the numbers
                    log.debug("judge: %s; retrying the verdict (retry %d of %d)", e, attempt + 1, self.jc.retries)
                continue
            return got
        assert failure is not None
        self.counts["judge_failed"] += 1
        raise RewardFailed(f"judge_{failure.reason}", failure.detail)

    async def aclose(self) -> None:
        await self.engines.aclose()
        await self.memo.aclose()  # a verdict still being asked for, cancelled once the engines are gone
