"""The Ray launcher: a run's engines and trainer ranks placed on a Ray cluster, one small actor per process.

Over 600 lines because it is one class (RayLauncher) whose parts share its connection and placement state.

    controller (the Ray driver)                              a Ray node
      preflight(): connect (or start a private instance);
        what the run asks vs what the cluster has -> LaunchError, before anything starts
      start(): placement groups, waited for (placement_timeout_s)
        engines: E bundles {CPU, GPU, custom}, one engine per bundle (PACK | SPREAD | STRICT_SPREAD)
        trainer: one bundle per node holding trainer_ranks_per_node ranks; STRICT_PACK (one node),
                 STRICT_SPREAD when the ranks span nodes
        judge engines (judge.model set): J bundles of cluster.ray.judge_*, one each (judge_strategy)
      endpoint(role, i) --- creates the slot's ProcActor in its bundle --->  ProcActor (async actor)
                        <-- node address + a free port on that node -------    .where(), .free_port()
      spawn(role, i, argv, env, log) -------------------------------------->    .spawn(): procs.Child.spawn
                                                                                  (own process group; parent =
                                                                                  the actor: dies with it)
      RayProc.alive (cached) <- a watcher awaits .wait_exit() <------------     exit code + log tail
      RayProc.stop / kill / reap_group ------------------------------------->    TERM / KILL the group
      close(): each actor kills its group, ray.kill(actor), remove the placement groups
      (ProcActor and RayProc: ray_proc.py)

One process per actor, so a process's whole tree dies with its actor: the child's parent-death signal
and watchdog (procs.child_init) fire when the actor's worker process goes, whether close() killed it,
its node died, or the driver died (Ray kills the actors a driver owns when the driver exits, and
removes its placement groups; tests/integration/test_ray_process.py counts the leftovers). Restart = spawn again: the
slot's old actor is killed and a new one placed in the same bundle (same node while it lives).
Which node runs what is written to runs/<name>/cluster.json.

Requirements and limits, stated plainly:
- Every node sees the run directory and the model folder at the same path (a shared filesystem): logs,
  config, checkpoints and the CURVE key file live there. A process whose node does not see it fails
  to spawn with that message.
- cluster.interface: "loopback" needs every Ray node on this machine (a test cluster); "auto" binds
  each process's sockets to its node's address as Ray reports it (CURVE-secured, per-run keys).
- Ray's own control calls (spawn this, its exit code) go through Ray; their payloads are msgspec-encoded
  bytes. flashrl's messages to engines and trainer stay ZeroMQ + msgspec.
- On GPUs each engine and each trainer rank gets the GPUs Ray assigned to its actor
  (CUDA_VISIBLE_DEVICES); a trainer rank then sees only its own GPU, so its LOCAL_RANK is 0. Not run
  here (no GPU on the development machines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from flashrl.launch.base import Endpoint, LaunchError, Proc, Role, proc_name, served_engines, tcp_url
from flashrl.launch.ray_head import READY, check_version
from flashrl.launch.ray_proc import (
    CALL_TIMEOUT_S,
    RayProc,
    RemoteProcActor,
    SpawnSpec,
    Where,
    groups_alive,
)
from flashrl.procs import Child, group_alive, kill_session, session_pids
from flashrl.procs import exit_text as procs_exit_text
from flashrl.wire.keys import CurveKeys
from flashrl.wire.transport import free_port

if TYPE_CHECKING:
    from flashrl.config import Config

log = logging.getLogger(__name__)

KEYS_FILE = "secrets/curve-keys.json"  # under the run directory (shared filesystem)
PLACEMENT_FILE = "cluster.json"  # under the run directory: which node runs what
HEAD_START_S = 60.0  # a private instance's head must answer within this
HEAD_STOP_S = 15.0  # ... and stop within this on SIGTERM (ray_head gives `ray start` 10 s), then SIGKILL


class _Slot:
    """One (role, index): its placement (bundle), the actor now holding it, whether that actor has spawned."""

    def __init__(self, role: Role, index: int) -> None:
        self.role = role
        self.index = index
        self.actor: Any = None
        self.where: Where | None = None
        self.spawned = False
        self.proc: RayProc | None = None
        self.generation = 0


class RayLauncher:
    """Engines and trainer ranks on a Ray cluster (``cluster.launcher = "ray"``; options in ``[cluster.ray]``)."""

    name = "ray"

    def __init__(self, cfg: Config, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.rcfg = cfg.cluster.ray
        self.run_dir = Path(run_dir).absolute()
        self.curve: CurveKeys | None = None
        self._owns_connection = False
        self._pgs: dict[str, PlacementGroup] = {}
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._actors: list[Any] = []  # every actor this launcher created (for close / leftovers)
        self._groups: list[tuple[str, int]] = []  # (node id, pgid) of every process spawned
        self._actor_pids: list[int] = []
        self._private_stopped = False
        self._head: Child | None = None  # the private instance's head (cluster.ray.address = "")
        self._head_pid = 0
        self._head_tmp = ""  # its Ray temp dir (sessions, sockets, logs; removed at close)
        self._head_finalizer: weakref.finalize[Any, Any] | None = None
        self._nodes: dict[str, str] = {}  # node id -> address
        self._closed = False
        self._started = False

    # ------------------------------------------------------------------ what the run asks for
    def _on_cuda(self) -> bool:
        """Engines on cuda: engine.device, or for "auto" whether this (the controller's) machine sees a GPU,
        the rule the engines' own device follows (processes.resolve_device). On a cluster whose driver node has
        no GPU, set engine.device = "cuda" (and trainer.backend = "nccl")."""
        if self.cfg.engine.device != "auto":
            return self.cfg.engine.device == "cuda"
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())

    def engine_gpus(self) -> float:
        g = self.rcfg.engine_gpus
        return float(g) if g != "auto" else (1.0 if self._on_cuda() else 0.0)

    def trainer_gpus(self) -> float:
        g = self.rcfg.trainer_gpus
        if g != "auto":
            return float(g)
        backend = self.cfg.trainer.backend
        return 1.0 if backend == "nccl" or (backend == "auto" and self._on_cuda()) else 0.0

    def ranks_per_node(self) -> int:
        k = self.rcfg.trainer_ranks_per_node
        return self.cfg.trainer.ranks if k <= 0 else min(k, self.cfg.trainer.ranks)

    def engine_bundle(self) -> dict[str, float]:
        b = {"CPU": self.rcfg.engine_cpus, "GPU": self.engine_gpus(), **self.rcfg.engine_resources}
        return {k: v for k, v in b.items() if v > 0}

    def judges(self) -> int:
        """Engines of the "judge" role the run starts: the judge's, then the distillation teachers' (base.served_engines)."""
        return served_engines(self.cfg)

    def judge_bundle(self) -> dict[str, float]:
        g = self.rcfg.judge_gpus
        gpus = float(g) if g != "auto" else self.engine_gpus()
        b = {"CPU": self.rcfg.judge_cpus, "GPU": gpus, **self.rcfg.judge_resources}
        return {k: v for k, v in b.items() if v > 0}

    def rank_resources(self) -> dict[str, float]:
        b = {"CPU": self.rcfg.trainer_cpus, "GPU": self.trainer_gpus(), **self.rcfg.trainer_resources}
        return {k: v for k, v in b.items() if v > 0}

    def trainer_bundles(self) -> list[dict[str, float]]:
        """One bundle per node the trainer uses, each holding ``ranks_per_node`` ranks (the last maybe fewer)."""
        ranks, k = self.cfg.trainer.ranks, self.ranks_per_node()
        sizes = [min(k, ranks - s) for s in range(0, ranks, k)]
        per = self.rank_resources()
        return [{r: v * n for r, v in per.items()} for n in sizes]

    def requested(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for b in [self.engine_bundle()] * self.cfg.engine.count + self.trainer_bundles() + [self.judge_bundle()] * self.judges():
            for r, v in b.items():
                total[r] = total.get(r, 0.0) + v
        return total

    # ------------------------------------------------------------------ preflight
    def preflight(self) -> None:
        """Connect to the cluster (or start a private instance) and check it can hold the run: LaunchError
        naming the resource and the numbers otherwise. Nothing of the run starts here."""
        if sys.platform != "linux":
            raise LaunchError("cluster.launcher = \"ray\": flashrl's processes need Linux (process groups, "
                              "parent-death signal)")
        self._connect()
        try:
            self._check_interface()
            self._check_resources()
        except LaunchError:
            self._disconnect()
            raise

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        addr = self.rcfg.address
        kwargs: dict[str, Any] = {"log_to_driver": False, "namespace": "flashrl"}
        target = addr or self._start_head()
        # ray.init sets its own SIGTERM handler on the main thread (sys.exit); the run's handler stays.
        prev = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(address=target, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            self._stop_head()
            hint = ("start one with `ray start --head` on this machine, or name its head with "
                    "cluster.ray.address = \"HOST:6379\"") if addr == "auto" else "check the address and that the cluster runs"
            raise LaunchError(f"cluster.ray.address = {addr!r}: cannot connect to Ray ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); {hint}") from None
        finally:
            if prev is not None and threading_is_main():
                signal.signal(signal.SIGTERM, prev)
        self._owns_connection = True
        log.info("cluster: Ray %s at %s (%s)", ray.__version__, addr or "a private local instance",
                 ray.get_runtime_context().gcs_address)

    def _start_head(self) -> str:
        """A private instance for this run (cluster.ray.address = ""): `ray start --head` under a supervised
        child (flashrl.launch.ray_head) that dies with this process and takes every Ray daemon along; logical
        CPUs enough for what the run asks (thread counts are set by engine.threads / trainer.threads, not by
        Ray), GPUs as detected, no dashboard. Its GCS address once it answers, or LaunchError."""
        too_old = check_version(ray.__version__)
        if too_old:
            raise LaunchError(too_old)
        need = self.requested().get("CPU", 0.0)
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port("127.0.0.1"))
        port, *others = sorted(ports)
        log_path = self.run_dir / "logs" / "ray-head.log"
        self._head_tmp = tempfile.mkdtemp(prefix="flashrl-ray-")  # short: Ray's socket paths live under it
        address_file = Path(self._head_tmp) / "ray_current_cluster"
        cmd = [sys.executable, "-m", "flashrl.launch.ray_head", f"--port={port}",
               f"--num-cpus={max(os.cpu_count() or 1, math.ceil(need))}", "--ports", *map(str, others),
               f"--temp-dir={self._head_tmp}"]
        start = log_path.stat().st_size if log_path.exists() else 0
        # Ray's token authentication with a token of this instance's own (not ~/.ray/auth_token): the head gets
        # it in its environment, this process (the only driver) too, before ray.init
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        ray._raylet.Config.initialize("")  # type: ignore[attr-defined]  # Ray's C++ config read the mode at import: re-read (as Ray does itself)
        self._head = Child.spawn("ray-head", cmd, log_path)
        self._head_pid = self._head.pid
        # dropped without close() while this process lives on: the whole instance goes (not only the group)
        self._head_finalizer = weakref.finalize(self, kill_session, self._head_pid)
        end = time.monotonic() + HEAD_START_S
        while True:
            with contextlib.suppress(OSError), open(log_path, "rb") as f:
                f.seek(start)
                if READY.encode() in f.read() and address_file.exists():
                    return address_file.read_text().strip()
            if not self._head.alive or time.monotonic() > end:
                what = (f"did not answer within {HEAD_START_S:g} s" if self._head.alive
                        else procs_exit_text(self._head.returncode))
                tail = self._head.log_tail(30)
                self._stop_head()
                raise LaunchError(f"cluster.ray.address = \"\": the private Ray instance (`ray start --head`, "
                                  f"log {log_path}) {what}; last lines:\n{tail}\nset cluster.ray.address to a "
                                  f"running Ray cluster (\"auto\" or \"HOST:6379\") instead")
            time.sleep(0.2)

    def _stop_head(self) -> None:
        """Stop the private instance: SIGTERM to the head child (Ray's orderly stop of this instance), bounded,
        then SIGKILL whatever of its session is left; returns once nothing of it runs."""
        head, self._head = self._head, None
        if head is None:
            return
        tmp = Path(self._head_tmp)
        if head.alive:
            head.proc.send_signal(signal.SIGTERM)
            try:
                head.proc.wait(HEAD_STOP_S)
            except subprocess.TimeoutExpired:
                log.warning("cluster: the private Ray instance did not stop within %g s; killing it", HEAD_STOP_S)
        end = time.monotonic() + 10.0
        while kill_session(head.pid) and time.monotonic() < end:
            time.sleep(0.05)
            head.proc.poll()
        head.kill()
        head.proc.poll()
        head._finalizer.detach()
        if self._head_finalizer is not None:
            self._head_finalizer.detach()
        shutil.rmtree(tmp, ignore_errors=True)

    def _disconnect(self) -> None:
        if self._owns_connection and ray.is_initialized():
            ray.shutdown()
            self._private_stopped = not self.rcfg.address
        self._owns_connection = False
        self._stop_head()  # a private instance (cluster.ray.address = "") stops with it

    def _alive_nodes(self) -> list[dict[str, Any]]:
        return [n for n in ray.nodes() if n.get("Alive")]

    def _check_interface(self) -> None:
        iface = self.cfg.cluster.interface
        ips = sorted({str(n["NodeManagerAddress"]) for n in self._alive_nodes()})
        here = ray.util.get_node_ip_address()
        if iface == "loopback" and (len(ips) > 1 or (ips and ips[0] != here)):
            raise LaunchError(
                f"cluster.interface = \"loopback\" reaches processes on this machine only, and the Ray cluster's "
                f"nodes are at {', '.join(ips)} (this machine: {here}); set cluster.interface = \"auto\" (each "
                "node's address, CURVE-secured)")
        if iface not in ("loopback", "auto") and ips != [iface]:
            raise LaunchError(
                f"cluster.interface = {iface!r} is one machine's address, and the Ray cluster's nodes are at "
                f"{', '.join(ips)}; with cluster.launcher = \"ray\" use \"auto\" (each node's address as Ray "
                "reports it) or \"loopback\" (every node on this machine)")

    def _check_resources(self) -> None:
        have = {k: float(v) for k, v in ray.cluster_resources().items()}
        need = self.requested()
        E, R, J = self.cfg.engine.count, self.cfg.trainer.ranks, self.judges()
        eb, rb, jb = self.engine_bundle(), self.rank_resources(), self.judge_bundle()
        problems = []
        for res, n in sorted(need.items()):
            if n > have.get(res, 0.0) + 1e-9:
                key = {"CPU": "cpus", "GPU": "gpus"}.get(res)
                per_e = f"cluster.ray.engine_{key}" if key else f"cluster.ray.engine_resources.{res}"
                per_t = f"cluster.ray.trainer_{key}" if key else f"cluster.ray.trainer_resources.{res}"
                per_j = f"cluster.ray.judge_{key}" if key else f"cluster.ray.judge_resources.{res}"
                parts = []
                if eb.get(res):
                    parts.append(f"engine.count={E} x {per_e}={eb[res]:g}")
                if rb.get(res):
                    parts.append(f"trainer.ranks={R} x {per_t}={rb[res]:g}")
                if J and jb.get(res):
                    parts.append(f"judge.engines={J} x {per_j}={jb[res]:g}")
                unit = f"{res}s" if res in ("CPU", "GPU") else f"of resource {res!r}"
                problems.append(f"{n:g} {unit} requested ({' + '.join(parts)}), the Ray cluster has "
                                f"{have.get(res, 0.0):g}")
        if problems:
            raise LaunchError("cluster: " + "; ".join(problems) +
                              ". Lower the requests ([cluster.ray], engine.count, trainer.ranks, judge.engines) or add nodes.")
        nodes = self._alive_nodes()

        def fits(bundle: dict[str, float]) -> bool:
            return any(all(float(n["Resources"].get(r, 0.0)) + 1e-9 >= v for r, v in bundle.items()) for n in nodes)

        def largest(bundle: dict[str, float]) -> str:
            return ", ".join(f"{r} {max(float(n['Resources'].get(r, 0.0)) for n in nodes):g}" for r in bundle)

        if not fits(eb):
            raise LaunchError(f"cluster: one engine needs {_fmt(eb)} on one node, and no Ray node has that "
                              f"(the largest per resource: {largest(eb)}); lower cluster.ray.engine_*")
        if J and not fits(jb):
            raise LaunchError(f"cluster: one judge engine needs {_fmt(jb)} on one node, and no Ray node has that "
                              f"(the largest per resource: {largest(jb)}); lower cluster.ray.judge_*")
        tb = self.trainer_bundles()[0]
        if not fits(tb):
            raise LaunchError(
                f"cluster: trainer ranks packed {self.ranks_per_node()} per node need {_fmt(tb)} on one node "
                f"(cluster.ray.trainer_ranks_per_node = {self.rcfg.trainer_ranks_per_node}), and no Ray node has "
                f"that (the largest per resource: {largest(tb)}); lower cluster.ray.trainer_* or pack fewer ranks per node")

    # ------------------------------------------------------------------ start / placement
    async def start(self) -> None:
        """Placement groups for the engines and the trainer, waited for; CURVE keys when off loopback."""
        if self._started:
            return
        self._connect()
        self._started = True
        if self.cfg.cluster.interface != "loopback" and self.curve is None:
            self.curve = CurveKeys.generate(self.run_dir / KEYS_FILE)
        tag = f"flashrl-{self.cfg.run.name}-{os.getpid()}"
        tb = self.trainer_bundles()
        self._pgs["engine"] = placement_group([self.engine_bundle()] * self.cfg.engine.count,
                                              strategy=self.rcfg.engine_strategy, name=f"{tag}-engines")
        self._pgs["trainer"] = placement_group(tb, strategy="STRICT_PACK" if len(tb) == 1 else "STRICT_SPREAD",
                                               name=f"{tag}-trainer")
        if self.judges():
            self._pgs["judge"] = placement_group([self.judge_bundle()] * self.judges(), strategy=self.rcfg.judge_strategy,
                                                 name=f"{tag}-judges")
        timeout = self.rcfg.placement_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(pg.ready() for pg in self._pgs.values()))
        except TimeoutError:
            pending = [f"{role}: {placement_group_table(pg).get('state', '?')} "
                       f"({len(pg.bundle_specs)} bundle(s) of {_fmt(pg.bundle_specs[0])})"
                       for role, pg in self._pgs.items()]
            avail = {k: round(float(v), 2) for k, v in ray.available_resources().items()
                     if not k.startswith("node:") and "memory" not in k}
            await self._remove_pgs()
            raise LaunchError(f"cluster: the placement groups were not placed within "
                              f"cluster.ray.placement_timeout_s = {timeout:g} s ({'; '.join(pending)}); the Ray "
                              f"cluster has available now: {avail} (other jobs may hold the rest)") from None
        self._nodes = {str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in self._alive_nodes()}
        log.info("cluster: placement groups ready: engines on %s, trainer on %s%s",
                 self._bundle_nodes("engine"), self._bundle_nodes("trainer"),
                 f", judge engines on {self._bundle_nodes('judge')}" if "judge" in self._pgs else "")

    def _bundle_nodes(self, role: str) -> list[str]:
        table = placement_group_table(self._pgs[role])
        return [self._nodes.get(str(table["bundles_to_node_id"].get(i, "")), "?") for i in range(len(table["bundles"]))]

    def _scheduling(self, role: Role, index: int) -> dict[str, Any]:
        """The actor options that put (role, index) in its bundle, asking for its share of it."""
        if role == "engine":
            res = self.engine_bundle()
            pg, bundle = self._pgs["engine"], index
        elif role == "judge":
            if "judge" not in self._pgs:
                raise LaunchError(f"cluster: {proc_name(role, index)} was not asked for (judge.model is empty)")
            res = self.judge_bundle()
            pg, bundle = self._pgs["judge"], index
        elif role == "trainer":
            res = self.rank_resources()
            pg, bundle = self._pgs["trainer"], index // self.ranks_per_node()
        else:  # environment workers: CPU only, anywhere
            return {"num_cpus": self.rcfg.env_cpus}
        return {
            "num_cpus": res.get("CPU", 0.0), "num_gpus": res.get("GPU", 0.0),
            "resources": {k: v for k, v in res.items() if k not in ("CPU", "GPU")},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        }

    async def _new_actor(self, slot: _Slot) -> None:
        if self._closed:
            raise LaunchError(f"cluster: the Ray launcher is closed; cannot start {proc_name(slot.role, slot.index)}")
        if not self._started:
            await self.start()
        if slot.actor is not None:  # the old one must leave the bundle before the new one fits in it
            await self._kill_actor(slot.actor)
        slot.generation += 1
        actor: Any = RemoteProcActor.options(
            name=None, max_restarts=0, max_concurrency=64, **self._scheduling(slot.role, slot.index),
        ).remote()
        self._actors.append(actor)
        slot.actor, slot.spawned, slot.proc = actor, False, None
        try:
            async with asyncio.timeout(self.rcfg.placement_timeout_s):
                slot.where = msgspec.msgpack.decode(await actor.where.remote(), type=Where)
        except TimeoutError:
            raise LaunchError(f"cluster: the Ray actor for {proc_name(slot.role, slot.index)} did not start within "
                              f"cluster.ray.placement_timeout_s = {self.rcfg.placement_timeout_s:g} s") from None
        self._nodes.setdefault(slot.where.node_id, slot.where.ip)
        self._actor_pids.append(slot.where.actor_pid)

    async def _ready_slot(self, role: Role, index: int) -> _Slot:
        """The slot's actor for its next process: the one an ``endpoint`` call just placed, else a fresh one
        (a restart: the old actor, and whatever it still holds, is killed; the new one takes the same bundle)."""
        slot = self._slots.setdefault((role, index), _Slot(role, index))
        if slot.actor is None or slot.spawned:
            await self._new_actor(slot)
        return slot

    def _host(self, where: Where) -> str:
        return "127.0.0.1" if self.cfg.cluster.interface == "loopback" else where.ip

    # ------------------------------------------------------------------ the Launcher interface
    async def endpoint(self, role: Role, index: int) -> Endpoint:
        """A free port on the node where (role, index)'s next process will run (its actor is placed now)."""
        slot = await self._ready_slot(role, index)
        assert slot.where is not None
        host = self._host(slot.where)
        async with asyncio.timeout(CALL_TIMEOUT_S):
            port = int(await slot.actor.free_port.remote(host))
        url = tcp_url(host, port)
        return Endpoint(bind=url, connect=url, host=host)

    async def spawn(self, role: Role, index: int, argv: list[str], env: dict[str, str], log_path: Path | None) -> Proc:
        slot = await self._ready_slot(role, index)
        assert slot.where is not None
        name = proc_name(role, index)
        logp = _absolute(log_path) if log_path is not None else self.run_dir / "logs" / f"{role}{index}.log"
        full_env = dict(env)
        if self.curve is not None:
            full_env.update(self.curve.env())
        spec = SpawnSpec(name=name, argv=list(argv), env=full_env, log_path=str(logp), cwd=os.getcwd(),
                         run_dir=str(self.run_dir), gpu_local_rank=role == "trainer")
        slot.spawned = True
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                pid = int(await slot.actor.spawn.remote(msgspec.msgpack.encode(spec)))
        except ray.exceptions.RayTaskError as e:
            raise LaunchError(f"cluster: cannot start {name} on node {slot.where.ip}: {e.cause}") from None
        self._groups.append((slot.where.node_id, pid))
        proc = RayProc(name, slot.actor, logp, slot.where, pid)
        slot.proc = proc
        log.info("cluster: %s on node %s (pid %d, generation %d); log %s", name, slot.where.ip, pid,
                 slot.generation, logp)
        self._write_placement()
        return proc

    def trainer_master(self) -> str:
        """Trainer rank 0's node address (bundle 0 of the trainer's placement group)."""
        slot = self._slots.get(("trainer", 0))
        if slot is not None and slot.where is not None:
            return self._host(slot.where)
        if self.cfg.cluster.interface == "loopback":
            return "127.0.0.1"
        if "trainer" not in self._pgs:
            raise LaunchError("cluster: trainer_master() before start(): the trainer is not placed yet")
        return self._bundle_nodes("trainer")[0]

    async def trainer_port(self) -> int:
        """A port free now on trainer rank 0's node (asked of the actor holding rank 0)."""
        slot = self._slots.get(("trainer", 0))
        if slot is None or slot.actor is None:
            slot = await self._ready_slot("trainer", 0)
        assert slot.where is not None
        async with asyncio.timeout(CALL_TIMEOUT_S):
            return int(await slot.actor.free_port.remote(self._host(slot.where)))

    def placement(self) -> dict[str, dict[str, Any]]:
        """Which node runs what: {"engine0": {"node_id", "ip", "pid", "generation"}, ...}."""
        out = {}
        for (role, index), s in sorted(self._slots.items()):
            if s.where is not None and s.proc is not None:
                out[f"{role}{index}"] = {"node_id": s.where.node_id, "ip": s.where.ip, "pid": s.proc.pid,
                                         "generation": s.generation, "gpus": s.where.gpus}
        return out

    def _write_placement(self) -> None:
        with contextlib.suppress(OSError):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.run_dir / (PLACEMENT_FILE + ".tmp")
            tmp.write_bytes(msgspec.json.format(msgspec.json.encode(
                {"launcher": "ray", "gcs_address": ray.get_runtime_context().gcs_address,
                 "placement": self.placement()})))
            tmp.replace(self.run_dir / PLACEMENT_FILE)

    # ------------------------------------------------------------------ teardown
    async def _kill_actor(self, actor: Any) -> None:
        """Its process group first (SIGKILL, waited for), then the actor itself."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10.0):
                await actor.reap.remote(5.0)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    async def _remove_pgs(self) -> None:
        for pg in self._pgs.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    async def close(self) -> None:
        """Every actor (and the process group it holds) killed, the placement groups removed, the key file
        deleted; the Ray connection closed when this launcher opened it (a private instance stops)."""
        if self._closed:
            return
        self._closed = True
        if ray.is_initialized():
            await asyncio.gather(*(self._kill_actor(a) for a in self._actors), return_exceptions=True)
            await self._wait_actors_gone(10.0)
            await self._remove_pgs()
        if self.curve is not None:
            self.curve.remove()
        self._disconnect()

    async def _wait_actors_gone(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for a in self._actors:
            # Ray signals an actor's death only to a caller: ask until it answers "dead" (bounded)
            while time.monotonic() < end and await self._actor_alive_quick(a):  # noqa: ASYNC110
                await asyncio.sleep(0.1)

    async def _actor_alive_quick(self, actor: Any) -> bool:
        try:
            async with asyncio.timeout(2.0):
                await actor.pgid.remote()
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError):
            return False
        except TimeoutError:
            return True
        return True

    def leftovers(self) -> dict[str, int]:
        """What this launcher started that is still there: actors alive, placement groups not removed,
        process groups alive on their nodes (asked on each node). After close() with a private instance:
        the counts taken just before it stopped."""
        if not ray.is_initialized():
            if not self._private_stopped:
                raise RuntimeError("leftovers(): not connected to the Ray cluster this launcher used")
            # the private instance ran on this machine: its actors' worker processes and the process
            # groups they held are checked here directly (the placement groups went with the instance)
            # and every process of the instance itself (its head child's session: Ray's daemons)
            instance = len(session_pids(self._head_pid)) if self._head_pid else 0
            return {"actors": sum(1 for p in self._actor_pids if _pid_alive(p)), "placement_groups": 0,
                    "processes": sum(1 for _, g in self._groups if group_alive(g)) + instance}
        actors = 0
        for a in self._actors:
            try:
                ray.get(a.pgid.remote(), timeout=5.0)
                actors += 1
            except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError):
                pass
            except ray.exceptions.GetTimeoutError:
                actors += 1
        pgs = sum(1 for pg in self._pgs.values() if placement_group_table(pg).get("state") not in ("REMOVED", None))
        by_node: dict[str, list[int]] = {}
        for node, pgid in self._groups:
            by_node.setdefault(node, []).append(pgid)
        alive_nodes = {str(n["NodeID"]) for n in self._alive_nodes()}
        procs = 0
        for node, pgids in by_node.items():
            if node not in alive_nodes:
                continue  # the node is gone (and its raylet killed its workers)
            ref = groups_alive.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pgids)
            procs += int(ray.get(ref, timeout=60.0))
        return {"actors": actors, "placement_groups": pgs, "processes": procs}


def _absolute(path: str | Path) -> Path:
    return Path(os.path.abspath(path))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"
