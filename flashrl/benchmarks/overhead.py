"""Controller overhead: the real scheduling code against engines that answer at once, and the ZeroMQ path.

    controller:  Controller.run() with SimEngine(latency all zero) x E, SimTrainer(all zero), the sim env
                 on virtual time -> every CPU second is the controller's (plus the thin sim engines):
                 samples per CPU second, CPU microseconds per sample
    zeromq:      transport.RpcClient --Generate--> RpcServer (echo handler answers Generated at once),
                 loopback TCP, a real event loop, ``concurrency`` requests in flight
                 -> requests per second, CPU microseconds per request (both ends in this process)
"""

from __future__ import annotations

import asyncio
import csv
import time
from pathlib import Path
from typing import Any

import msgspec

from flashrl.sim.engine import LatencyModel, LengthModel
from flashrl.sim.trainer import TrainerModel


class OverheadResult(msgspec.Struct, kw_only=True):
    scenario: str
    label: str
    value: float
    unit: str
    target: float | None
    passed: bool | None
    detail: dict[str, Any] = {}


def controller_rate(scn: Any, batch_prompts: int, group_size: int, engines: int, steps: int) -> dict[str, float]:
    """Samples per CPU second of the real controller against instant simulated engines."""
    from flashrl.bench import PointSpec, SimModel, run_variant, variant_config

    zero = SimModel(
        latency=LatencyModel(decode_base_s=0, decode_per_seq_s=0, prefill_per_token_s=0, weight_load_s=0, max_num_seqs=1024),
        lengths=LengthModel(dist="constant", median=16),
        trainer=TrainerModel(step_fixed_s=0, per_token_s=0, prepare_weights_s=0, send_weights_s=0),
    )
    scn = msgspec.structs.replace(scn, sim=zero, steps=steps, warmup=0)
    pt = PointSpec(label="overhead", set={
        "rollout.batch_prompts": batch_prompts, "rollout.group_size": group_size, "engine.count": engines,
        "engine.max_num_seqs": 1024, "rollout.max_new_tokens": 32,
    })
    cfg, sim = variant_config(scn, pt, "flash")
    run = run_variant(cfg, sim, 0, Path("."))
    samples = run.samples_per_step * steps
    return {"samples": samples, "cpu_s": run.cpu_s, "samples_per_cpu_s": samples / run.cpu_s, "cpu_us_per_sample": 1e6 * run.cpu_s / samples}


def zmq_rate(n: int, concurrency: int = 64) -> dict[str, float]:
    """Requests per second through RpcClient -> RpcServer on loopback (echo of Generate as Generated)."""
    from flashrl.protocol import ENGINE_REPLIES, ENGINE_REQUESTS, Generate, Generated, Msg
    from flashrl.transport import RpcClient, RpcServer, free_port

    async def handler(msg: Msg) -> Msg:
        assert isinstance(msg, Generate)
        return Generated(request_id=msg.request_id, token_ids=[5] * 16, logprobs=[-1.0] * 16, versions=[0] * 16)

    async def main() -> tuple[float, float]:
        addr = f"tcp://127.0.0.1:{free_port()}"
        server = RpcServer(addr, ENGINE_REQUESTS, handler, name="echo")
        serve = asyncio.get_running_loop().create_task(server.serve())
        client = RpcClient(addr, ENGINE_REPLIES, name="echo")
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                r = await client.request(Generate(request_id=str(i), prompt_ids=[5] * 64, max_tokens=16), timeout=30)
                assert isinstance(r, Generated) and r.request_id == str(i)

        await asyncio.gather(*(one(i) for i in range(min(n, 200))))  # warm-up: connect, first frames
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        await client.close()
        serve.cancel()
        try:
            await serve
        except asyncio.CancelledError:
            pass
        return wall, cpu

    wall, cpu = asyncio.run(main())
    return {"requests": float(n), "wall_s": wall, "requests_per_s": n / wall, "cpu_us_per_request": 1e6 * cpu / n}


def run_overhead(scn: Any, out: Path, quiet: bool = False) -> list[OverheadResult]:
    results: list[OverheadResult] = []
    for pt in scn.points:
        p = {k.split(".")[-1]: v for k, v in pt.set.items()}
        if pt.label.startswith("zmq"):
            r = zmq_rate(int(p.get("requests", scn.zmq_requests or 20000)), int(p.get("concurrency", 64)))
            value, unit = r["requests_per_s"], "requests/s"
        else:
            r = controller_rate(scn, int(p.get("batch_prompts", 128)), int(p.get("group_size", 8)), int(p.get("count", 16)), int(p.get("steps", 5)))
            value, unit = r["samples_per_cpu_s"], "samples/CPU s"
        res = OverheadResult(
            scenario=scn.name, label=pt.label, value=value, unit=unit, target=pt.target,
            passed=None if pt.target is None else value >= pt.target, detail=r,
        )
        results.append(res)
        if not quiet:
            print(f"  {scn.name} {pt.label}: {value:,.0f} {unit}  {r}", flush=True)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode({"scenario": msgspec.to_builtins(scn), "points": results}), indent=2))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "label", "value", "unit", "target", "passed", "detail"])
        for x in results:
            w.writerow([x.scenario, x.label, x.value, x.unit, x.target, x.passed, msgspec.json.encode(x.detail).decode()])
    _plot(scn, results, out / f"{scn.name}.png")
    if not quiet:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{scn.name}: {scn.title}")
        for col in ("point", "value", "unit", "bar"):
            t.add_column(col, justify="right")
        for x in results:
            bar = "" if x.target is None else (f"[green]>={x.target:,.0f} ok[/]" if x.passed else f"[red]>={x.target:,.0f} MISS[/]")
            t.add_row(x.label, f"{x.value:,.0f}", x.unit, bar)
        Console().print(t)
    return results


def _plot(scn: Any, results: list[OverheadResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.label for r in results], [r.value for r in results])
    for i, r in enumerate(results):
        if r.target is not None:
            ax.plot([i - 0.4, i + 0.4], [r.target, r.target], "r-", lw=2)
    ax.set_ylabel("per second (samples/CPU s or requests/s)")
    ax.set_title(scn.title or scn.name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
