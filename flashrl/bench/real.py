"""Real mode of ``flashrl bench``: every point's sync baseline and flash variant on real processes.

    real_*.toml scenarios (mode = "real") --scenario.load_scenario--> points; each: baseline cfg, flash cfg
    ClusterPool.get(cfg): the cluster it holds when the process config matches (process_key), else
        stop it and start one: launch.processes.local_cluster -> engine.count vLLM engines + the trainer group
        (logs under <run.output_dir>/bench_real/cluster<k>/logs); a fresh cluster first runs one
        throw-away step of the point's baseline (vLLM's first-batch warm-up, the trainer's first step)
    for variant in (baseline, flash), in this order, on the same cluster when the pool allows:
        publish_version_zero(): trainer PrepareWeights(0) -> SendWeights(0) || engine UpdateWeights(v0)
        Controller(cfg, tokenizer, TrainOnlySuite(env suite), [BusyProbe(engine)], trainer).run()
            on_step (loop clock): the step record + every probe's busy seconds so far
        -> steady window = steps warmup+1..steps: s/step, trained samples/s and tokens/s, busy fraction
    -> ratios flash / baseline; rich table, results.json, results.csv, <scenario>.png under --out

Reusing a cluster: the controller always starts at policy version 0 (``Controller.version = 0``,
steps 0..; it takes no starting version), and the engines stamp every token with the version they
last loaded. So before each variant the trainer's current weights are published to every engine as
version 0, and the new controller, the engines and the trainer agree again. The weights are not
rolled back (the trainer cannot reload a checkpoint over RPC): the flash variant starts from the
policy the baseline trained. Response length and turns per sample are reported per variant, so any
drift of the workload is visible next to the ratio. Points or variants whose process config differs
(engine count, max_num_seqs, model, trainer, algorithm) get a fresh cluster; the result says which.
The built-in model is warm-started per environment (flashrl.models), so scenarios on different
environments run on different models and clusters.

Timing is wall clock on a shared machine: noisy. Both variants run in the same invocation, back to
back, and only their ratio is the result. Evaluation is off (``TrainOnlySuite``), as in the
simulator's scenarios: an eval would cost engine time in both variants and measure nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from flashrl.bench.scenario import (
    PointOutcome,
    bar_cell,
    gain_versus,
    new_figure,
    plot_targets,
    point_outcome,
    print_table,
    save_figure,
    variant_config,
)
from flashrl.config import Config, to_toml
from flashrl.core.meters import BusyMeter
from flashrl.core.records import BatchStats, StepRecord
from flashrl.deadlines import weight_sync_timeout_s
from flashrl.wire.protocol import Generate, Generated, LoadReport, WeightManifest, WeightsUpdated

log = logging.getLogger("flashrl.bench.real")

__all__ = [
    "BusyProbe", "ClusterPool", "RealPointResult", "RealRun", "TrainOnlySuite", "process_key",
    "run_real_point", "run_real_scenarios", "run_real_variant",
]


# --------------------------------------------------------------------------- measuring wrappers
class BusyProbe:
    """An ``EngineClient`` that forwards every call to a real one and times its busy periods.

    Busy = at least one generate in flight (a paused engine holding requests counts as busy), the
    same definition as the simulator's bench and the engine's own LoadMeter. Time is the event
    loop's clock, the controller's.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name: str = inner.name
        self.requests = 0
        self._busy = BusyMeter()

    @property
    def inflight(self) -> int:
        return int(self.inner.inflight)

    @property
    def dead(self) -> object:  # the controller skips engines whose client reports dead (PeerDead | None)
        return self.inner.dead

    def busy_s(self, now: float) -> float:
        """Seconds with >= 1 generate in flight, up to ``now``."""
        return self._busy.busy_s(now)

    async def generate(self, req: Generate) -> Generated:
        self._busy.enter(anyio.current_time())
        self.requests += 1
        try:
            return await self.inner.generate(req)
        finally:
            self._busy.exit(anyio.current_time())

    async def abort(self, request_ids: list[str]) -> None:
        await self.inner.abort(request_ids)

    async def update_weights(self, manifest: WeightManifest) -> WeightsUpdated:
        return await self.inner.update_weights(manifest)

    async def load(self) -> LoadReport:
        return await self.inner.load()

    async def close(self) -> None:
        """No-op: the engine process belongs to the ClusterPool, which outlives this run."""


class TrainOnlySuite:
    """An environment suite with its held-out split hidden: the controller then runs no evals."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.Params = inner.Params

    def train_tasks(self) -> Sequence[Any]:
        return self.inner.train_tasks()

    def eval_tasks(self) -> Sequence[Any]:
        return []

    def make_env(self) -> Any:
        return self.inner.make_env()

    @property
    def counters(self) -> Any:
        return getattr(self.inner, "counters", None)

    async def aclose(self) -> None:
        aclose = getattr(self.inner, "aclose", None)
        if aclose is not None:
            await aclose()


# --------------------------------------------------------------------------- the cluster pool
def process_key(cfg: Config, model_path: Path | str) -> bytes:
    """What the engine and trainer processes are started with; equal keys can share one cluster."""
    return msgspec.json.encode({
        "model_path": str(model_path), "model": cfg.model, "engine": cfg.engine, "trainer": cfg.trainer,
        "algorithm": cfg.algorithm, "weight_sync": cfg.weight_sync, "seed": cfg.run.seed,
    })


@dataclass
class Cluster:
    """One running set of processes: the engine processes (``.client`` each) and the trainer group."""

    key: bytes
    index: int
    engines: list[Any]
    trainer: Any
    tokenizer: Any
    run_dir: Path
    start_s: float  # seconds from spawn to every process ready and joined


class ClusterPool:
    """Holds at most one running cluster (memory: 2 cores, 24 GiB shared); ``get`` reuses or replaces it."""

    def __init__(self, root: Path | None = None, say: Callable[[str], None] = lambda s: None) -> None:
        self.root = root
        self.say = say
        self.current: Cluster | None = None
        self.started = 0
        self.setup_s = 0.0  # seconds spent preparing models, starting clusters and warming them up
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> ClusterPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        stack, self._stack, self.current = self._stack, None, None
        if stack is not None:
            await stack.aclose()  # local_cluster's finally: Shutdown -> SIGTERM -> SIGKILL, shielded

    async def get(self, cfg: Config, warm_cfg: Config | None = None) -> Cluster:
        """A cluster for ``cfg``: the current one when its processes match, else a fresh one.

        A fresh cluster first runs ``warm_cfg`` (one step) so no measured variant pays the one-time
        costs (vLLM's first batch, the trainer's first step).
        """
        from flashrl.launch.processes import local_cluster
        from flashrl.models import ensure_model
        from flashrl.models.tokenizer import load_tokenizer

        t_setup = time.perf_counter()
        # Cached: a hash and a stat. The first build of a model (per environment) takes minutes, once.
        model_path = Path(await asyncio.to_thread(ensure_model, cfg))  # env faults do not change the model)
        key = process_key(cfg, model_path)
        if self.current is not None and self.current.key == key:
            self.setup_s += time.perf_counter() - t_setup
            return self.current
        await self.close()
        root = self.root or Path(cfg.run.output_dir) / "bench_real"
        run_dir = root / f"cluster{self.started}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))  # the trainer ranks read their config here
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
        self.say(f"  starting cluster{self.started}: {cfg.engine.count} engine(s) + {cfg.trainer.ranks} trainer rank(s), "
                 f"model {model_path.name}, logs {run_dir / 'logs'}")
        t0 = time.perf_counter()
        stack = contextlib.AsyncExitStack()
        self._stack = stack
        engines, trainer = await stack.enter_async_context(
            local_cluster(cfg, model_path, run_dir, lambda s: log.info("cluster%d: %s", self.started, s))
        )
        self.current = Cluster(key=key, index=self.started, engines=list(engines), trainer=trainer,
                               tokenizer=tokenizer, run_dir=run_dir, start_s=time.perf_counter() - t0)
        self.started += 1
        if warm_cfg is not None:
            one_step = msgspec.structs.replace(warm_cfg, run=msgspec.structs.replace(warm_cfg.run, steps=1))
            await run_real_variant(self.current, one_step, warmup=0)
        self.setup_s += time.perf_counter() - t_setup
        return self.current


async def publish_version_zero(cluster: Cluster, cfg: Config) -> None:
    """Send the trainer's current weights to every engine as version 0 (a new controller starts there)."""
    trainer = cluster.trainer
    manifest = await trainer.prepare_weights(0)
    with anyio.fail_after(weight_sync_timeout_s(cfg)):
        results = await asyncio.gather(
            trainer.send_weights(0), *(e.client.update_weights(manifest) for e in cluster.engines)
        )
    for e, r in zip(cluster.engines, results[1:]):
        if not r.ok or r.version != 0:
            raise RuntimeError(f"{e.client.name} did not load the version-0 weights before a bench variant: "
                               f"ok={r.ok} version={r.version} {r.error}; see {cluster.run_dir / 'logs'}")


# --------------------------------------------------------------------------- one variant
class RealRun(msgspec.Struct, kw_only=True):
    """One variant's run; rates and times over the steady window (steps warmup+1..steps)."""

    steps: int
    step_s: float  # seconds per training step
    samples_per_s: float  # trained samples per second
    tokens_per_s: float  # trained (policy-generated) tokens per second
    busy: float  # mean fraction of the window with >= 1 generate in flight, over engines
    train_s: float  # mean trainer.train_step time
    sync_s: float  # mean weight sync time
    wait_s: float  # mean time the train loop waited for a batch (step - train - sync)
    staleness_mean: float
    staleness_max: int
    response_len: float  # mean tokens per sample (generated + observations)
    turns: float  # mean env turns per sample
    reward: float
    wall_s: float  # the whole controller run, including its shutdown
    step_ends: list[float]  # loop seconds since the controller started, per step
    counters: dict[str, int] = {}


async def run_real_variant(cluster: Cluster, cfg: Config, warmup: int) -> RealRun:
    """Run the real controller for ``cfg.run.steps`` steps on ``cluster``; measure the steady window."""
    from flashrl.controller.controller import Controller
    from flashrl.plugins import make_suite

    await publish_version_zero(cluster, cfg)
    suite = TrainOnlySuite(make_suite(cfg.env.name, dict(cfg.env.params), cfg.run.seed, cfg.env.eval_size))
    probes = [BusyProbe(e.client) for e in cluster.engines]
    records: list[BatchStats] = []  # the trained steps' batch statistics
    marks: list[tuple[float, float]] = []  # (loop time, busy seconds summed over engines) at each step record

    def on_step(rec: StepRecord) -> None:
        if rec.step >= 1 and rec.batch is not None:
            now = anyio.current_time()
            records.append(rec.batch)
            marks.append((now, sum(p.busy_s(now) for p in probes)))

    ctrl = Controller(cfg, cluster.tokenizer, suite, probes, cluster.trainer, on_step=on_step)
    start = anyio.current_time()
    t0 = time.perf_counter()
    summary = await ctrl.run()
    wall = time.perf_counter() - t0
    if len(records) <= warmup:
        raise RuntimeError(f"the run recorded {len(records)} steps, not more than warmup = {warmup}: raise steps")
    win = records[warmup:]
    t_a, busy_a = marks[warmup - 1] if warmup else (start, 0.0)
    t_b, busy_b = marks[-1]
    span = t_b - t_a
    tokens = [r.tokens_per_s * r.step_s for r in win]
    return RealRun(
        steps=len(records),
        step_s=span / len(win),
        samples_per_s=sum(r.samples for r in win) / span,
        tokens_per_s=sum(tokens) / span,
        busy=(busy_b - busy_a) / (len(probes) * span),
        train_s=statistics.fmean(r.train_s for r in win),
        sync_s=statistics.fmean(r.weight_sync_s for r in win),
        # the sync's part on the step's path: prepare + the wait for a sync (weight_sync.overlap), else all of it
        wait_s=statistics.fmean(r.step_s - r.train_s - (r.sync.get("prepare_s", 0.0) + r.sync["wait_s"] if "wait_s" in r.sync
                                                       else r.weight_sync_s) for r in win),
        staleness_mean=statistics.fmean(r.staleness_mean for r in win),
        staleness_max=max(r.staleness_max for r in win),
        response_len=statistics.fmean(r.response_len_mean for r in win),
        turns=statistics.fmean(r.turns_mean for r in win),
        reward=statistics.fmean(r.reward_mean for r in win),
        wall_s=wall,
        step_ends=[t - start for t, _ in marks],
        counters=dict(summary.counters),
    )


# --------------------------------------------------------------------------- points and scenarios
class RealPointResult(PointOutcome, kw_only=True):
    """speedup: flash / baseline trained samples per second."""

    token_speedup: float  # flash / baseline trained tokens per second
    step_ratio: float  # baseline s/step / flash s/step
    cluster: str  # "reused": both variants on one cluster (version reset between them); else "fresh"
    cluster_start_s: float  # spawn -> every process ready and joined, for clusters this point started
    setup_s: float  # model preparation (a first build: minutes, once), cluster starts and warm-up steps
    wall_s: float  # the whole point: setup_s + both variants (and the version resets)
    base_config: dict[str, Any]
    flash_config: dict[str, Any]
    base: RealRun
    flash: RealRun


async def run_real_point(pool: ClusterPool, scn: Any, pt: Any, index: int) -> RealPointResult:
    t0 = time.perf_counter()
    base_cfg, _ = variant_config(scn, pt, "baseline")
    flash_cfg, _ = variant_config(scn, pt, "flash")
    started, setup0 = pool.started, pool.setup_s
    cluster = await pool.get(base_cfg, warm_cfg=base_cfg)
    base = await run_real_variant(cluster, base_cfg, scn.warmup)
    cluster_b = await pool.get(flash_cfg, warm_cfg=flash_cfg)
    flash = await run_real_variant(cluster_b, flash_cfg, scn.warmup)
    speedup = flash.samples_per_s / base.samples_per_s
    return RealPointResult(
        **point_outcome(scn, pt, index, speedup, base, flash),
        token_speedup=flash.tokens_per_s / base.tokens_per_s,
        step_ratio=base.step_s / flash.step_s,
        cluster="reused" if cluster_b is cluster else "fresh",
        cluster_start_s=sum({c.index: c.start_s for c in (cluster, cluster_b) if c.index >= started}.values()),
        setup_s=pool.setup_s - setup0,
        wall_s=time.perf_counter() - t0,
        base_config=msgspec.to_builtins(base_cfg),
        flash_config=msgspec.to_builtins(flash_cfg),
        base=base,
        flash=flash,
    )


def run_real_scenarios(scenarios: Sequence[tuple[str | Path, Any]], out_dir: str | Path, quiet: bool = False,
                       root: Path | None = None) -> list[list[RealPointResult]]:
    """Run every point of every (path, Scenario) on real processes, one cluster reused while it fits.

    Writes results.json, results.csv and <name>.png under ``out_dir/<name>/`` per scenario and
    prints a table (unless ``quiet``). ``root``: where cluster logs go (default
    ``<run.output_dir>/bench_real``).
    """
    return asyncio.run(_run_all(scenarios, Path(out_dir), quiet, root))


async def _run_all(scenarios: Sequence[tuple[str | Path, Any]], out_dir: Path, quiet: bool,
                   root: Path | None) -> list[list[RealPointResult]]:
    everything: list[list[RealPointResult]] = []
    async with ClusterPool(root, say=(lambda m: None) if quiet else (lambda m: print(m, flush=True))) as pool:
        for path, scn in scenarios:
            results: list[RealPointResult] = []
            for i, pt in enumerate(scn.points):
                res = await run_real_point(pool, scn, pt, i)
                gain_versus(results, res, pt, path)
                results.append(res)
                if not quiet:
                    print(f"  {scn.name} {pt.label}: {res.speedup:.2f}x samples/s, {res.token_speedup:.2f}x tokens/s "
                          f"(s/step {res.base_step_s:.2f} -> {res.flash_step_s:.2f}, busy {res.base_busy:.0%} -> "
                          f"{res.flash_busy:.0%}, cluster {res.cluster}, {res.wall_s:.0f}s wall of which "
                          f"{res.setup_s:.0f}s setup)", flush=True)
            out = out_dir / scn.name
            out.mkdir(parents=True, exist_ok=True)
            write_results(scn, results, out)
            if not quiet:
                print_results(scn, results)
            everything.append(results)
    return everything


# --------------------------------------------------------------------------- outputs
CSV_FIELDS = [
    "scenario", "label", "x", "speedup", "token_speedup", "step_ratio", "gain", "target", "passed",
    "base_step_s", "flash_step_s", "base_busy", "flash_busy", "flash_staleness_max", "cluster",
    "cluster_start_s", "setup_s", "wall_s",
]


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def write_results(scn: Any, results: list[RealPointResult], out: Path) -> None:
    doc = {"scenario": msgspec.to_builtins(scn), "mode": "real", "machine": machine(), "points": results}
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        run_cols = ["samples_per_s", "tokens_per_s", "train_s", "sync_s", "wait_s", "response_len", "turns"]
        w.writerow([*CSV_FIELDS, *(f"{v}_{c}" for v in ("base", "flash") for c in run_cols), "base_config", "flash_config"])
        for r in results:
            w.writerow([
                *(getattr(r, k) for k in CSV_FIELDS),
                *(getattr(run, c) for run in (r.base, r.flash) for c in run_cols),
                msgspec.json.encode(r.base_config).decode(), msgspec.json.encode(r.flash_config).decode(),
            ])
    plot(scn, results, out / f"{scn.name}.png")


def plot(scn: Any, results: list[RealPointResult], path: Path) -> None:
    fig, ax = new_figure()
    xs = list(range(len(results)))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [r.speedup for r in results], w, label="samples/s, flash / sync")
    ax.bar([x + w / 2 for x in xs], [r.token_speedup for r in results], w, label="tokens/s, flash / sync")
    ax.axhline(1.0, color="k", lw=0.8)
    plot_targets(ax, xs, results, markersize=30)
    for x, r in zip(xs, results):
        ax.annotate(f"{r.speedup:.2f}x", (x - w / 2, r.speedup), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [r.label for r in results])
    save_figure(fig, ax, path, scn, "throughput ratio (real, wall clock)", title_size=10, grid_axis="y")


def print_results(scn: Any, results: list[RealPointResult]) -> None:
    from rich.table import Table

    t = Table(title=f"{scn.name} (real): {scn.title}")
    for col in ("point", "sync s/step", "flash s/step", "samples/s", "tokens/s", "gain", "bar",
                "busy sync", "busy flash", "stale max", "len sync/flash", "cluster"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            r.label, f"{r.base_step_s:.2f}", f"{r.flash_step_s:.2f}", f"{r.speedup:.2f}x", f"{r.token_speedup:.2f}x",
            "" if r.gain is None else f"{r.gain - 1:+.1%}", bar_cell(r.target, r.passed), f"{r.base_busy:.0%}",
            f"{r.flash_busy:.0%}", str(r.flash_staleness_max), f"{r.base.response_len:.1f}/{r.flash.response_len:.1f}",
            r.cluster,
        )
    print_table(t)
