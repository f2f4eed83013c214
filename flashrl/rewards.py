"""Rewards by name or by reference, run off the event loop.

    reward = "exact"                  the response (stripped) equals the row's answer
    reward = "regex"                  ``answer_pattern`` extracts the answer from the response (group
                                      "answer", else group 1, else the match), compared to the row's answer
    reward = "math"                   math-verify: parse the row's answer and the response, check
                                      mathematical equivalence (its own per-call timeout; worker processes)
    reward = "my_pkg.rewards:score"   your function (sync or async), by import path or
    reward = "./my_reward.py:score"   by file path

A reward function is called as ``fn(row, response)``: ``row`` is a dict with ``id``, ``prompt`` (the
text the model saw), ``answer`` and the extra columns the environment passes; ``response`` is the
model's text. It returns a float, or a dict with ``reward`` (float) and any other numeric entries
(metrics: their mean per step is logged as ``reward/<name>``; a bool ``correct`` decides held-out
accuracy instead of ``reward >= 1``).

Where it runs (``RewardRunner``): an ``async def`` function runs on the controller's event loop (it
must not block: it awaits); a plain function runs in a thread pool ("thread") or in worker
processes ("process": the default for ``math``, whose timeout uses SIGALRM and so needs a process's
main thread). Every call has a deadline (``timeout_s``); a process worker past it is killed and
replaced (flashrl.workers.WorkerPool, the pool the remote environment's workers use too). Failures
are not rewards: a function that raises, returns something else than a float or a dict with
``reward``, times out or kills its worker raises ``RewardFailed`` (reason "reward_error" /
"reward_timeout" / "reward_crash", with the traceback), which the dataset environment turns into
an infrastructure failure (EnvFailure): the rollout is retried and the failure counted, never
scored 0.

Process workers (``python -m flashrl.rewards``) speak msgspec JSON lines over their stdin/stdout
(nothing is pickled); a worker's own prints go to its stderr. They die with the controller
(flashrl.procs.child_init: parent-death signal and watchdog; EOF on stdin) and are closed by ``RewardRunner.aclose()``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from flashrl.plugins import PluginError, is_reference, load_object
from flashrl.procs import PARENT_ENV, child_init
from flashrl.workers import PipedProc, Worker, WorkerPool

__all__ = ["BUILTIN_REWARDS", "RewardFailed", "RewardOptions", "RewardResult", "RewardRunner", "make_reward_fn"]

log = logging.getLogger(__name__)

BUILTIN_REWARDS = ("exact", "regex", "math")
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RewardOptions(msgspec.Struct, kw_only=True, frozen=True):
    """What the built-in rewards are configured with (the dataset env's params pass them through)."""

    case_sensitive: bool = True  # exact, regex
    answer_pattern: str = ""  # regex: where the answer is in the response
    timeout_s: float = 10.0  # math: math-verify's own parse/verify timeouts derive from it


class RewardResult(msgspec.Struct, kw_only=True):
    reward: float
    metrics: dict[str, float] = {}
    correct: bool | None = None


class RewardFailed(Exception):
    """The reward could not be computed (not the policy's fault): ``reason`` is a counter name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- built-in rewards
def _norm(s: str, case_sensitive: bool) -> str:
    s = s.strip()
    return s if case_sensitive else s.casefold()


def exact(row: dict[str, Any], response: str, *, case_sensitive: bool = True) -> dict[str, float]:
    ok = _norm(response, case_sensitive) == _norm(str(row.get("answer", "")), case_sensitive)
    return {"reward": float(ok), "correct": ok}


def regex(row: dict[str, Any], response: str, *, pattern: re.Pattern[str], case_sensitive: bool = True) -> dict[str, float]:
    matches = list(pattern.finditer(response))
    m = matches[-1] if matches else None  # the last match: models restate the question first
    if m is None:
        return {"reward": 0.0, "correct": False, "matched": 0.0}
    if "answer" in pattern.groupindex:
        got = m.group("answer")
    elif pattern.groups:
        got = m.group(1)
    else:
        got = m.group(0)
    ok = _norm(got or "", case_sensitive) == _norm(str(row.get("answer", "")), case_sensitive)
    return {"reward": float(ok), "correct": ok, "matched": 1.0}


def math_verify_reward(row: dict[str, Any], response: str, *, timeout_s: float = 10.0) -> dict[str, float]:
    """math-verify's equivalence of the row's answer and the response. Its timeouts (SIGALRM) work
    only in a process's main thread: the "process" executor runs it there."""
    from math_verify import parse, verify

    each = max(1, int(timeout_s / 3))  # parse gold, parse response, verify: all within the deadline
    gold = parse(str(row.get("answer", "")), parsing_timeout=each)
    if not gold:  # the row's answer is not math-verify can read: the data is bad, not the policy
        raise ValueError(f"math-verify cannot parse the row's answer {row.get('answer')!r}")
    pred = parse(response, parsing_timeout=each)
    ok = bool(pred) and bool(verify(gold, pred, timeout_seconds=each))
    return {"reward": float(ok), "correct": ok, "parsed": float(bool(pred))}


def make_reward_fn(spec: str, opts: RewardOptions, key: str = "env.params.reward") -> Callable[..., Any]:
    """The callable ``fn(row, response)`` for a reward name or reference; PluginError naming ``key`` if not."""
    if spec == "exact":
        return functools.partial(exact, case_sensitive=opts.case_sensitive)
    if spec == "regex":
        if not opts.answer_pattern:
            raise PluginError(f"{key}: the regex reward needs env.params.answer_pattern, e.g. '####\\s*(.+)$'")
        try:
            pat = re.compile(opts.answer_pattern, re.MULTILINE)
        except re.error as e:
            raise PluginError(f"env.params.answer_pattern: invalid regular expression {opts.answer_pattern!r}: {e}") from None
        return functools.partial(regex, pattern=pat, case_sensitive=opts.case_sensitive)
    if spec == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise PluginError(f"{key}: the math reward needs the math-verify package: pip install 'flashrl[data]'") from None
        return functools.partial(math_verify_reward, timeout_s=opts.timeout_s)
    if not is_reference(spec):
        raise PluginError(f"{key}: unknown reward {spec!r}; expected one of {', '.join(BUILTIN_REWARDS)} "
                          "or your function as 'package.module:function' or './file.py:function'")
    fn = load_object(spec, key)
    if not callable(fn):
        raise PluginError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind({}, "")
    except TypeError as e:
        raise PluginError(f"{key}: {spec!r} cannot be called as fn(row, response): {e}") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): it is called and judged by what it does
    return fn


def _is_async(fn: Any) -> bool:
    call = type(fn).__call__ if not inspect.isroutine(fn) and not isinstance(fn, functools.partial) else None
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


def coerce_result(out: Any, spec: str) -> RewardResult:
    """A function's return value as a RewardResult; RewardFailed("reward_error") if it is not one."""
    if isinstance(out, (int, float)):  # bool included: True is 1.0
        r = float(out)
        if not math.isfinite(r):
            raise RewardFailed("reward_error", f"reward {spec!r} returned {out!r}; a reward must be a finite number")
        return RewardResult(reward=r)
    if isinstance(out, dict) and "reward" in out:
        metrics: dict[str, float] = {}
        correct = None
        for k, v in out.items():
            if k == "reward":
                continue
            if k == "correct" and isinstance(v, bool):
                correct = v
            elif isinstance(v, (int, float)) and math.isfinite(v):
                metrics[str(k)] = float(v)
            else:
                raise RewardFailed("reward_error", f"reward {spec!r} returned {k!r}: {v!r}; extra entries must be "
                                                   "finite numbers (logged per step as reward/<name>) or a bool 'correct'")
        r = out["reward"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RewardFailed("reward_error", f"reward {spec!r} returned reward={r!r}; expected a finite number")
        return RewardResult(reward=float(r), metrics=metrics, correct=correct)
    raise RewardFailed("reward_error", f"reward {spec!r} returned {type(out).__name__} {out!r:.200}; "
                                       "expected a float or a dict with 'reward'")


# --------------------------------------------------------------------------- process workers (wire)
class _Call(msgspec.Struct, kw_only=True):
    row: dict[str, Any]
    response: str


class _Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    result: RewardResult | None = None
    error: str = ""  # a traceback, or what was wrong with the return value
    reason: str = ""
    ready: bool = False


_REPLY = msgspec.json.Decoder(_Reply)
_ENC = msgspec.json.Encoder()


class _ProcessPool:
    """``workers`` processes computing one reward each at a time (flashrl.workers.WorkerPool: capacity 1,
    started on demand); one past its deadline is killed (counted) and replaced on the next call."""

    def __init__(self, spec: str, opts: RewardOptions, workers: int, start_timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.opts = opts
        self.pool: WorkerPool[asyncio.subprocess.Process] = WorkerPool(
            f"reward worker for {spec!r}", workers, start=self._spawn, ready=self._ready,
            failure=lambda reason, detail: RewardFailed(f"reward_{reason}", detail),
            capacity=1, eager=False, startup_timeout_s=start_timeout_s)

    @property
    def counters(self) -> dict[str, int]:
        c = self.pool.counters
        return {"workers_started": c["spawned"], "workers_killed": c["killed:timeout"]}

    def pids(self) -> list[int]:
        return [w.handle.pid for w in self.pool.workers()]

    async def _spawn(self, slot: int, generation: int) -> tuple[PipedProc, asyncio.subprocess.Process]:
        path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env[PARENT_ENV] = str(os.getpid())  # procs.child_init: the worker dies with this process
        w = await PipedProc.start("flashrl.rewards", ["--spec", self.spec, "--options", _ENC.encode(self.opts).decode()], env)
        return w, w.proc

    @staticmethod
    async def _ready(proc: asyncio.subprocess.Process) -> None:
        """The worker's first line says it loaded the reward (or why it could not)."""
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        try:
            reply = _REPLY.decode(line) if line else _Reply(error="it exited before answering")
        except msgspec.DecodeError as e:
            reply = _Reply(error=f"no ready line ({e})")
        if not reply.ready:
            raise RuntimeError(reply.error)

    async def call(self, row: dict[str, Any], response: str, timeout_s: float) -> RewardResult:
        w = await self.pool.acquire()
        proc = w.handle
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(_ENC.encode(_Call(row=row, response=response)) + b"\n")
            async with asyncio.timeout(timeout_s):
                await proc.stdin.drain()
                line = await proc.stdout.readline()
        except TimeoutError:
            self.pool.kill(w, "timeout")
            raise RewardFailed("reward_timeout", f"reward {self.spec!r} took longer than {timeout_s} s; its worker "
                                                 f"(pid {proc.pid}) was killed and will be replaced") from None
        except asyncio.CancelledError:
            self.pool.background(self._drain(w, timeout_s))  # the reply still comes: read it before reusing the worker
            raise
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        except BaseException:
            self.pool.kill(w)
            raise
        if not line:
            self.pool.kill(w)
            code = await proc.wait()
            raise RewardFailed("reward_crash", f"the reward worker running {self.spec!r} died (exit code {code}); "
                                               "it will be replaced")
        try:
            reply = _REPLY.decode(line)
        except msgspec.DecodeError as e:
            self.pool.kill(w)
            raise RewardFailed("reward_crash", f"the reward worker sent garbage ({e}); it was replaced") from None
        self.pool.release(w)
        if reply.error:
            raise RewardFailed(reply.reason or "reward_error", reply.error)
        assert reply.result is not None
        return reply.result

    async def _drain(self, w: Worker[asyncio.subprocess.Process], timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                line = await w.handle.stdout.readline()  # type: ignore[union-attr]
        except (Exception, asyncio.CancelledError):
            line = b""
        if line:
            self.pool.release(w)
        else:
            self.pool.kill(w)

    async def aclose(self) -> None:
        await self.pool.aclose()


# --------------------------------------------------------------------------- the runner
class RewardRunner:
    """Computes one reward spec off the event loop; see the module doc for where each kind runs."""

    def __init__(
        self,
        spec: str,
        opts: RewardOptions | None = None,
        *,
        executor: Literal["auto", "thread", "process"] = "auto",
        workers: int = 2,
        timeout_s: float = 10.0,
        key: str = "env.params.reward",
    ) -> None:
        self.spec = spec
        self.opts = opts or RewardOptions(timeout_s=timeout_s)
        self.fn = make_reward_fn(spec, self.opts, key)  # loaded here too: a bad reference fails at validate
        self.is_async = _is_async(self.fn)
        if executor == "auto":
            executor = "process" if spec == "math" else "thread"
        self.executor = "loop" if self.is_async else executor
        self.timeout_s = timeout_s
        self.workers = workers
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._procs = _ProcessPool(spec, self.opts, workers) if self.executor == "process" else None

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._procs.counters) if self._procs is not None else {}

    def pids(self) -> list[int]:
        return self._procs.pids() if self._procs is not None else []

    async def score(self, row: dict[str, Any], response: str) -> RewardResult:
        """The reward of ``response`` on ``row``; raises RewardFailed (never returns a made-up 0)."""
        if self._procs is not None:
            return await self._procs.call(row, response, self.timeout_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.is_async:
                    out = await self.fn(row, response)
                else:
                    if self._threads is None:
                        self._threads = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
                    out = await asyncio.get_running_loop().run_in_executor(self._threads, self.fn, row, response)
        except TimeoutError:
            raise RewardFailed("reward_timeout", f"reward {self.spec!r} took longer than {self.timeout_s} s"
                               + (" (its thread cannot be stopped; it finishes in the background)" if not self.is_async else "")) from None
        except RewardFailed:
            raise
        except Exception:
            raise RewardFailed("reward_error", traceback.format_exc().rstrip()) from None
        return coerce_result(out, self.spec)

    async def aclose(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._procs is not None:
            await self._procs.aclose()


# --------------------------------------------------------------------------- worker process
def _worker(spec: str, opts: RewardOptions) -> int:
    child_init("reward-worker")  # dies with the controller (parent-death signal + watchdog)
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol channel; user prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(reply: _Reply) -> None:
        out.write(_ENC.encode(reply) + b"\n")

    try:
        fn = make_reward_fn(spec, opts)
    except Exception as e:
        send(_Reply(error=f"{type(e).__name__}: {e}"))
        return 1
    is_async = _is_async(fn)
    send(_Reply(ready=True))
    decoder = msgspec.json.Decoder(_Call)
    for line in sys.stdin.buffer:
        try:
            call = decoder.decode(line)
        except msgspec.DecodeError as e:
            send(_Reply(error=f"bad request: {e}", reason="reward_crash"))
            continue
        try:
            res = fn(call.row, call.response)
            if is_async or inspect.isawaitable(res):
                res = asyncio.run(res) if inspect.iscoroutine(res) else asyncio.run(_await(res))
            send(_Reply(result=coerce_result(res, spec)))
        except RewardFailed as e:
            send(_Reply(error=e.detail, reason=e.reason))
        except Exception:
            send(_Reply(error=traceback.format_exc().rstrip(), reason="reward_error"))
    return 0


async def _await(aw: Any) -> Any:
    return await aw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="flashrl reward worker (started by flashrl.rewards.RewardRunner)")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--options", default="{}")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s reward-worker %(levelname)s %(message)s")
    return _worker(ns.spec, msgspec.json.decode(ns.options, type=RewardOptions))


if __name__ == "__main__":
    sys.exit(main())
