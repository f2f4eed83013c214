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
    controller (node 0): launch.processes.local_cluster with SlurmLauncher: endpoint/spawn/trainer_port are
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

Modules: slurm_job.py (host lists, layout, script, submission, keys: the login node and batch step),
slurm_node.py (`flashrl node`: the agent of each node, node 0's supervision of the controller), this
one (the controller's launcher: SlurmLauncher and RemoteProc).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashrl.launch.base import CachedExit, Endpoint, LaunchError, Proc, Role, proc_name, tcp_url
from flashrl.launch.local import KEYS_FILE
from flashrl.launch.slurm_job import HEAD_ENV, Plan, agent_client, node_hosts, plan
from flashrl.procs import exit_text, stop_ladder, tail
from flashrl.wire.keys import CurveKeys, KeyFileError
from flashrl.wire.protocol import (
    FreePort,
    KillProc,
    Msg,
    NodeHello,
    NodeInfo,
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
from flashrl.wire.transport import PeerDead, RemoteError, RpcClient

if TYPE_CHECKING:
    from flashrl.config import Config

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the launcher asks each agent which processes exited


# =========================================================================== the controller's launcher
async def _nothing() -> None:
    """The ladder's escalation for a RemoteProc: StopProc follows it either way."""


class RemoteProc(CachedExit):
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
        self.error: LaunchError | None = None  # the poller's crash, once it happened (``watch`` raises it)
        self._poller_ended = asyncio.Event()

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
        """Reach every node's agent, start the poller; a second call (the driver starts it early for a judge) is a no-op."""
        assert self.plan is not None and self.curve is not None, "preflight() first"
        if self._poller is not None:
            return
        port = self.cfg.cluster.slurm.port
        for n in range(self.plan.nodes):
            client = agent_client(self.hosts[n], port + n, n, self.curve)
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
        self._start_poller()

    def _start_poller(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll(), name="slurm-poll")
        self._poller.add_done_callback(self._poller_done)

    def _poller_done(self, t: asyncio.Task[None]) -> None:
        """The poller ended: on close (cancelled), or by a crash, which is loud at once: logged, kept in
        ``error`` (raised by ``watch``, ``spawn``, ``endpoint`` and ``close``): without the poller no
        process exit is seen any more."""
        self._poller_ended.set()
        if t.cancelled():
            return
        e = t.exception()
        why = f"{type(e).__name__}: {e}" if e is not None else "it returned"
        self.error = LaunchError(f"slurm launcher: the process poller died ({why}); the exits of the run's "
                                 "processes can no longer be seen, so the run stops")
        self.error.__cause__ = e
        log.error("%s", self.error, exc_info=e)

    async def watch(self) -> None:
        """Returns when the launcher closes; raises its ``error`` at once when the poller dies (processes.
        local_cluster runs it beside the engine watchers: the run ends with that LaunchError)."""
        await self._poller_ended.wait()
        if self.error is not None:
            raise self.error

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
        if self.error is not None:
            raise self.error
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
        if self.error is not None:
            raise self.error
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
            await asyncio.gather(self._poller, return_exceptions=True)  # a crash was seen at once: ``error``
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self._agents.values():
            await c.close()
        self._agents.clear()
        self._poller_ended.set()  # watch() returns (a launcher closed before its poller started)
        if self.error is not None:
            raise self.error  # everything is stopped; the crash is not swallowed here either

    def leftovers(self) -> dict[str, int]:
        return {"processes": sum(1 for p in self._procs if p.alive)}
