"""InprocEngine's thread and commands against a scripted stand-in for vLLM's LLMEngine (the real engine:
tests/integration/test_engine_process.py): requests finish after their steps, commands land between steps, a raising step
fails everything waiting, a halted engine never steps again."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from flashrl.engine.inproc import EngineDead, InprocEngine


@dataclass
class _Out:
    request_id: str
    finished: bool
    tokens: list[int]
    finish_reason: str = "length"


@dataclass
class _State:
    external: str
    tokens: list[int] = field(default_factory=list)

    def make_request_output(self, new, pooling, finish_reason, stop_reason) -> _Out:
        return _Out(self.external, True, list(self.tokens), "abort")


class _Proc:
    def __init__(self) -> None:
        self.external_req_ids: dict[str, list[str]] = {}
        self.request_states: dict[str, _State] = {}


class FakeLLM:
    """Each request needs ``params`` steps; every step appends one token to each running request."""

    def __init__(self) -> None:
        self.output_processor = _Proc()
        self.steps = 0
        self.fail_at: int | None = None
        self.thread_ids: set[int] = set()
        self.engine_core = object()
        self.gate = threading.Event()
        self.gate.set()

    def add_request(self, key: str, prompt: Any, params: int) -> None:
        self.thread_ids.add(threading.get_ident())
        if params < 1:
            raise ValueError("max_tokens must be >= 1")
        self.output_processor.external_req_ids[key] = [key + "-i"]
        self.output_processor.request_states[key + "-i"] = _State(key)
        self._need = getattr(self, "_need", {})
        self._need[key] = params

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states)

    def abort_request(self, keys: list[str]) -> None:
        for k in keys:
            for i in self.output_processor.external_req_ids.pop(k, []):
                self.output_processor.request_states.pop(i, None)

    def step(self) -> list[_Out]:
        self.thread_ids.add(threading.get_ident())
        self.gate.wait(5)
        time.sleep(0.002)  # a step takes time, as a model forward does
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("CUDA error: device-side assert triggered")
        outs = []
        for i, st in list(self.output_processor.request_states.items()):
            st.tokens.append(self.steps)
            if len(st.tokens) >= self._need[st.external]:
                del self.output_processor.request_states[i]
                del self.output_processor.external_req_ids[st.external]
                outs.append(_Out(st.external, True, list(st.tokens)))
        return outs


@pytest.fixture
async def pair():
    llm = FakeLLM()
    eng = InprocEngine(llm, asyncio.get_running_loop(), name="t")
    yield llm, eng
    eng.shutdown(5)


async def test_requests_finish_on_the_engine_thread(pair) -> None:
    llm, eng = pair
    outs = await asyncio.wait_for(asyncio.gather(eng.generate("a", None, 3), eng.generate("a", None, 1)), 10)
    assert [len(o.tokens) for o in outs] == [3, 1]  # the same caller id twice: two requests
    assert threading.get_ident() not in llm.thread_ids and len(llm.thread_ids) == 1
    with pytest.raises(ValueError, match="max_tokens"):  # a bad request fails alone
        await asyncio.wait_for(eng.generate("bad", None, 0), 10)
    assert len((await asyncio.wait_for(eng.generate("b", None, 2), 10)).tokens) == 2
    assert eng.steps == llm.steps >= 5 and eng.step_s >= 0.002 * eng.steps  # each fake step sleeps 2 ms
    assert eng.utilization().startswith("stepping ")


async def test_occupancy_is_the_engine_threads_share_of_the_time_since_it_was_last_read(pair) -> None:
    llm, eng = pair
    assert eng.occupancy() == {}  # no command yet
    await asyncio.wait_for(eng.generate("a", None, 200), 10)  # ~200 steps of 2 ms back to back
    busy = eng.occupancy()
    assert set(busy) == {"stepping", "commands"} and busy["stepping"] > 0.5
    await asyncio.sleep(0.5)  # idle: the next reading covers only this
    idle = eng.occupancy()
    assert idle["stepping"] < 0.05 and idle["commands"] < 0.05


async def test_a_step_that_raises_fails_every_waiter_and_later_call(pair) -> None:
    llm, eng = pair
    llm.fail_at = 3
    waiting = [asyncio.create_task(eng.generate(str(i), None, 100)) for i in range(3)]
    for t in waiting:
        with pytest.raises(EngineDead, match="device-side assert"):
            await asyncio.wait_for(t, 10)
    assert eng.errored
    with pytest.raises(EngineDead):
        await eng.generate("late", None, 1)
    with pytest.raises(EngineDead):
        await eng.call(lambda llm: None)


async def test_call_runs_between_steps_and_halt_stops_stepping(pair) -> None:
    llm, eng = pair
    task = asyncio.create_task(eng.generate("x", None, 10_000))
    seen: list[int] = []

    def inside(fake: FakeLLM) -> str:
        seen.append(fake.steps)
        fake.gate.clear()  # a step starting now would block: none may start while this runs
        threading.Event().wait(0.2)
        seen.append(fake.steps)
        fake.gate.set()
        eng.halt()
        return "ok"

    await asyncio.sleep(0.05)
    assert await asyncio.wait_for(eng.call(inside), 10) == "ok"
    assert seen[0] == seen[1]
    steps = llm.steps
    await asyncio.sleep(0.3)
    assert llm.steps == steps and not task.done()  # halted: never another step
    task.cancel()
