"""InprocEngine's thread and commands against a scripted stand-in for vLLM's LLMEngine (the real engine:
tests/integration/test_engine_process.py): requests finish after their steps, commands land between steps, a raising step
fails everything waiting, a halted engine never steps again.

Here the pause/abort tests: an abort answers with vLLM's FinishReason, and importing vLLM starts processes
(platform and cpuinfo probes run `uname` and `file`); the unit tests (none of either) are tests/unit/test_inproc.py."""

from __future__ import annotations

import asyncio

from tests.unit import test_inproc

pair = test_inproc.pair  # the unit module's fixture, shared


async def test_pause_keep_holds_and_abort_answers_the_tokens_so_far(pair) -> None:
    llm, eng = pair
    task = asyncio.create_task(eng.generate("long", None, 10_000))
    await asyncio.sleep(0.1)  # a few steps
    await eng.pause("keep")
    steps = llm.steps
    await asyncio.sleep(0.3)
    assert llm.steps == steps and not task.done()  # no step while paused
    await eng.abort(["long"])
    out = await asyncio.wait_for(task, 10)
    assert out.finish_reason == "abort" and 1 <= len(out.tokens) == steps
    await eng.resume()
    assert len((await asyncio.wait_for(eng.generate("c", None, 2), 10)).tokens) == 2


async def test_pause_wait_drains_and_pause_abort_empties(pair) -> None:
    llm, eng = pair
    a = asyncio.create_task(eng.generate("a", None, 5))
    await asyncio.sleep(0)
    await asyncio.wait_for(eng.pause("wait"), 10)
    assert a.done() and len(a.result().tokens) == 5
    b = asyncio.create_task(eng.generate("b", None, 5))
    await asyncio.sleep(0.2)
    assert not b.done()  # paused
    await asyncio.wait_for(eng.pause("abort"), 10)
    assert (await asyncio.wait_for(b, 10)).finish_reason == "abort"
