"""`flashrl node`: the agent of one node of a SLURM job (slurm.py has the whole design).

Every node: a NodeAgent on tcp://0.0.0.0:<port + N>, CURVE (only the run's client key) starts, stops
and reports the node's processes (procs.Child each). Node 0 also waits until every agent answers,
starts the controller (`flashrl run CONFIG`, a procs.Child), heartbeats the other agents, and when the
controller exits shuts every agent down and exits with the controller's code. An agent that hears
nothing from node 0 for cluster.slurm.heartbeat_timeout_s stops its processes and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from flashrl.launch.base import LaunchError, interface_host
from flashrl.launch.local import KEYS_FILE
from flashrl.launch.slurm_job import HEAD_ENV, agent_client, node_hosts, plan
from flashrl.procs import Child, exit_text, group_alive
from flashrl.wire.keys import CurveKeys, KeyFileError
from flashrl.wire.protocol import (
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

SIGNAL_GRACE_S = 45.0  # another node, SIGTERM (scancel): how long it waits for node 0's NodeShutdown
CONTROLLER_STOP_S = 60.0  # node 0, SIGTERM: the controller's grace to checkpoint and stop (driver.STOP_GRACE_S + shutdown)


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
    others = {n: agent_client(hosts[n], s.port + n, n, keys) for n in range(1, s.nodes)}
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
                        client = others[n] = agent_client(hosts[n], s.port + n, n, keys)
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
