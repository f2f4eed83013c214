"""Controller overhead: the real scheduling code against parts that answer at once, and the ZeroMQ path.

    controller:  Controller.run() on a plain asyncio loop with InstantEngine x E, InstantTrainer and
                 InstantSuite (flashrl/sim/instant.py), SimTokenizer(cache=True): nothing waits, so the run's
                 CPU is the controller's plus what those parts cost (``fixture_cost``, measured
                 apart and subtracted) -> generated and trained samples per CPU second, controller
                 CPU microseconds per generated sample
    end to end:  the same Controller.run(), but every engine is an EngineProcessClient talking ZeroMQ
                 (loopback TCP) to instant-engine server processes (``instant_engine_server``: an
                 InstantEngine behind an RpcServer), as real engines are reached -> generated samples
                 per CPU second of the controller process (its ZeroMQ I/O thread included; nothing
                 subtracted), the servers' CPU per sample beside it. This is the controller overhead
                 figure a real run pays; the in-process one above is the scheduling code alone.
    zeromq:      EngineProcessClient -> RpcClient --Generate--> RpcServer (echo: answers Generated at
                 once) on loopback TCP; the server in its own process (as an engine is) or in this
                 loop ("inline"); ``concurrency`` tasks each issue requests back to back on the ONE
                 client (1 = sequential request/reply) -> requests per second, client CPU per request

Counting: "generated" samples are trajectories that ended (the suite counts episodes); "trained" ones
are those the trainer received. A run admits no more groups than its steps train (the buffer's
invariant 5), so the two differ only by redundant rollouts and drops; the overhead bar is on generated
samples (the work the controller did), both are reported.

GC (``gc = "tuned"``, this process only, restored afterwards): ``gc.freeze()`` once the controller
and its inputs are built (the long-lived objects leave the collector's view) and thresholds raised
to (50_000, 20, 100). Every trajectory holds five per-token lists, so the default (700, 10, 10)
runs a young collection every few samples and a full one, which walks every live list, often.
``gc = "default"`` measures the interpreter's defaults. Nothing here changes the controller itself.

Noise: CPU time on a shared machine only ever grows with contention (caches, cores), so a controller
point reports the best of ``repeats`` runs (as timeit does), with the median and the worst beside it.

``flashrl bench controller-profile`` prints the hottest functions of one controller run (cProfile,
``profile_controller``).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

GcMode = Literal["default", "tuned"]
GC_TUNED_THRESHOLDS = (50_000, 20, 100)


class OverheadResult(msgspec.Struct, kw_only=True):
    scenario: str
    label: str
    value: float
    unit: str
    target: float | None
    passed: bool | None
    detail: dict[str, Any] = {}


# --------------------------------------------------------------------------- GC settings
@contextlib.contextmanager
def gc_settings(mode: GcMode) -> Iterator[None]:
    """``tuned``: raised thresholds (``gc.freeze()`` is the caller's, once its long-lived objects exist)."""
    old = gc.get_threshold()
    gc.collect()
    if mode == "tuned":
        gc.set_threshold(*GC_TUNED_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
        gc.collect()


# --------------------------------------------------------------------------- controller
def overhead_config(batch_prompts: int, group_size: int, engines: int, steps: int, *, tokens: int = 16,
                    turns: int = 1, async_ratio: int = 2, max_num_seqs: int = 1024) -> Any:
    """The flashrl Config of one overhead run: evals off, no dashboard, queue scheduling (defaults)."""
    from flashrl.config import from_dict

    return from_dict({
        "run": {"steps": steps, "dashboard": "off", "eval_every": 0},
        "env": {"name": "sim", "eval_size": 1},  # the suite is passed in directly (InstantSuite)
        "model": {"max_model_len": 64 + turns * (tokens + 16) + 8},
        "rollout": {"batch_prompts": batch_prompts, "group_size": group_size, "max_new_tokens": tokens, "max_turns": turns},
        "scheduler": {"async_ratio": async_ratio},
        "engine": {"count": engines, "max_num_seqs": max_num_seqs},
    }, source="controller_overhead")


def controller_rate(batch_prompts: int, group_size: int, engines: int, steps: int, *, tokens: int = 16, turns: int = 1,
                    gc_mode: GcMode = "tuned", profile: Any = None, transport: Literal["inline", "zmq"] = "inline",
                    servers: int = 2) -> dict[str, float]:
    """One run of the real Controller against instant parts; CPU per sample (see the module docstring).

    ``transport = "zmq"``: the engines are EngineProcessClients of ``servers`` instant-engine server
    processes (engines shared round-robin), and nothing is subtracted: end-to-end controller CPU.
    ``profile``: a cProfile.Profile to enable around the run (its numbers are then inflated by it).
    """
    if transport == "zmq":
        return _controller_rate_zmq(batch_prompts, group_size, engines, steps, tokens=tokens, turns=turns,
                                    gc_mode=gc_mode, servers=servers)
    from flashrl.controller.controller import Controller
    from flashrl.sim.envs import SimTokenizer
    from flashrl.sim.instant import (
        InstantEngine,
        InstantSuite,
        InstantSuiteParams,
        InstantTrainer,
    )

    cfg = overhead_config(batch_prompts, group_size, engines, steps, tokens=tokens, turns=turns)
    suite = InstantSuite(InstantSuiteParams(turns=turns))
    engs = [InstantEngine(f"instant{i}", tokens) for i in range(engines)]
    trainer = InstantTrainer()
    out: dict[str, float] = {}

    async def main() -> None:
        ctrl = Controller(cfg, SimTokenizer(cache=True), suite, engs, trainer)
        if gc_mode == "tuned":
            gc.freeze()  # config, tasks, controller: long-lived, never garbage
        gc0 = sum(s["collections"] for s in gc.get_stats())
        c0, w0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            summary = await ctrl.run()
        finally:
            if profile is not None:
                profile.disable()
        out["cpu_s"] = time.process_time() - c0
        out["wall_s"] = time.perf_counter() - w0
        out["gc_collections"] = float(sum(s["collections"] for s in gc.get_stats()) - gc0)
        out["steps"] = float(summary.steps)

    with gc_settings(gc_mode):
        asyncio.run(main())
    generated = suite.episodes
    trained = trainer.samples
    if trained != steps * batch_prompts * group_size:
        raise RuntimeError(f"overhead run trained {trained} samples, expected {steps * batch_prompts * group_size}")
    fix = fixture_cost(tokens, turns)
    cpu = out["cpu_s"]
    return {
        "generated": float(generated),
        "trained": float(trained),
        "requests": float(sum(e.requests for e in engs)),
        "cpu_s": cpu,
        "wall_s": out["wall_s"],
        "generated_per_cpu_s": generated / cpu,
        "trained_per_cpu_s": trained / cpu,
        "cpu_us_per_generated": 1e6 * cpu / generated,
        "fixture_us_per_sample": fix,
        "controller_us_per_generated": 1e6 * cpu / generated - fix,
        "gc_collections": out["gc_collections"],
    }


def instant_engine_server(address: str, tokens: int = 16) -> None:
    """An InstantEngine behind an RpcServer: the engine protocol answered at once, until Shutdown."""
    from flashrl.sim.instant import InstantEngine
    from flashrl.wire.protocol import (
        ENGINE_REQUESTS,
        Abort,
        Generate,
        GetLoad,
        Ok,
        Ping,
        Pong,
        Shutdown,
        UpdateWeights,
    )
    from flashrl.wire.transport import RpcServer

    engine = InstantEngine(f"instant@{address}", tokens, yield_once=False)

    async def main() -> None:
        stop = asyncio.Event()

        async def handler(msg: Any) -> Any:
            if isinstance(msg, Generate):
                return await engine.generate(msg)
            if isinstance(msg, Abort):
                await engine.abort(list(msg.request_ids))
                return Ok()
            if isinstance(msg, UpdateWeights):
                return await engine.update_weights(msg.manifest)
            if isinstance(msg, GetLoad):
                return await engine.load()
            if isinstance(msg, Ping):
                return Pong(version=engine.version)
            if isinstance(msg, Shutdown):
                stop.set()
            return Ok()

        await _serve_until(RpcServer(address, ENGINE_REQUESTS, handler, name="instant-engine"), stop)

    gc.freeze()
    gc.set_threshold(*GC_TUNED_THRESHOLDS)
    asyncio.run(main())


def _controller_rate_zmq(batch_prompts: int, group_size: int, engines: int, steps: int, *, tokens: int, turns: int,
                         gc_mode: GcMode, servers: int) -> dict[str, float]:
    from flashrl.controller.controller import Controller
    from flashrl.engine.client import EngineProcessClient
    from flashrl.sim.envs import SimTokenizer
    from flashrl.sim.instant import InstantSuite, InstantSuiteParams, InstantTrainer
    from flashrl.wire.transport import free_port

    cfg = overhead_config(batch_prompts, group_size, engines, steps, tokens=tokens, turns=turns)
    suite = InstantSuite(InstantSuiteParams(turns=turns))
    trainer = InstantTrainer()
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(max(1, min(servers, engines)))]
    procs = [subprocess.Popen(
        [sys.executable, "-c", f"from flashrl.bench.overhead import instant_engine_server as s; s({a!r}, {tokens})"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for a in addrs]  # fmt: skip
    out: dict[str, float] = {}

    async def main() -> None:
        clients = [EngineProcessClient(f"instant{i}", addrs[i % len(addrs)], heartbeat_s=0) for i in range(engines)]
        try:
            await asyncio.wait_for(asyncio.gather(*(c.ping() for c in clients)), 60)  # servers up, clients connected
            ctrl = Controller(cfg, SimTokenizer(cache=True), suite, clients, trainer)
            if gc_mode == "tuned":
                gc.freeze()
            s0 = sum(_proc_cpu_s(p.pid) for p in procs)
            c0, w0 = time.process_time(), time.perf_counter()
            summary = await ctrl.run()
            out["cpu_s"] = time.process_time() - c0
            out["wall_s"] = time.perf_counter() - w0
            out["server_cpu_s"] = sum(_proc_cpu_s(p.pid) for p in procs) - s0
            out["steps"] = float(summary.steps)
            for c in clients[: len(addrs)]:  # one per server
                with contextlib.suppress(Exception):
                    await c.shutdown(timeout=5)
        finally:
            for c in clients:
                await c.close()

    try:
        with gc_settings(gc_mode):
            asyncio.run(main())
    finally:
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    generated, trained = suite.episodes, trainer.samples
    if trained != steps * batch_prompts * group_size:
        raise RuntimeError(f"overhead run trained {trained} samples, expected {steps * batch_prompts * group_size}")
    cpu = out["cpu_s"]
    return {
        "generated": float(generated),
        "trained": float(trained),
        "cpu_s": cpu,
        "wall_s": out["wall_s"],
        "generated_per_cpu_s": generated / cpu,
        "trained_per_cpu_s": trained / cpu,
        "cpu_us_per_generated": 1e6 * cpu / generated,
        "controller_us_per_generated": 1e6 * cpu / generated,  # end to end: nothing subtracted
        "server_cpu_us_per_generated": 1e6 * out["server_cpu_s"] / generated,
        "servers": float(len(addrs)),
    }


def fixture_cost(tokens: int = 16, turns: int = 1, n: int = 4000) -> float:
    """CPU microseconds per sample of the instant parts alone (engine, env, tokenizer, trainer).

    What a rollout asks of them, without the controller: env reset, encode, ``turns`` x (generate,
    decode, step, encode the observation), env close; the trainer's share of a batch. Run in
    ``concurrency`` tasks so the engine's one loop turn per request costs what it costs in the run.
    """
    from flashrl.sim.envs import SimTokenizer
    from flashrl.sim.instant import (
        InstantEngine,
        InstantSuite,
        InstantSuiteParams,
        InstantTrainer,
    )
    from flashrl.wire.protocol import Generate, TrainBatch
    from flashrl.wire.trajectory import Trajectory

    suite = InstantSuite(InstantSuiteParams(turns=turns))
    eng = InstantEngine("fixture", tokens)
    tok = SimTokenizer(cache=True)
    trainer = InstantTrainer()
    tasks = suite.train_tasks()
    concurrency = 64

    async def one(k: int) -> None:
        env = suite.make_env()
        obs = await env.reset(tasks[k % len(tasks)])
        ids = tok.encode(obs)
        for turn in range(turns):
            out = await eng.generate(Generate(request_id=f"{k}.0.{turn}", prompt_ids=ids, max_tokens=tokens))
            res = await env.step(tok.decode(out.token_ids))
            if not res.done:
                ids = ids + out.token_ids + tok.encode(res.observation)
        await env.close()

    async def worker(w: int) -> None:
        for k in range(w, n, concurrency):
            await one(k)

    sample = Trajectory(prompt_ids=[5] * 64, response_ids=[5] * tokens * turns, loss_mask=[1] * tokens * turns,
                         behav_logp=[-1.0] * tokens * turns, versions=[0] * tokens * turns, reward=0.0, group=0)

    async def main() -> float:
        c0 = time.process_time()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        batch = TrainBatch(step=0, samples=[sample] * 1024)
        for _ in range(max(1, n // 1024)):
            await trainer.train_step(batch)
        return time.process_time() - c0

    with gc_settings("tuned"):
        cpu = asyncio.run(main())
    return 1e6 * cpu / n


def profile_controller(batch_prompts: int = 128, group_size: int = 8, engines: int = 16, steps: int = 20,
                       top: int = 30) -> str:
    """cProfile of one controller run (tuned GC): the ``top`` functions by own time, then time per file."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    r = controller_rate(batch_prompts, group_size, engines, steps, profile=prof)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    buf.write(f"controller run {batch_prompts}x{group_size}, {engines} engines, {steps} steps: "
              f"{r['generated']:.0f} generated, {r['cpu_s']:.2f} CPU s under the profiler (total own time {total:.2f} s)\n")
    st.sort_stats("tottime").print_stats(top)
    per_file: dict[str, float] = {}
    for (file, _line, _fn), v in st.stats.items():  # type: ignore[attr-defined]
        key = file if file.startswith("~") else "/".join(Path(file).parts[-2:])
        per_file[key] = per_file.get(key, 0.0) + v[2]
    buf.write("own time per file (share of the profiled total):\n")
    for key, t in sorted(per_file.items(), key=lambda x: -x[1])[:20]:
        buf.write(f"  {100 * t / total:5.1f}%  {t:6.3f} s  {key}\n")
    text = buf.getvalue()
    for prefix in (str(Path.cwd()) + "/", str(Path(os.__file__).parent.parent) + "/"):  # machine-independent paths
        text = text.replace(prefix, "")
    return text


# --------------------------------------------------------------------------- ZeroMQ path
def _echo_reply(msg: Any) -> Any:
    from flashrl.wire.protocol import Generate, Generated, Ok, Ping, Pong

    if isinstance(msg, Generate):
        n = msg.max_tokens
        return Generated(request_id=msg.request_id, token_ids=[5] * n, logprobs=[-1.0] * n, versions=[0] * n, engine="echo")
    if isinstance(msg, Ping):
        return Pong()
    return Ok()


async def _serve_until(server: Any, stop: asyncio.Event) -> None:
    """Serve ``server`` until ``stop`` is set (by a Shutdown), letting that Shutdown's reply go out."""
    task = asyncio.get_running_loop().create_task(server.serve())
    await stop.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def echo_server(address: str) -> None:
    """The echo engine process: answers Generate with Generated at once until a Shutdown arrives."""
    from flashrl.wire.protocol import ENGINE_REQUESTS, Shutdown
    from flashrl.wire.transport import RpcServer

    async def main() -> None:
        stop = asyncio.Event()

        async def handler(msg: Any) -> Any:
            if isinstance(msg, Shutdown):
                stop.set()
            return _echo_reply(msg)

        await _serve_until(RpcServer(address, ENGINE_REQUESTS, handler, name="echo"), stop)

    asyncio.run(main())


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; 0.0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def zmq_rate(n: int, concurrency: int = 64, server: Literal["process", "inline"] = "process",
             tokens: int = 16, prompt_tokens: int = 64) -> dict[str, float]:
    """Requests per second through EngineProcessClient -> RpcClient -> RpcServer (echo) on loopback.

    ``concurrency`` tasks share the one client, each sending its next request when the previous
    reply arrives (1 = sequential request/reply). ``server = "process"``: the echo server runs in
    a child process, as an engine does; client CPU is this process's, server CPU the child's.
    """
    from flashrl.engine.client import EngineProcessClient
    from flashrl.wire.protocol import ENGINE_REQUESTS, Generate, Generated
    from flashrl.wire.transport import RpcServer, free_port

    if n < concurrency or concurrency < 1:
        raise ValueError(f"zmq_rate: need 1 <= concurrency ({concurrency}) <= n ({n})")
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc: subprocess.Popen[bytes] | None = None
    if server == "process":
        proc = subprocess.Popen(
            [sys.executable, "-c", f"from flashrl.bench.overhead import echo_server; echo_server({addr!r})"],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    async def main() -> dict[str, float]:
        serve = None
        if server == "inline":
            async def handler(msg: Any) -> Any:
                return _echo_reply(msg)

            srv = RpcServer(addr, ENGINE_REQUESTS, handler, name="echo")
            serve = asyncio.get_running_loop().create_task(srv.serve())
        client = EngineProcessClient("echo", addr, heartbeat_s=0)
        prompt = [5] * prompt_tokens

        async def worker(w: int, count: int) -> None:
            for k in range(w, count, concurrency):
                r = await client.generate(Generate(request_id=str(k), prompt_ids=prompt, max_tokens=tokens))
                if not (isinstance(r, Generated) and r.request_id == str(k) and len(r.token_ids) == tokens):
                    raise RuntimeError(f"echo answered request {k} with {r!r}")

        try:
            await asyncio.wait_for(client.ping(), 30)  # the child is up and connected
            await asyncio.gather(*(worker(w, min(n, 20 * concurrency)) for w in range(concurrency)))  # warm-up
            s0 = _proc_cpu_s(proc.pid) if proc is not None else 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(worker(w, n) for w in range(concurrency)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            server_cpu = _proc_cpu_s(proc.pid) - s0 if proc is not None else 0.0
            if proc is not None:
                with contextlib.suppress(Exception):
                    await client.shutdown(timeout=5)
        finally:
            await client.close()
            if serve is not None:
                serve.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serve
        return {"wall_s": wall, "cpu_s": cpu, "server_cpu_s": server_cpu}

    try:
        with gc_settings("default"):
            m = asyncio.run(main())
    finally:
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = m["wall_s"]
    r = {
        "requests": float(n),
        "concurrency": float(concurrency),
        "wall_s": wall,
        "requests_per_s": n / wall,
        # inline: both ends' CPU; process: the client's (controller side) alone
        "client_cpu_us_per_request": 1e6 * m["cpu_s"] / n,
    }
    if server == "process":
        r["server_cpu_us_per_request"] = 1e6 * m["server_cpu_s"] / n
    return r


# --------------------------------------------------------------------------- the scenario
def run_overhead(scn: Any, out: Path, quiet: bool = False) -> list[OverheadResult]:
    """Every point of an overhead scenario (scenarios/controller_overhead.toml); writes json, csv, png."""
    results: list[OverheadResult] = []
    for pt in scn.points:
        p = {k.split(".")[-1]: v for k, v in pt.set.items()}
        if pt.label.startswith("zmq"):
            r = zmq_rate(int(p.get("requests", scn.zmq_requests or 20000)), int(p.get("concurrency", 64)),
                         server=p.get("server", "process"))
            value, unit = r["requests_per_s"], "requests/s"
        else:
            runs = [
                controller_rate(int(p.get("batch_prompts", 128)), int(p.get("group_size", 8)), int(p.get("count", 16)),
                                int(p.get("steps", scn.steps)), tokens=int(p.get("max_new_tokens", 16)),
                                turns=int(p.get("max_turns", 1)), gc_mode=p.get("gc", "tuned"),
                                transport=p.get("transport", "inline"), servers=int(p.get("servers", 2)))
                for _ in range(max(1, int(p.get("repeats", 1))))
            ]
            # Best of N, as timeit reports: on a shared machine other processes only ever add CPU time
            # (cache and core contention), never remove it. The median and the worst are kept beside it.
            runs.sort(key=lambda x: x["generated_per_cpu_s"])
            r = dict(runs[-1])
            r["repeats"] = float(len(runs))
            r["generated_per_cpu_s_median"] = runs[len(runs) // 2]["generated_per_cpu_s"]
            r["generated_per_cpu_s_worst"] = runs[0]["generated_per_cpu_s"]
            value, unit = r["generated_per_cpu_s"], "generated samples/CPU s"
        res = OverheadResult(
            scenario=scn.name, label=pt.label, value=value, unit=unit, target=pt.target,
            passed=None if pt.target is None else value >= pt.target, detail=r,
        )
        results.append(res)
        if not quiet:
            print(f"  {scn.name} {pt.label}: {value:,.0f} {unit}  {_brief(r)}", flush=True)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode({"scenario": msgspec.to_builtins(scn), "points": results}), indent=2))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "label", "value", "unit", "target", "passed", "detail"])
        for x in results:
            w.writerow([x.scenario, x.label, x.value, x.unit, x.target, x.passed, msgspec.json.encode(x.detail).decode()])
    _plot(scn, results, out / f"{scn.name}.png")
    first = next((pt for pt in scn.points if not pt.label.startswith("zmq") and "x.transport" not in pt.set), None)
    if first is not None:  # where the controller's time goes, for whoever optimizes it next
        p = {k.split(".")[-1]: v for k, v in first.set.items()}
        (out / "profile.txt").write_text(profile_controller(
            int(p.get("batch_prompts", 128)), int(p.get("group_size", 8)), int(p.get("count", 16)), int(p.get("steps", scn.steps))))
    if not quiet:
        _print_table(scn, results)
    return results


def _brief(r: dict[str, float]) -> str:
    return " ".join(f"{k}={v:,.1f}" if isinstance(v, float) and abs(v) < 1e6 else f"{k}={v}" for k, v in r.items())


def _print_table(scn: Any, results: list[OverheadResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{scn.name}: {scn.title}")
    for col in ("point", "value", "unit", "bar", "trained/CPU s", "controller us/sample", "client us/request"):
        t.add_column(col, justify="right")
    for x in results:
        bar = "" if x.target is None else (f"[green]>={x.target:,.0f} ok[/]" if x.passed else f"[red]>={x.target:,.0f} MISS[/]")
        d = x.detail
        t.add_row(
            x.label, f"{x.value:,.0f}", x.unit, bar,
            f"{d['trained_per_cpu_s']:,.0f}" if "trained_per_cpu_s" in d else "",
            f"{d['controller_us_per_generated']:.1f}" if "controller_us_per_generated" in d else "",
            f"{d['client_cpu_us_per_request']:.1f}" if "client_cpu_us_per_request" in d else "",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def _plot(scn: Any, results: list[OverheadResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = list(range(len(results)))
    ax.bar(xs, [r.value for r in results], color=["C0" if r.label.startswith("controller") else "C1" for r in results])
    for i, r in enumerate(results):
        if r.target is not None:
            ax.plot([i - 0.4, i + 0.4], [r.target, r.target], "r-", lw=2)
    ax.set_xticks(xs, [r.label for r in results], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("generated samples / CPU s  |  requests / s")
    ax.set_title(scn.title or scn.name, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
