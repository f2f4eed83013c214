"""An address taken before a child could bind it, for real: the parent picks a TCP port, another process takes it
(here: this test, listening on it), the engine process cannot bind and exits EXIT_ADDRESS_IN_USE before building
vLLM; the launchers start it again on a new address. Seen in CI: a Ray-placed judge engine whose port was taken
during vLLM's start-up never came back and its run waited until the test's deadline. And a judge that can never
come up stops the run with JudgeDown instead of waiting."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import pytest

from flashrl.config import JudgeConfig, load
from flashrl.engine.server import EXIT_ADDRESS_IN_USE
from flashrl.launch.base import Endpoint, tcp_url
from flashrl.launch.local import LocalLauncher
from flashrl.wire.transport import ephemeral_range, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class TakenFirst(LocalLauncher):
    """A local launcher on loopback TCP whose first ``takes`` endpoints per role are a port this test listens on."""

    def __init__(self, run_dir: Path, taken: int, takes: int = 1) -> None:
        super().__init__(run_dir, "127.0.0.1")
        self.taken = taken
        self.left = {"engine": takes, "judge": takes}
        self.given: list[str] = []

    async def endpoint(self, role, index):  # type: ignore[no-untyped-def]
        if self.left.get(role, 0) > 0:
            self.left[role] -= 1
            url = tcp_url("127.0.0.1", self.taken)
            ep = Endpoint(bind=url, connect=url, host="127.0.0.1")
        else:
            ep = await super().endpoint(role, index)
        self.given.append(f"{role}{index} {ep.bind}")
        return ep


@pytest.fixture
def taken_port():  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_free_port_stays_out_of_the_ephemeral_range_and_never_repeats() -> None:
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not any(lo <= p <= hi for p in ports), (lo, hi, sorted(ports)[:5])


def test_an_engine_whose_address_is_taken_exits_with_its_code_at_once(tmp_path: Path, taken_port: int) -> None:
    """Before vLLM is built (seconds, not the ~20 s of a start), with the code the launchers restart on."""
    import subprocess

    from flashrl.engine.client import ENGINE_ARGV, engine_extra_env
    from flashrl.engine.server import EngineSpec
    from flashrl.models.tiny import build_untrained

    model = build_untrained(tmp_path / "m", seed=0)
    spec = EngineSpec(address=tcp_url("127.0.0.1", taken_port), model=str(model), name="taken")
    import os

    t0 = time.monotonic()
    out = subprocess.run([sys.executable, *ENGINE_ARGV[1:]], env={**os.environ, **engine_extra_env(spec)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_ADDRESS_IN_USE, out.stderr[-2000:]
    assert "is taken by another process" in out.stderr
    assert "serving" not in out.stderr and time.monotonic() - t0 < 60


def test_a_judge_engine_whose_address_was_taken_starts_again_on_a_new_one(tmp_path: Path, taken_port: int) -> None:
    from flashrl.judge.engines import JudgeEngines
    from flashrl.models.tiny import build_untrained

    model = build_untrained(tmp_path / "judge", seed=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    launcher = TakenFirst(tmp_path, taken_port)

    async def main() -> None:
        engines = JudgeEngines(JudgeConfig(model=str(model), engines=1, kv_cache_gib=0.25, threads=1), model, logs,
                               max_model_len=64, launcher=launcher)
        await launcher.start()
        try:
            await engines.start(wait=True)
            out = await engines.generate([5, 6, 7], max_tokens=3, temperature=0.0, seed=1)
            assert len(out.token_ids) == 3
            assert engines.counts["judge_engine_start_failed"] == 1 and engines.counts["judge_engine_restarts"] == 1
            assert engines.counts["judge_engines_started"] == 1
            assert "is taken by another process" in (logs / "judge0-1.log").read_text()
        finally:
            await engines.aclose()
            await launcher.close()

    asyncio.run(main())
    assert launcher.given[0].endswith(f":{taken_port}") and not launcher.given[1].endswith(f":{taken_port}")


def test_a_judge_that_can_never_start_raises_judge_down_not_a_wait(tmp_path: Path, taken_port: int) -> None:
    from flashrl.judge.engines import JudgeDown, JudgeEngines
    from flashrl.models.tiny import build_untrained

    model = build_untrained(tmp_path / "judge", seed=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    launcher = TakenFirst(tmp_path, taken_port, takes=10)

    async def main() -> None:
        jc = JudgeConfig(model=str(model), engines=1, kv_cache_gib=0.25, threads=1, max_restarts=1)
        engines = JudgeEngines(jc, model, logs, max_model_len=64, launcher=launcher)
        await launcher.start()
        try:
            await engines.start()
            t0 = time.monotonic()
            with pytest.raises(JudgeDown, match="judge.max_restarts = 1"):
                await engines.generate([5, 6, 7], max_tokens=3, temperature=0.0, seed=1)
            assert time.monotonic() - t0 < jc.startup_timeout_s / 4  # named at once, not at the start-up deadline
            assert engines.counts["judge_engine_start_failed"] == 2 and engines.counts["judge_engine_restarts"] == 1
        finally:
            await engines.aclose()
            await launcher.close()

    asyncio.run(main())


def test_a_policy_engine_whose_address_was_taken_is_started_again_and_joins(tmp_path: Path, taken_port: int) -> None:
    from flashrl.launch.processes import local_cluster
    from flashrl.models.tiny import build_untrained

    model = build_untrained(tmp_path / "model", seed=0)
    cfg = load(ROOT / "configs" / "tiny.toml", [f"run.output_dir={tmp_path}", "run.name=taken", "engine.count=1",
                                                "trainer.ranks=1", "run.dashboard=off"])
    cfg.run_dir.mkdir(parents=True)
    launcher = TakenFirst(cfg.run_dir, taken_port)

    async def main() -> None:
        async with local_cluster(cfg, model, cfg.run_dir, launcher=launcher) as (engines, _trainer):
            assert await engines[0].client.ping() >= 0  # up, joined, serving on the new address
            assert engines[0].address != tcp_url("127.0.0.1", taken_port)

    asyncio.run(main())
    engine_starts = [g for g in launcher.given if g.startswith("engine0")]
    assert len(engine_starts) == 2 and engine_starts[0].endswith(f":{taken_port}"), launcher.given
    assert "is taken by another process" in (cfg.run_dir / "logs" / "engine0.log").read_text()
