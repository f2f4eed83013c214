"""One answer per question: a frozen model's score of the same text, asked again, is not computed again.

    memo = ScoreMemo(size)                   size = answers kept (least recently used first out); 0 = off
    await memo.get(text, compute)            -> compute()'s value; compute() -> (value, keep)
        text answered before (kept)          -> that value at once                       (memo.reused += 1)
        text being answered now              -> the same answer when it comes, one compute (memo.reused += 1)
        otherwise                            -> compute() in a task of its own; kept when ``keep``

Why it holds: the reward model and a greedy judge never change during a run (their weights are frozen,
a greedy verdict is a function of its prompt), so a GRPO group whose answers agree, and held-out evals
that ask the same prompts again, need one score per distinct text. What is kept is a 16-byte digest of
the text and the value, ~150 bytes an answer. Sampled verdicts (judge.temperature > 0) are never
shared: the client does not use the memo for them.

Failures and cancellation: compute runs in its own task, so a waiter cancelled (a redundant episode
dropped) does not cancel the answer others wait for; a compute that fails fails every waiter with its
exception (the caller's infrastructure-failure path: the episode is retried) and keeps nothing.
``aclose`` (called after the model's client has closed, which fails what it still had) cancels any
compute still running.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

__all__ = ["ScoreMemo"]


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class ScoreMemo:
    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"ScoreMemo size must be >= 0, got {size}")
        self.size = size
        self.reused = 0  # answers given without a compute of their own
        self._kept: OrderedDict[bytes, float] = OrderedDict()
        self._running: dict[bytes, asyncio.Task[float]] = {}

    async def get(self, text: str, compute: Callable[[], Awaitable[tuple[float, bool]]]) -> float:
        if not self.size:
            return (await compute())[0]
        key = _key(text)
        if key in self._kept:
            self._kept.move_to_end(key)
            self.reused += 1
            return self._kept[key]
        task = self._running.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._compute(key, compute), name="score-memo")
            task.add_done_callback(_retrieve)
            self._running[key] = task
        else:
            self.reused += 1
        return await asyncio.shield(task)

    async def _compute(self, key: bytes, compute: Callable[[], Awaitable[tuple[float, bool]]]) -> float:
        try:
            value, keep = await compute()
        finally:
            self._running.pop(key, None)
        if keep:
            self._kept[key] = value
            if len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return value

    async def aclose(self) -> None:
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _retrieve(task: asyncio.Task[float]) -> None:
    """A compute whose every waiter was cancelled may still fail: its exception is read here, not warned about."""
    if not task.cancelled():
        task.exception()
