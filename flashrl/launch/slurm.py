"""The SLURM launcher: an sbatch script rendered from the config, one `flashrl node` task per node.

    flashrl run CONFIG --launcher slurm [--dry-run]        (login node)
      -> plan(cfg): which node runs what ([cluster.slurm] layout, or auto); LaunchError before anything
      -> runs/<name>/slurm/config.toml (the resolved config) + job.sbatch (printed; --dry-run stops here)
      -> per-run CURVE keys -> runs/<name>/secrets/curve-keys.json (0600); `sbatch job.sbatch`
    job.sbatch (batch step, on node 0 = the first host of the allocation = the rendezvous)
      -> `flashrl node CONFIG --prepare`  (the model built/cached once; keys if missing)
      -> srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash job.sbatch --node
    job.sbatch --node (one task per node; SLURM_NODEID picks the line) -> `flashrl node CONFIG --node N`
      every node: a node agent, tcp://0.0.0.0:<port + N>, CURVE (only the run's client key): starts,
                  stops and reports the node's processes (procs.Child each: own process group, dies
                  with the agent), answers "a free port on this node"
      node 0 also: waits until every agent answers, starts the controller (`flashrl run CONFIG`, a
                  procs.Child), heartbeats the other agents; when the controller exits, shuts every
                  agent down and exits with the controller's code
    controller (node 0): launch.local_cluster with SlurmLauncher: endpoint/spawn/trainer_port are
                  requests to the agent of the node the plan gives; a restart is another Spawn there

Why this design (and not one `srun --overlap --nodelist=HOST` step per process): the controller code
stays the same as with the local launcher *and* an engine restart is just another ``spawn`` — the
node's agent starts it as a procs.Child, exactly like the local launcher does, so the supervision
rules (process groups, SIGTERM -> SIGKILL ladder, parent-death signal + watchdog) are the same code
on every node. One srun step per process would need srun on the controller's PATH for every restart,
steps whose GPU binding depends on the site's cgroup/GRES settings, and cannot be exercised without a
real SLURM; here srun starts one plain command per node, which a test runs as it is (SLURM_* set by
hand, every "node" this machine). What SLURM still does, it does best: the allocation, one task per
node, and teardown of last resort (scancel, the end of the job, --kill-on-bad-exit).

Teardown, however the run ends: the controller's launcher stops what it started (StopAll on every
agent); node 0 then sends NodeShutdown to every agent. Controller killed -> node 0's agent sees its
child exit, shuts every agent down, exits non-zero (srun's --kill-on-bad-exit ends the step). An
agent killed -> its processes die with it (parent-death signal); a node agent that hears nothing
from node 0 for cluster.slurm.heartbeat_timeout_s stops its processes and exits 1.

The run directory must be on a filesystem every node mounts (logs, the key file, checkpoints), as on
any SLURM cluster. The agent listens on every interface of its node (the controller reaches it by
the host name in SLURM_JOB_NODELIST) and only a peer holding the run's client key gets an answer;
engine and trainer sockets bind to ``cluster.interface`` ("auto": the node's primary address).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashrl.launch.base import Endpoint, LaunchError, Proc, Role, interface_host, proc_name, tcp_url
from flashrl.launch.local import KEYS_FILE
from flashrl.procs import Child, exit_text, group_alive, stop_ladder, tail
from flashrl.wire.keys import KEYS_ENV, CurveKeys, KeyFileError
from flashrl.wire.protocol import (
    NODE_REPLIES,
    NODE_REQUESTS,
    Error,
    FreePort,
    KillProc,
    Msg,
    NodeHello,
    NodeInfo,
    NodeShutdown,
    Ok,
    PollProcs,
    PortReply,
    ProcStates,
    Reaped,
    ReapProc,
    Spawn,
    Spawned,
    StopAll,
    StopProc,
)
from flashrl.wire.transport import PeerDead, RemoteError, RpcClient, RpcServer, free_port

if TYPE_CHECKING:
    from flashrl.config import Config

log = logging.getLogger(__name__)

HEAD_ENV = "FLASHRL_SLURM_HEAD"  # set by node 0's agent on the controller it starts: "inside the allocation"
SCRIPT = "job.sbatch"
CONFIG = "config.toml"
POLL_S = 0.5  # how often the launcher asks each agent which processes exited
SIGNAL_GRACE_S = 45.0  # another node, SIGTERM (scancel): how long it waits for node 0's NodeShutdown
CONTROLLER_STOP_S = 60.0  # node 0, SIGTERM: the controller's grace to checkpoint and stop (launch.STOP_GRACE_S + shutdown)


# =========================================================================== host lists
def expand_hostlist(spec: str) -> list[str]:
    """SLURM's host list syntax -> host names, in order: ``node[01-03,07],gpu5`` -> node01 node02 node03
    node07 gpu5. Ranges keep the lower bound's zero padding; several bracket groups in one name
    (``r[1-2]n[1-2]``) expand as a product, like ``scontrol show hostnames``. ValueError on bad syntax."""
    hosts: list[str] = []
    for item in _split_top(spec.strip()):
        if not item:
            raise ValueError(f"host list {spec!r}: empty name (stray comma)")
        hosts.extend(_expand_name(item, spec))
    return hosts


def _split_top(spec: str) -> list[str]:
    """Split at commas outside brackets."""
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in spec:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {spec!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {spec!r}: ']' without '['")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"host list {spec!r}: '[' without ']'")
    items.append("".join(cur))
    return [] if items == [""] else items


def _expand_name(name: str, spec: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        if "]" in name:
            raise ValueError(f"host list {spec!r}: ']' without '['")
        return [name]
    head, tail_ = name[: m.start()], name[m.end():]
    out: list[str] = []
    for part in m.group(1).split(","):
        r = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if r is None:
            raise ValueError(f"host list {spec!r}: {part!r} in [{m.group(1)}] is not a number or a range a-b")
        lo_s, hi_s = r.group(1), r.group(2) or r.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"host list {spec!r}: range {part!r} runs backwards")
        width = len(lo_s)
        for k in range(lo, hi + 1):
            out.extend(head + str(k).zfill(width) + rest for rest in _expand_name(tail_, spec))
    return out


def node_hosts(env: Mapping[str, str] | None = None, *, scontrol: bool = True) -> list[str]:
    """The allocation's hosts (node 0 first) from SLURM_JOB_NODELIST: ``scontrol show hostnames`` when it
    is on PATH, else ``expand_hostlist``. LaunchError outside an allocation."""
    env = os.environ if env is None else env
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not spec:
        raise LaunchError("cluster.launcher = \"slurm\": SLURM_JOB_NODELIST is not set: this is not inside a SLURM "
                          "allocation; submit with `flashrl run CONFIG --launcher slurm`")
    exe = shutil.which("scontrol") if scontrol else None
    if exe is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([exe, "show", "hostnames", spec], capture_output=True, text=True, timeout=30, check=True)
            hosts = out.stdout.split()
            if hosts:
                return hosts
    try:
        return expand_hostlist(spec)
    except ValueError as e:
        raise LaunchError(f"SLURM_JOB_NODELIST: {e}") from None


# =========================================================================== layout
@dataclass(frozen=True)
class Place:
    """Where one process runs: its node and the node-local GPU indices it sees (CUDA_VISIBLE_DEVICES)."""

    node: int
    gpus: tuple[int, ...] = ()
    local_rank: int = 0  # trainer ranks: LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (torchrun's names)
    local_world: int = 1
    group_rank: int = 0


@dataclass
class Plan:
    """Which node runs what. Node 0 (the first host of the allocation) always runs the controller."""

    nodes: int
    gpus_per_node: int
    engines: list[list[int]]  # per node
    ranks: list[list[int]]  # per node
    places: dict[tuple[str, int], Place] = field(default_factory=dict)

    def place(self, role: Role, index: int) -> Place:
        if role == "env":  # remote-env workers: next to the controller
            return Place(0)
        try:
            return self.places[(role, index)]
        except KeyError:
            raise LaunchError(f"cluster.slurm: the layout places no {proc_name(role, index)}") from None

    def node_of(self, role: Role, index: int) -> int:
        return self.place(role, index).node

    def describe(self, node: int) -> str:
        """"controller; trainer ranks 0-7 on GPUs 0-7; engines 0-3 on GPUs 8-11" (for the script's comments)."""
        parts = ["controller (rendezvous)"] if node == 0 else []
        for what, role, items in (("trainer rank", "trainer", self.ranks[node]), ("engine", "engine", self.engines[node])):
            if not items:
                continue
            text = f"{what}{'s' if len(items) > 1 else ''} {_ranges(items)}"
            if self.gpus_per_node:
                gpus = sorted({g for i in items for g in self.places[(role, i)].gpus})
                text += f" on GPU{'s' if len(gpus) > 1 else ''} {_ranges(gpus)}"
            parts.append(text)
        return "; ".join(parts) or "nothing"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    out: list[str] = []
    xs = sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def plan(cfg: Config) -> Plan:
    """The layout of ``cfg`` on its allocation; LaunchError naming the keys and the numbers when it cannot fit."""
    s = cfg.cluster.slurm
    n, gpn = s.nodes, s.gpus_per_node
    engines, ranks = cfg.engine.count, cfg.trainer.ranks
    if gpn == 0 and cfg.engine.device == "cuda":
        raise LaunchError("engine.device = \"cuda\" but cluster.slurm.gpus_per_node = 0: give the nodes' GPU count "
                          "(cluster.slurm.gpus_per_node = 8) or set engine.device = \"cpu\"")
    if gpn == 0 and cfg.trainer.backend == "nccl":
        raise LaunchError("trainer.backend = \"nccl\" but cluster.slurm.gpus_per_node = 0: NCCL needs GPUs")
    if gpn > 0 and cfg.engine.device == "cpu":
        raise LaunchError(f"cluster.slurm.gpus_per_node = {gpn} but engine.device = \"cpu\": set engine.device = "
                          "\"cuda\" (or \"auto\"), or cluster.slurm.gpus_per_node = 0 for CPU nodes")
    if n > 1 and cfg.cluster.interface != "auto":
        raise LaunchError(f"cluster.interface = {cfg.cluster.interface!r} cannot be reached from other nodes "
                          f"(cluster.slurm.nodes = {n}): set cluster.interface = \"auto\" (each node's primary address)")
    if s.layout:
        per_engines = [sorted(x.engines) for x in s.layout]
        per_ranks = [sorted(x.trainer_ranks) for x in s.layout]
        if len(s.layout) != n:
            raise LaunchError(f"cluster.slurm.layout has {len(s.layout)} node table(s) but cluster.slurm.nodes = {n}: "
                              "give one [[cluster.slurm.layout]] per node (node 0 first), or none for the automatic layout")
        for what, key, count, per in (("engine", "engines", engines, per_engines),
                                      ("trainer rank", "trainer_ranks", ranks, per_ranks)):
            seen: dict[int, int] = {}
            cfg_key = "engine.count" if key == "engines" else "trainer.ranks"
            for node, items in enumerate(per):
                for i in items:
                    if i >= count:
                        raise LaunchError(f"cluster.slurm.layout[{node}].{key}: {what} {i} does not exist "
                                          f"({cfg_key} = {count}: {what}s 0-{count - 1})")
                    if i in seen:
                        raise LaunchError(f"cluster.slurm.layout: {what} {i} is placed twice (nodes {seen[i]} and {node})")
                    seen[i] = node
            missing = [i for i in range(count) if i not in seen]
            if missing:
                raise LaunchError(f"cluster.slurm.layout places no node for {what}{'s' if len(missing) > 1 else ''} "
                                  f"{_ranges(missing)} ({cfg_key} = {count}): add {'them' if len(missing) > 1 else 'it'} "
                                  f"to a node's {key}")
        for node in range(n):
            need = len(per_engines[node]) + len(per_ranks[node])
            if gpn and need > gpn:
                raise LaunchError(f"cluster.slurm.layout[{node}]: {len(per_engines[node])} engine(s) + "
                                  f"{len(per_ranks[node])} trainer rank(s) need {need} GPUs (one each), but "
                                  f"cluster.slurm.gpus_per_node = {gpn}")
            if node > 0 and need == 0:
                raise LaunchError(f"cluster.slurm.layout[{node}] runs nothing: remove the node (cluster.slurm.nodes = "
                                  f"{n - 1}) or place engines or trainer ranks on it")
    elif gpn > 0:
        need = ranks + engines
        if need > n * gpn:
            more = -(-need // gpn)
            raise LaunchError(f"cluster.slurm: trainer.ranks = {ranks} + engine.count = {engines} need {need} GPUs "
                              f"(one each), but cluster.slurm.nodes = {n} x cluster.slurm.gpus_per_node = {gpn} "
                              f"gives {n * gpn}: set cluster.slurm.nodes = {more}, or fewer engines/ranks")
        used = -(-need // gpn)
        if used < n:
            raise LaunchError(f"cluster.slurm.nodes = {n}, but trainer.ranks = {ranks} + engine.count = {engines} "
                              f"fill only {used} node(s) of {gpn} GPUs: set cluster.slurm.nodes = {used}, or give "
                              "[[cluster.slurm.layout]] tables")
        per_ranks = [[] for _ in range(n)]
        per_engines = [[] for _ in range(n)]
        for slot in range(need):  # trainer ranks first (packed from node 0), then engines
            node = slot // gpn
            (per_ranks if slot < ranks else per_engines)[node].append(slot if slot < ranks else slot - ranks)
    else:  # CPU nodes: the trainer next to the controller, engines spread over the other nodes
        if n > 1 and engines < n - 1:
            raise LaunchError(f"cluster.slurm.nodes = {n}, but engine.count = {engines} engine(s) fill only "
                              f"{engines} node(s) besides node 0 (the controller and trainer): set "
                              f"cluster.slurm.nodes = {engines + 1}, or give [[cluster.slurm.layout]] tables")
        per_ranks = [list(range(ranks))] + [[] for _ in range(n - 1)]
        per_engines = [[] for _ in range(n)]
        for i in range(engines):
            per_engines[0 if n == 1 else 1 + i % (n - 1)].append(i)
    p = Plan(n, gpn, per_engines, per_ranks)
    trainer_nodes = [node for node in range(n) if per_ranks[node]]
    for node in range(n):
        gpus = iter(range(gpn))
        rank_gpus = tuple(next(gpus) for _ in per_ranks[node]) if gpn else ()
        for local, r in enumerate(per_ranks[node]):
            p.places[("trainer", r)] = Place(node, rank_gpus, local, len(per_ranks[node]), trainer_nodes.index(node))
        for i in per_engines[node]:
            p.places[("engine", i)] = Place(node, (next(gpus),) if gpn else ())
    return p


# =========================================================================== the script
def job_dir(cfg: Config) -> Path:
    return cfg.run_dir / "slurm"


def render_script(cfg: Config, p: Plan, *, config_path: str, run_dir: str, workdir: str, python: str,
                  resume: bool = False) -> str:
    """The sbatch script (a pure function of its arguments: the snapshot test pins it)."""
    s = cfg.cluster.slurm
    script = f"{run_dir}/slurm/{SCRIPT}"
    keys = f"{run_dir}/{KEYS_FILE}"
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# flashrl run {cfg.run.name!r} on SLURM: rendered by `flashrl run CONFIG --launcher slurm` from [cluster.slurm].",
        "# Submit: `flashrl run CONFIG --launcher slurm` (writes the per-run keys, then sbatch), or by hand:",
        f"#   sbatch {script}   (its batch step writes the keys when they are missing)",
        "#",
        f"# {s.nodes} node(s) x {s.gpus_per_node} GPU(s); node N = the N-th host of the allocation "
        f"(scontrol show hostnames); its agent listens on TCP port {s.port} + N (CURVE):",
    ]
    for node in range(p.nodes):
        lines.append(f"#   node {node} (port {s.port + node}): {p.describe(node)}")
    lines += [
        "# Rendezvous: node 0 (the first host) runs the controller; trainer rank 0's node is torch.distributed's",
        "# MASTER_ADDR and the weight-sync master; ports are picked free on that node at start and logged.",
        f"# The run directory {run_dir} must be on a filesystem every node mounts (logs, keys, checkpoints).",
        f"#SBATCH --job-name={s.job_name or 'flashrl-' + cfg.run.name}",
        f"#SBATCH --nodes={s.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    cpus = [f"--cpus-per-task={s.cpus_per_node}"] if s.cpus_per_node else ["--exclusive", "--mem=0"]
    lines += [f"#SBATCH {c}" for c in cpus]
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if s.time:
        lines.append(f"#SBATCH --time={s.time}")
    lines.append(f"#SBATCH --output={run_dir}/slurm/%j.out")
    lines += [f"#SBATCH {x}" for x in s.sbatch]
    srun = ["srun", f"--nodes={s.nodes}", f"--ntasks={s.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
    if s.gpus_per_node:
        srun.append(f"--gpus-per-node={s.gpus_per_node}")
    srun.append(f"--cpus-per-task={s.cpus_per_node}" if s.cpus_per_node else '--cpus-per-task="$SLURM_CPUS_ON_NODE"')
    lines += [
        "",
        f"cd {q(workdir)} || exit 1",
        *(["# cluster.slurm.setup (before `set -u`: module scripts read unset variables)", *s.setup] if s.setup else []),
        "set -euo pipefail",
        f"PY={q(python)}",
        f"CONFIG={q(config_path)}",
        f"export {KEYS_ENV}={q(keys)}  # the per-run CURVE keys: a 0600 file; only its path is here",
        "",
        'if [[ "${1:-}" == "--node" ]]; then',
        "  # inside the srun step: one task per node; SLURM_NODEID picks this node's command",
        '  case "${SLURM_NODEID:?not inside a SLURM step}" in',
    ]
    for node in range(p.nodes):
        again = " --resume" if resume and node == 0 else ""  # the controller continues from the latest checkpoint
        lines.append(f'    {node}) exec "$PY" -m flashrl.cli node "$CONFIG" --node {node}{again} ;;  # {p.describe(node)}')
    lines += [
        '    *) echo "flashrl: node $SLURM_NODEID has no part in this layout" >&2; exit 2 ;;',
        "  esac",
        "fi",
        "",
        "# the batch step, on node 0: the model (built and cached once) and the keys (kept when present)",
        '"$PY" -m flashrl.cli node "$CONFIG" --prepare',
        'echo "flashrl: nodes $(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd" "); '
        'rendezvous (node 0): $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        f"{' '.join(srun)} bash {q(script)} --node",
        "",
    ]
    return "\n".join(lines)


def write_job(cfg: Config, *, workdir: str | None = None, python: str | None = None, resume: bool = False) -> tuple[Path, str]:
    """runs/<name>/slurm/config.toml (the resolved config) and job.sbatch; returns (script path, text).
    LaunchError (nothing written) when the layout cannot fit."""
    from flashrl.config import to_toml

    p = plan(cfg)
    workdir = workdir or os.getcwd()
    run_dir = Path(workdir) / cfg.run_dir if not cfg.run_dir.is_absolute() else cfg.run_dir
    out = run_dir / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(to_toml(cfg))
    text = render_script(cfg, p, config_path=str(out / CONFIG), run_dir=str(run_dir), workdir=workdir,
                         python=python or cfg.cluster.slurm.python or sys.executable, resume=resume)
    path = out / SCRIPT
    path.write_text(text)
    path.chmod(0o755)
    return path, text


def write_keys(cfg: Config) -> CurveKeys:
    """Fresh per-run CURVE keys in runs/<name>/secrets/curve-keys.json (0600, its folder 0700)."""
    return CurveKeys.generate(cfg.run_dir / KEYS_FILE)


def submit(cfg: Config, script: Path) -> str:
    """Write the per-run keys and ``sbatch`` the script; the job id. LaunchError when sbatch is missing or refuses."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise LaunchError("cluster.launcher = \"slurm\": `sbatch` is not on PATH: run this on a SLURM login node, "
                          f"or add --dry-run to only write the script ({script})")
    write_keys(cfg)
    r = subprocess.run([exe, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise LaunchError(f"sbatch {script} failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip().split(";")[0]


# =========================================================================== the node agent
class NodeAgent:
    """`flashrl node` on one node: serves NODE_REQUESTS, starts/stops/reports that node's processes."""

    def __init__(self, cfg: Config, node: int, keys: CurveKeys) -> None:
        self.cfg = cfg
        self.node = node
        self.keys = keys
        self.host = interface_host(cfg.cluster.interface)
        self.port = cfg.cluster.slurm.port + node
        self.children: dict[str, Child] = {}
        self.done = asyncio.Event()
        self.exit_code = 0
        self.shutdown_requested = False
        self.contacted = False
        self.last_contact = 0.0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.visible_gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible else \
            [str(k) for k in range(cfg.cluster.slurm.gpus_per_node)]

    async def handle(self, msg: Msg) -> Msg | None:
        self.contacted = True
        self.last_contact = asyncio.get_running_loop().time()
        if isinstance(msg, NodeHello):
            return NodeInfo(node=self.node, hostname=socket.gethostname(), host=self.host, gpus=len(self.visible_gpus),
                            pid=os.getpid())
        if isinstance(msg, PollProcs):
            return self._states()
        if isinstance(msg, FreePort):
            return PortReply(port=free_port(self.host))
        if isinstance(msg, Spawn):
            return self._spawn(msg)
        if isinstance(msg, KillProc):
            self._child(msg.key).kill()
            return Ok()
        if isinstance(msg, StopProc):
            c = self._child(msg.key)
            code = await c.stop(0.0, term_s=msg.term_s)
            return Reaped(ok=not group_alive(c.pid), code=code)
        if isinstance(msg, ReapProc):
            c = self._child(msg.key)
            ok = await c.reap_group(msg.timeout)
            return Reaped(ok=ok, code=c.returncode)
        if isinstance(msg, StopAll):
            await self.stop_all(msg.term_s)
            return self._states()
        if isinstance(msg, NodeShutdown):
            self.shutdown_requested = True
            await self.stop_all(5.0)
            log.info("node %d: shutdown requested; exiting", self.node)
            asyncio.get_running_loop().call_later(0.2, self.done.set)  # the reply goes out first
            return Ok()
        return Error(message=f"node agent: unexpected {type(msg).__name__}")

    def _child(self, key: str) -> Child:
        try:
            return self.children[key]
        except KeyError:
            raise ValueError(f"node {self.node}: no process {key!r}") from None

    def _spawn(self, msg: Spawn) -> Msg:
        if self.done.is_set():
            return Error(message=f"node {self.node} is shutting down; not starting {msg.name}")
        env = dict(os.environ)
        env.pop(HEAD_ENV, None)
        env.update(msg.env)
        if msg.gpus:
            if max(msg.gpus) >= len(self.visible_gpus):
                return Error(message=f"node {self.node}: {msg.name} wants GPU {max(msg.gpus)}, the node shows "
                                     f"{len(self.visible_gpus)} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_gpus[g] for g in msg.gpus)
        argv = [sys.executable if msg.argv[0] == "python" else msg.argv[0], *msg.argv[1:]]
        child = Child.spawn(msg.name, argv, msg.log_path or None, env=env, cwd=msg.cwd or None)
        self.children[msg.key] = child
        print(f"node {self.node}: started {msg.name} (pid {child.pid})"
              + (f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if msg.gpus else "") + f"; log {msg.log_path}", flush=True)
        return Spawned(pid=child.pid)

    def _states(self) -> ProcStates:
        exited, running = {}, []
        for k, c in self.children.items():
            code = c.returncode
            if code is None:
                running.append(k)
            else:
                exited[k] = code
        return ProcStates(exited=exited, running=running)

    async def stop_all(self, term_s: float) -> None:
        await asyncio.gather(*(c.stop(0.0, term_s=term_s) for c in self.children.values()), return_exceptions=True)

    async def watchdog(self, limit_s: float, first_s: float) -> None:
        """No request from node 0 (heartbeat) or the controller for ``limit_s`` (``first_s`` before the first):
        the run is gone; stop everything and exit 1."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not self.done.is_set():
            await asyncio.sleep(min(1.0, limit_s / 4))
            since = loop.time() - (self.last_contact if self.contacted else start)
            limit = limit_s if self.contacted else first_s
            if since > limit:
                print(f"node {self.node}: nothing heard from node 0 for {since:.0f} s "
                      f"(cluster.slurm.{'heartbeat' if self.contacted else 'connect'}_timeout_s = {limit:g}); "
                      "stopping this node's processes", file=sys.stderr, flush=True)
                self.exit_code = 1
                await self.stop_all(5.0)
                self.done.set()


def _agent_client(host: str, port: int, node: int, keys: CurveKeys) -> RpcClient:
    return RpcClient(tcp_url(host, port), NODE_REPLIES, name=f"node {node} agent ({host}:{port})", curve=keys.client())


def prepare_keys(cfg: Config) -> None:
    """`flashrl node CONFIG --prepare` (the batch step, before srun): the run's keys, written when missing
    (a script submitted by hand); the CLI then builds/caches the model."""
    path = cfg.run_dir / KEYS_FILE
    try:
        CurveKeys.load(path)
        print(f"flashrl: CURVE keys: {path} (kept)", flush=True)
    except KeyFileError:
        write_keys(cfg)
        print(f"flashrl: CURVE keys: {path} (written, 0600)", flush=True)


def node_main(cfg: Config, config_path: Path, node: int | None, resume: bool = False) -> int:
    """`flashrl node CONFIG --node N`: this node's agent; on node 0 also the controller. The exit code."""
    from flashrl.logging_setup import setup_logging

    env_node = os.environ.get("SLURM_NODEID", os.environ.get("SLURM_PROCID"))
    if env_node is None:
        print("flashrl node: SLURM_NODEID is not set: run it inside the job's srun step (job.sbatch --node)",
              file=sys.stderr)
        return 2
    if node is not None and node != int(env_node):
        print(f"flashrl node: --node {node} but SLURM_NODEID = {env_node}: the script's line does not match this "
              "task (was the job submitted with another [cluster.slurm] than the script's?)", file=sys.stderr)
        return 2
    node = int(env_node)
    try:
        p = plan(cfg)
        hosts = node_hosts()
        if len(hosts) < p.nodes:
            raise LaunchError(f"SLURM_JOB_NODELIST has {len(hosts)} host(s), cluster.slurm.nodes = {p.nodes}: "
                              "submit with #SBATCH --nodes matching cluster.slurm.nodes")
        if node >= p.nodes:
            raise LaunchError(f"SLURM_NODEID = {node}, but cluster.slurm.nodes = {p.nodes}")
        keys = CurveKeys.from_env() or CurveKeys.load(cfg.run_dir / KEYS_FILE)
    except (LaunchError, KeyFileError) as e:
        print(f"flashrl node {node}: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run_dir, f"node{node}", cfg.run.log_level)
    try:
        return asyncio.run(_node(cfg, config_path, node, hosts, keys, resume))
    except KeyboardInterrupt:
        return 130


async def _node(cfg: Config, config_path: Path, node: int, hosts: list[str], keys: CurveKeys, resume: bool) -> int:
    s = cfg.cluster.slurm
    agent = NodeAgent(cfg, node, keys)
    server = RpcServer(f"tcp://0.0.0.0:{agent.port}", NODE_REQUESTS, agent.handle, name=f"node{node}-agent",
                       curve=keys.server())
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(server.serve(), name="agent")]
    print(f"node {node} ({socket.gethostname()}): agent on port {agent.port}, sockets on {agent.host}: "
          f"{plan(cfg).describe(node)}", flush=True)
    signalled: list[str] = []

    def _signal(name: str) -> None:
        signalled.append(name)
        if node == 0 or len(signalled) > 1:
            agent.done.set()
            return
        # scancel signals every node at once: node 0 is asking the controller to checkpoint, which may need
        # this node's trainer ranks; keep them until node 0's NodeShutdown, at most SIGNAL_GRACE_S
        print(f"node {node}: {name}: waiting up to {SIGNAL_GRACE_S:.0f} s for node 0 to stop the run "
              "(again to stop now)", file=sys.stderr, flush=True)
        loop.call_later(SIGNAL_GRACE_S, agent.done.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _signal, signal.Signals(sig).name)
    try:
        if node != 0:
            tasks.append(loop.create_task(agent.watchdog(s.heartbeat_timeout_s, s.connect_timeout_s), name="watchdog"))
            await agent.done.wait()
            if signalled and not agent.shutdown_requested:
                print(f"node {node}: {signalled[0]}: stopping this node's processes", file=sys.stderr, flush=True)
                return 128 + signal.Signals[signalled[0]].value
            return agent.exit_code
        return await _head(cfg, config_path, agent, hosts, keys, signalled, resume)
    finally:
        await agent.stop_all(5.0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _head(cfg: Config, config_path: Path, agent: NodeAgent, hosts: list[str], keys: CurveKeys,
                signalled: list[str], resume: bool) -> int:
    """Node 0: every agent up -> the controller -> heartbeats until it exits -> every agent shut down."""
    s = cfg.cluster.slurm
    loop = asyncio.get_running_loop()
    others = {n: _agent_client(hosts[n], s.port + n, n, keys) for n in range(1, s.nodes)}
    controller: Child | None = None
    reached: set[int] = set()
    try:
        deadline = loop.time() + s.connect_timeout_s
        for n, client in others.items():
            while True:
                try:
                    await client.request(NodeHello(), timeout=2.0)
                    reached.add(n)
                    break
                except (TimeoutError, PeerDead, RemoteError) as e:
                    if loop.time() > deadline or agent.done.is_set():
                        print(f"node 0: node {n}'s agent ({hosts[n]}:{s.port + n}) did not answer within "
                              f"cluster.slurm.connect_timeout_s = {s.connect_timeout_s:g} s ({type(e).__name__}); "
                              "is its srun task running (job .out file)? does it read this run's key file (the run directory "
                              "must be on a filesystem every node mounts)?", file=sys.stderr, flush=True)
                        return 1
                    if isinstance(e, PeerDead):  # a dead channel stays dead: dial again
                        await client.close()
                        client = others[n] = _agent_client(hosts[n], s.port + n, n, keys)
        print(f"node 0: {len(others) + 1} node agent(s) up; starting the controller", flush=True)
        env = dict(os.environ)
        env[HEAD_ENV] = "1"
        cmd = [sys.executable, "-m", "flashrl.cli", "run", str(config_path)] + (["--resume"] if resume else [])
        controller = Child.spawn("controller", cmd, None, env=env)
        beat = loop.create_task(_heartbeats(others, s.heartbeat_timeout_s), name="heartbeats")
        exited = loop.create_task(controller.exited(), name="controller")
        stop = loop.create_task(agent.done.wait(), name="signal")
        await asyncio.wait([exited, stop], return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():  # SIGTERM / SIGINT (scancel): the controller checkpoints and stops
            print(f"node 0: {signalled[0] if signalled else 'stop'}: stopping the controller", file=sys.stderr, flush=True)
            await controller.stop(CONTROLLER_STOP_S, shutdown=_sigterm(controller))
        code = await exited
        beat.cancel()
        stop.cancel()
        await asyncio.gather(beat, stop, return_exceptions=True)
        print(f"node 0: controller {exit_text(code)}", flush=True)
        return code if code >= 0 else 128 - code
    finally:
        if controller is not None and controller.alive:
            await controller.stop(0.0)
        await asyncio.gather(agent.stop_all(5.0), *(_shutdown(c, 30.0 if n in reached else 2.0) for n, c in others.items()),
                             return_exceptions=True)  # this node's processes and every other node's at once
        with contextlib.suppress(OSError):
            (cfg.run_dir / KEYS_FILE).unlink()


def _sigterm(child: Child) -> Callable[[], Awaitable[None]]:
    async def send() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)

    return send


async def _heartbeats(agents: dict[int, RpcClient], timeout_s: float) -> None:
    while True:
        await asyncio.sleep(timeout_s / 6)
        for n, c in agents.items():
            try:
                await c.request(NodeHello(), timeout=timeout_s / 3)
            except (TimeoutError, PeerDead, RemoteError) as e:
                log.warning("node %d's agent missed a heartbeat: %s", n, e)


async def _shutdown(client: RpcClient, timeout_s: float) -> None:
    try:
        await client.request(NodeShutdown(), timeout=timeout_s)
    except (TimeoutError, PeerDead, RemoteError) as e:
        log.warning("%s: shutdown not confirmed: %s", client.name, e)
    finally:
        await client.close()


# =========================================================================== the controller's launcher
async def _nothing() -> None:
    """The ladder's escalation for a RemoteProc: StopProc follows it either way."""


class RemoteProc:
    """A process a node agent started (``Proc``); state cached from the launcher's polls."""

    def __init__(self, launcher: SlurmLauncher, node: int, key: str, name: str, log_path: Path | None, pid: int) -> None:
        self.launcher = launcher
        self.node = node
        self.key = key
        self.name = name
        self.log_path = log_path
        self.pid = pid
        self.spawned_at = time.monotonic()
        self._code: int | None = None
        self._why = ""
        self._exit = asyncio.Event()

    @property
    def alive(self) -> bool:
        return self._code is None

    @property
    def returncode(self) -> int | None:
        return self._code

    def _set_exit(self, code: int, why: str = "") -> None:
        if self._code is None:
            self._code, self._why = code, why
            self._exit.set()

    async def exited(self) -> int:
        await self._exit.wait()
        assert self._code is not None
        return self._code

    async def _request(self, msg: Msg, timeout: float) -> Msg:
        return await self.launcher.agent(self.node).request(msg, timeout=timeout)

    async def stop(self, grace_s: float = 10.0, shutdown: Callable[[], Awaitable[Any]] | None = None) -> int | None:
        """Shutdown -> SIGTERM -> SIGKILL (procs.stop_ladder): the orderly part from here; the signals, and
        the reaping of the group (also of a process that exited), by its node's agent."""
        await stop_ladder(self, grace_s, shutdown, _nothing)
        try:  # SIGTERM -> SIGKILL on its node; the reply comes once its process group is empty
            r = await self._request(StopProc(key=self.key, term_s=5.0), timeout=30.0)
            if isinstance(r, Reaped) and r.code is not None:
                self._set_exit(r.code)
        except (TimeoutError, PeerDead, RemoteError) as e:
            log.warning("%s: stop on node %d not confirmed: %s", self.name, self.node, e)
        return self._code

    def kill(self) -> None:
        async def send() -> None:
            with contextlib.suppress(TimeoutError, PeerDead, RemoteError):
                await self._request(KillProc(key=self.key), timeout=10.0)

        self.launcher._background(send())

    async def reap_group(self, timeout: float = 5.0) -> bool:
        try:
            r = await self._request(ReapProc(key=self.key, timeout=timeout), timeout=timeout + 10.0)
        except (TimeoutError, PeerDead, RemoteError) as e:
            log.warning("%s: reap on node %d not confirmed: %s", self.name, self.node, e)
            return False
        assert isinstance(r, Reaped)
        if r.code is not None:
            self._set_exit(r.code)
        return r.ok

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def describe(self, lines: int = 30) -> str:
        where = f"last lines of {self.log_path}" if self.log_path else "its output went to the node's stderr"
        host = self.launcher.hosts[self.node] if self.node < len(self.launcher.hosts) else "?"
        return (f"{self.name} {exit_text(self._code)} (node {self.node} {host}, pid {self.pid}){self._why}; "
                f"{where}:\n{self.log_tail(lines)}")


class SlurmLauncher:
    """The controller's side, inside the allocation (node 0): every process through the agent of its node."""

    name = "slurm"

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.curve: CurveKeys | None = None
        self.plan: Plan | None = None
        self.hosts: list[str] = []
        self._agents: dict[int, RpcClient] = {}
        self._info: dict[int, NodeInfo] = {}
        self._procs: list[RemoteProc] = []
        self._starts = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    def preflight(self) -> None:
        if not os.environ.get(HEAD_ENV):
            raise LaunchError("cluster.launcher = \"slurm\": this process is not the controller of a flashrl SLURM job. "
                              "`flashrl run CONFIG --launcher slurm` submits one (--dry-run: only write the script); "
                              "inside it, node 0's `flashrl node` starts the controller")
        self.plan = plan(self.cfg)
        self.hosts = node_hosts()
        if len(self.hosts) < self.plan.nodes:
            raise LaunchError(f"SLURM_JOB_NODELIST has {len(self.hosts)} host(s), cluster.slurm.nodes = {self.plan.nodes}")
        try:
            self.curve = CurveKeys.from_env() or CurveKeys.load(self.run_dir / KEYS_FILE)
        except KeyFileError as e:
            raise LaunchError(str(e)) from None

    async def start(self) -> None:
        assert self.plan is not None and self.curve is not None, "preflight() first"
        port = self.cfg.cluster.slurm.port
        for n in range(self.plan.nodes):
            client = _agent_client(self.hosts[n], port + n, n, self.curve)
            try:
                info = await client.request(NodeHello(), timeout=30.0)
            except (TimeoutError, PeerDead, RemoteError) as e:
                await client.close()
                raise LaunchError(f"node {n}'s agent ({self.hosts[n]}:{port + n}) does not answer: {e}") from None
            assert isinstance(info, NodeInfo)
            if info.node != n:
                raise LaunchError(f"{self.hosts[n]}:{port + n} answers as node {info.node}, expected node {n}")
            self._agents[n], self._info[n] = client, info
            log.info("slurm: node %d %s (%s): agent pid %d, sockets on %s, %d GPU(s)", n, self.hosts[n], info.hostname,
                     info.pid, info.host, info.gpus)
        self._poller = asyncio.get_running_loop().create_task(self._poll(), name="slurm-poll")

    def agent(self, node: int) -> RpcClient:
        try:
            return self._agents[node]
        except KeyError:
            raise PeerDead(f"slurm launcher: no channel to node {node}'s agent (closed)") from None

    def child_env(self) -> dict[str, str]:
        return self.curve.env() if self.curve is not None and self.curve.path is not None else {}

    def _background(self, coro: Awaitable[None]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _port(self, node: int) -> int:
        r = await self.agent(node).request(FreePort(), timeout=30.0)
        assert isinstance(r, PortReply)
        return r.port

    async def endpoint(self, role: Role, index: int) -> Endpoint:
        assert self.plan is not None
        node = self.plan.node_of(role, index)
        host = self._info[node].host
        url = tcp_url(host, await self._port(node))
        return Endpoint(bind=url, connect=url, host=host)

    async def spawn(self, role: Role, index: int, argv: list[str], env: dict[str, str], log_path: Path | None) -> Proc:
        assert self.plan is not None
        if self._closed:
            raise LaunchError(f"cluster: the slurm launcher is closed; cannot start {proc_name(role, index)}")
        place = self.plan.place(role, index)
        full = dict(env)
        if role == "trainer":  # torchrun's per-node variables for this rank's node
            full.update(LOCAL_RANK=str(place.local_rank), LOCAL_WORLD_SIZE=str(place.local_world),
                        GROUP_RANK=str(place.group_rank))
        full.update(self.child_env())
        self._starts += 1
        key = f"{role}{index}.{self._starts}"
        name = proc_name(role, index)
        path = Path.cwd() / log_path if log_path is not None else None  # agents on other nodes: same path, shared FS
        r = await self.agent(place.node).request(
            Spawn(key=key, name=name, argv=list(argv), env=full, gpus=list(place.gpus),
                  log_path=str(path) if path else "", cwd=os.getcwd()), timeout=60.0)
        assert isinstance(r, Spawned)
        proc = RemoteProc(self, place.node, key, name, path, r.pid)
        self._procs = [p for p in self._procs if p.alive]
        self._procs.append(proc)
        log.info("slurm: %s on node %d (%s), pid %d", name, place.node, self.hosts[place.node], r.pid)
        return proc

    def trainer_master(self) -> str:
        assert self.plan is not None
        return self._info[self.plan.node_of("trainer", 0)].host

    async def trainer_port(self) -> int:
        assert self.plan is not None
        return await self._port(self.plan.node_of("trainer", 0))

    async def _poll(self) -> None:
        """Every POLL_S: which processes exited, per node; an agent silent for heartbeat_timeout_s takes its
        processes with it (they die with it, or are unreachable: the same to the run)."""
        loop = asyncio.get_running_loop()
        limit = self.cfg.cluster.slurm.heartbeat_timeout_s
        last_ok = {n: loop.time() for n in self._agents}
        while True:
            await asyncio.sleep(POLL_S)
            for n, client in list(self._agents.items()):
                mine = [p for p in self._procs if p.node == n and p.alive]
                try:
                    r = await client.request(PollProcs(), timeout=max(POLL_S * 4, 2.0))
                except (TimeoutError, PeerDead, RemoteError) as e:
                    if loop.time() - last_ok[n] > limit:
                        for p in mine:
                            p._set_exit(-signal.SIGKILL, f"; node {n}'s agent unreachable for {limit:g} s ({e})")
                    continue
                last_ok[n] = loop.time()
                assert isinstance(r, ProcStates)
                for p in mine:
                    if p.key in r.exited:
                        p._set_exit(r.exited[p.key])
                    elif p.key not in r.running:
                        p._set_exit(-signal.SIGKILL, f"; node {n}'s agent no longer knows it")

    async def close(self) -> None:
        """Stop everything started through this launcher on every node (the agents stay up: node 0 shuts them
        down when the controller exits, and run.auto_resume may start again)."""
        self._closed = True

        async def stop_node(n: int, client: RpcClient) -> None:
            try:
                r = await client.request(StopAll(term_s=5.0), timeout=60.0)
            except (TimeoutError, PeerDead, RemoteError) as e:
                log.warning("node %d: StopAll not confirmed: %s", n, e)
                return
            assert isinstance(r, ProcStates)
            for p in self._procs:
                if p.node == n and p.key in r.exited:
                    p._set_exit(r.exited[p.key])

        await asyncio.gather(*(stop_node(n, c) for n, c in self._agents.items()))
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self._agents.values():
            await c.close()
        self._agents.clear()

    def leftovers(self) -> dict[str, int]:
        return {"processes": sum(1 for p in self._procs if p.alive)}
