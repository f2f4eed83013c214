"""The judge's vLLM engine processes (the pool of flashrl/engine/served.py): the policy's engine server serving the judge's
weights, never synced, restarted when one dies.

    JudgeEngines.start(): spawn judge.engines engine processes through the run's launcher (role "judge": local,
                          Ray placement group, SLURM layout), wait until each answers Ping; one watcher per engine
    generate(ids)       : the least-loaded live engine; Generate -> Generated within judge.timeout_s;
                          its death (PeerDead), a refusal or the deadline -> JudgeEngineFailed(reason)
    watcher(i)          : awaits engine i's exit -> fails its client at once (every request on it raises
                          PeerDead now, not at a missed heartbeat) -> counted (judge_engine_died) -> restarted
                          (judge_engine_restarts) unless judge.max_restarts are spent; the others serve meanwhile
    a start that fails  : (vLLM refused, its address taken, the deadline) counted (judge_engine_start_failed) and
                          tried again as a restart, with backoff; once every engine's restarts are spent,
                          generate raises JudgeDown and the run stops, named (never an endless wait)
    a task that crashes : a start or watcher task that ends by an error (a launcher's kill or stop raising, a
                          bug) or a cancel not aclose's: logged at once, and every generate from then on (the
                          verdicts waiting for an engine too) raises aio.TaskDied naming the task and its error:
                          the run stops at once, never waiting judge.startup_timeout_s for an engine that
                          nothing will start
    a request refused   : the engine answered Error for this request alone (vLLM refused its input: a prompt
                          longer than the judge's max_model_len) -> JudgeRefused, not an engine failure
    aclose()            : watchers cancelled, every engine terminated (Shutdown, SIGTERM, SIGKILL to its group)

Invariants: a request goes only to an engine that answered Ping and has not exited; ``generate`` waits for a
live engine at most judge.startup_timeout_s (a restart), then fails loudly; nothing here updates weights.
Placement: the run's launcher (cluster.launcher) places judge engine i as (role "judge", i), beside the policy's
engines and trainer ranks: a restart is spawned again in the same place (the same Ray bundle, the same SLURM node).
Without a launcher (tests, a judge used on its own) a local launcher of its own starts them on this machine.
On cuda the judge runs on engine.device; locally each judge engine gets a GPU of its own after the trainer ranks'
and the policy engines' when the machine has enough (else it shares, judge.gpu_memory_utilization).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from flashrl.config import JudgeConfig
from flashrl.engine.served import ServedEngines
from flashrl.launch.base import Launcher
from flashrl.launch.local import LocalLauncher
from flashrl.wire.protocol import Generate, Generated
from flashrl.wire.transport import PeerDead, RemoteError, TransportError

__all__ = ["JudgeDown", "JudgeEngineFailed", "JudgeEngines", "JudgeRefused"]

log = logging.getLogger("flashrl.judge")


class JudgeEngineFailed(Exception):
    """A verdict request failed for the engine's sake: ``reason`` is engine_died | engine_timeout | engine_error."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class JudgeRefused(Exception):
    """The judge refused this verdict request for its input (its engine is healthy and would refuse it again):
    the judge's text is longer than its max_model_len leaves room for, or vLLM's input check failed."""


class JudgeDown(RuntimeError):
    """Every judge engine is down and none can come back (judge.max_restarts spent): the run cannot be judged and
    stops, naming it (not an infrastructure retry: no verdict could ever come)."""


class JudgeEngines(ServedEngines):
    """The judge's engines (flashrl/engine/served.py: started, watched, restarted); ``jc`` is [judge]."""

    Down = JudgeDown
    what = "judge"
    prefix = "judge_"
    names = "judge"
    restarts_key = "judge.max_restarts"

    def __init__(self, jc: JudgeConfig, model: str | Path, logs: Path, *, launcher: Launcher | None = None,
                 **kw: Any) -> None:
        """``launcher``: the run's, or None: a local launcher of the judge's own (closed by ``aclose``)."""
        super().__init__(jc, model, logs, launcher=launcher or LocalLauncher(logs.parent), own_launcher=launcher is None,
                         **kw)
        self.jc = jc

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int) -> Generated:
        """One verdict's tokens from the least-loaded live engine; JudgeEngineFailed when that engine fails."""
        try:
            i, ep = await self.live()
        except TimeoutError:
            raise JudgeEngineFailed("engine_died", f"no judge engine alive within judge.startup_timeout_s = "
                                                   f"{self.jc.startup_timeout_s} s") from None
        req = Generate(request_id=f"judge-{seed}", prompt_ids=prompt_ids, max_tokens=max_tokens,
                       temperature=temperature, seed=seed)
        try:
            with self.busy.request(i):
                async with asyncio.timeout(self.jc.timeout_s):
                    return await ep.client.generate(req)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await ep.client.abort([req.request_id])
            raise JudgeEngineFailed("engine_timeout", f"judge engine {i} gave no verdict within judge.timeout_s = "
                                                      f"{self.jc.timeout_s} s") from None
        except PeerDead as e:
            raise JudgeEngineFailed("engine_died", f"judge engine {i} died: {e}") from None
        except RemoteError as e:  # this request alone (the engine answered): asked again, it is refused again
            raise JudgeRefused(f"judge engine {i} refused the verdict request ({len(prompt_ids)} prompt tokens, "
                               f"max_model_len {self.max_model_len}): {e}") from None
        except TransportError as e:
            raise JudgeEngineFailed("engine_error", f"judge engine {i} failed the request: {e}") from None
