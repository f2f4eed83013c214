"""The SLURM job, as the login node and the batch step see it: host lists, the layout (which node runs
what), the sbatch script, its submission and the run's keys. slurm.py has the whole design.

    plan(cfg)                  [cluster.slurm] layout (or auto) -> Plan; LaunchError before anything
    write_job(cfg)             runs/<name>/slurm/config.toml + job.sbatch (+ keys); submit(cfg, script)
    prepare_keys(cfg)          the batch step: the run's CURVE keys, written when missing
    agent_client(host, ...)    how node 0 and the controller reach a node's agent (only the run's key)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flashrl.launch.base import LaunchError, Role, proc_name, served_engines, tcp_url
from flashrl.launch.local import KEYS_FILE
from flashrl.wire.keys import KEYS_ENV, CurveKeys, KeyFileError
from flashrl.wire.protocol import (
    NODE_REPLIES,
)
from flashrl.wire.transport import RpcClient

if TYPE_CHECKING:
    from flashrl.config import Config

log = logging.getLogger(__name__)

HEAD_ENV = "FLASHRL_SLURM_HEAD"  # set by node 0's agent on the controller it starts: "inside the allocation"
SCRIPT = "job.sbatch"
CONFIG = "config.toml"


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
    judges: list[list[int]] = field(default_factory=list)  # per node (judge engines; none without judge.model)
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
        judges = self.judges[node] if self.judges else []
        for what, role, items in (("trainer rank", "trainer", self.ranks[node]), ("engine", "engine", self.engines[node]),
                                  ("judge engine", "judge", judges)):
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


Lists = tuple[list[list[int]], list[list[int]], list[list[int]]]  # per node: engines, trainer ranks, judge engines


def plan(cfg: Config) -> Plan:
    """The layout of ``cfg`` on its allocation; LaunchError naming the keys and the numbers when it cannot fit."""
    s = cfg.cluster.slurm
    _check_devices(cfg)
    if s.layout:
        per_engines, per_ranks, per_judges = _given_layout(cfg)
    elif s.gpus_per_node > 0:
        per_engines, per_ranks, per_judges = _packed_gpus(cfg)
    else:
        per_engines, per_ranks, per_judges = _spread_cpus(cfg)
    return _placed(Plan(s.nodes, s.gpus_per_node, per_engines, per_ranks, per_judges))


def _check_devices(cfg: Config) -> None:
    s = cfg.cluster.slurm
    n, gpn = s.nodes, s.gpus_per_node
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


def _given_layout(cfg: Config) -> Lists:
    """The user's [[cluster.slurm.layout]] tables, checked: each process placed once, no node over its GPUs."""
    s = cfg.cluster.slurm
    n, gpn = s.nodes, s.gpus_per_node
    per_engines = [sorted(x.engines) for x in s.layout]
    per_ranks = [sorted(x.trainer_ranks) for x in s.layout]
    per_judges = [sorted(x.judges) for x in s.layout]
    if len(s.layout) != n:
        raise LaunchError(f"cluster.slurm.layout has {len(s.layout)} node table(s) but cluster.slurm.nodes = {n}: "
                          "give one [[cluster.slurm.layout]] per node (node 0 first), or none for the automatic layout")
    judges = served_engines(cfg)
    for what, key, count, per in (("engine", "engines", cfg.engine.count, per_engines),
                                  ("trainer rank", "trainer_ranks", cfg.trainer.ranks, per_ranks),
                                  ("judge engine", "judges", judges, per_judges)):
        _check_placed_once(what, key, count, per, judges)
    for node in range(n):
        need = len(per_engines[node]) + len(per_ranks[node]) + len(per_judges[node])
        if gpn and need > gpn:
            judged = f" + {len(per_judges[node])} judge engine(s)" if per_judges[node] else ""
            raise LaunchError(f"cluster.slurm.layout[{node}]: {len(per_engines[node])} engine(s) + "
                              f"{len(per_ranks[node])} trainer rank(s){judged} need {need} GPUs (one each), but "
                              f"cluster.slurm.gpus_per_node = {gpn}")
        if node > 0 and need == 0:
            raise LaunchError(f"cluster.slurm.layout[{node}] runs nothing: remove the node (cluster.slurm.nodes = "
                              f"{n - 1}) or place engines, trainer ranks or judge engines on it")
    return per_engines, per_ranks, per_judges


def _check_placed_once(what: str, key: str, count: int, per: list[list[int]], judges: int) -> None:
    seen: dict[int, int] = {}
    cfg_key = {"engines": "engine.count", "trainer_ranks": "trainer.ranks", "judges": "judge.engines"}[key]
    for node, items in enumerate(per):
        for i in items:
            if key == "judges" and not judges:
                raise LaunchError(f"cluster.slurm.layout[{node}].judges places judge engine {i}, but judge.model "
                                  "is empty (no judge): remove the judges lists or set judge.model")
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


def _packed_gpus(cfg: Config) -> Lists:
    """GPU nodes without layout tables: trainer ranks first (packed from node 0), then engines, then judge engines."""
    s = cfg.cluster.slurm
    n, gpn = s.nodes, s.gpus_per_node
    engines, ranks, judges = cfg.engine.count, cfg.trainer.ranks, served_engines(cfg)
    need = ranks + engines + judges
    what = f"trainer.ranks = {ranks} + engine.count = {engines}" + (f" + judge.engines = {judges}" if judges else "")
    if need > n * gpn:
        more = -(-need // gpn)
        raise LaunchError(f"cluster.slurm: {what} need {need} GPUs "
                          f"(one each), but cluster.slurm.nodes = {n} x cluster.slurm.gpus_per_node = {gpn} "
                          f"gives {n * gpn}: set cluster.slurm.nodes = {more}, or fewer engines/ranks")
    used = -(-need // gpn)
    if used < n:
        raise LaunchError(f"cluster.slurm.nodes = {n}, but {what} "
                          f"fill only {used} node(s) of {gpn} GPUs: set cluster.slurm.nodes = {used}, or give "
                          "[[cluster.slurm.layout]] tables")
    per_ranks: list[list[int]] = [[] for _ in range(n)]
    per_engines: list[list[int]] = [[] for _ in range(n)]
    per_judges: list[list[int]] = [[] for _ in range(n)]
    for slot in range(need):
        node = slot // gpn
        if slot < ranks:
            per_ranks[node].append(slot)
        elif slot < ranks + engines:
            per_engines[node].append(slot - ranks)
        else:
            per_judges[node].append(slot - ranks - engines)
    return per_engines, per_ranks, per_judges


def _spread_cpus(cfg: Config) -> Lists:
    """CPU nodes: the trainer next to the controller, engines (then judge engines) spread over the other nodes."""
    n, engines, judges = cfg.cluster.slurm.nodes, cfg.engine.count, served_engines(cfg)
    if n > 1 and engines < n - 1:
        raise LaunchError(f"cluster.slurm.nodes = {n}, but engine.count = {engines} engine(s) fill only "
                          f"{engines} node(s) besides node 0 (the controller and trainer): set "
                          f"cluster.slurm.nodes = {engines + 1}, or give [[cluster.slurm.layout]] tables")
    per_ranks = [list(range(cfg.trainer.ranks))] + [[] for _ in range(n - 1)]
    per_engines: list[list[int]] = [[] for _ in range(n)]
    per_judges: list[list[int]] = [[] for _ in range(n)]
    for i in range(engines):
        per_engines[0 if n == 1 else 1 + i % (n - 1)].append(i)
    for j in range(judges):  # round-robin on from where the engines stopped
        per_judges[0 if n == 1 else 1 + (engines + j) % (n - 1)].append(j)
    return per_engines, per_ranks, per_judges


def _placed(p: Plan) -> Plan:
    """Each process's node and GPUs: on a node, trainer ranks take the first GPUs, then engines, then judges."""
    n, gpn, per_ranks = p.nodes, p.gpus_per_node, p.ranks
    trainer_nodes = [node for node in range(n) if per_ranks[node]]
    for node in range(n):
        gpus = iter(range(gpn))
        rank_gpus = tuple(next(gpus) for _ in per_ranks[node]) if gpn else ()
        for local, r in enumerate(per_ranks[node]):
            p.places[("trainer", r)] = Place(node, rank_gpus, local, len(per_ranks[node]), trainer_nodes.index(node))
        for i in p.engines[node]:
            p.places[("engine", i)] = Place(node, (next(gpus),) if gpn else ())
        for j in p.judges[node]:
            p.places[("judge", j)] = Place(node, (next(gpus),) if gpn else ())
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


def agent_client(host: str, port: int, node: int, keys: CurveKeys) -> RpcClient:
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
