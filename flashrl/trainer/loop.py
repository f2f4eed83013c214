"""A trainer rank's command loop: one loop per rank runs the controller's commands, one at a time, in order.

    controller --TrainerRequest (ZeroMQ)--> rank 0 RPC shell (``serve``: asyncio, main thread)
                                              | Ping: Pong(version) at once, never queued
                                              | DropWeightPeer: to the weight sender at once, never queued
                                              | anything else: into the inbox, in arrival order
                                              v
    rank 0 loop thread (CommandLoop.run): waits on the inbox; idle KEEPALIVE_S -> broadcasts a Ping
        SendWeights, InitWeightSync -----> the weight sender (trainer/sender.py) --+
        FinishCheckpoint ----------------> the checkpoint writer's seal (ckpt_writer.py) --+--> reply when done;
        anything else: broadcast (msgspec bytes in a uint8 tensor) --> ranks 1..R-1        |    the loop goes on
                       Trainer.execute(cmd) <-- same collectives, same order --> Trainer.execute(cmd)
                                              |                                      (their loops: receive,
    controller <--TrainerReply-- rank 0 <-----+--------------------------------------------+   run, repeat)

What it waits on: rank 0's loop on its inbox (at most KEEPALIVE_S, then the keepalive broadcast) and
on the command it runs; ranks 1.. on rank 0's broadcast, polled (async_op + short sleeps) so SIGTERM is
seen at once. Every rank runs the same commands through ``Trainer.execute`` in the same order, so
the collectives inside (FSDP all-gathers, metric reductions, state-dict gathers, DCP saves) line up by
construction. The commands handed off (only rank 0 acts on them) complete on the sender's or the
writer's threads; their order is the loop's (a send's claim, a prepare's check are made in the loop).

Failures: a command's error is that command's Error reply (rank 0; the others log it: they hit the
same deterministic error). The loop itself ending before a stop (the keepalive's broadcast failed) or
the RPC server ending is a crash at once: ``serve`` raises TaskDied naming it and rank 0 exits (code 1).
Shutdown (a Shutdown command, or SIGTERM) is close -> cancel -> wait: the inbox closes (new commands
get a "shutting down" Error), the RPC server is cancelled, then the loop thread is waited for, with
a deadline, unless a command is still running (its collective's peers may be gone): then rank 0
exits without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flashrl.aio import TaskDied, until_stopped
from flashrl.wire import protocol
from flashrl.wire.protocol import DropWeightPeer, Error, Msg, Ping, Pong, Shutdown

log = logging.getLogger("flashrl.trainer")

KEEPALIVE_S = 60.0  # idle broadcast period; far below the process group's 30 min default timeout
WAIT_LOOP_S = 30.0  # shutdown: how long the loop thread may take to end once closed (idle: at once)


class Fanout:
    """Rank 0 sends each command to every rank as msgspec bytes in a uint8 tensor (never pickle)."""

    def __init__(self, device: torch.device, stop: list[bool]) -> None:
        self.device = device
        self._stop = stop  # set by the SIGTERM handler; checked while polling

    def send(self, msg: Msg) -> None:
        payload = protocol.encode(msg)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.device), 0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), 0)

    def recv(self) -> Msg | None:
        """The next command, or None when SIGTERM arrived while waiting."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        work = dist.broadcast(n, 0, async_op=True)
        delay = 0.001
        while not work.is_completed():
            if self._stop[0]:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)  # idle ranks wake at most 20 times a second
        work.wait()
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, 0)
        return protocol.TRAINER_REQUESTS.decode(bytes(buf.cpu().numpy()))


class Rank(Protocol):
    """What the loop needs of a rank (trainer/worker.py Trainer; a fake in the tests)."""

    rank: int
    world: int
    version: int

    def execute(self, msg: Msg) -> Msg | None: ...

    def beside(self, msg: Msg) -> Future[Any] | None: ...

    def drop_weight_peer(self, peer: str) -> Msg: ...


class Sends(Protocol):
    def send(self, msg: Msg) -> None: ...

    def recv(self) -> Msg | None: ...


class CommandLoop:
    """One rank's loop. Rank 0: ``submit`` (any thread) queues a command and returns its reply's future;
    ``run`` (the loop thread) runs them in order until Shutdown or ``close``. Ranks 1..: ``run`` runs
    what rank 0 broadcasts until Shutdown or SIGTERM."""

    def __init__(self, trainer: Rank, fanout: Sends, keepalive_s: float | None = None) -> None:
        self.trainer, self.fanout = trainer, fanout
        self.keepalive_s = KEEPALIVE_S if keepalive_s is None else keepalive_s
        self._inbox: queue.SimpleQueue[tuple[Msg, Future[Any]] | None] = queue.SimpleQueue()
        self.closed = False
        self._closing = threading.Lock()  # closed and the inbox change together: no command put after the drain
        self.running: Msg | None = None  # the command being run (shutdown does not wait for one)

    def submit(self, msg: Msg) -> Future[Any]:
        reply: Future[Any] = Future()
        with self._closing:
            if not self.closed:
                self._inbox.put((msg, reply))
                return reply
        reply.set_exception(RuntimeError("trainer is shutting down"))
        return reply

    def close(self) -> None:
        """No new commands; ``run`` returns once the one running (if any) ends."""
        with self._closing:
            self.closed = True
            self._inbox.put(None)

    def run(self) -> None:
        while True:
            msg, reply = self._next()
            if msg is None:
                break
            if reply is not None and not reply.set_running_or_notify_cancel():
                continue  # its caller is gone (a shutdown cancelled it) before it began: never fanned out
            self.running = msg
            try:
                self._run_one(msg, reply)
            finally:
                self.running = None
            if isinstance(msg, Shutdown):
                break
        with self._closing:
            self.closed = True
        while True:  # commands that came after the end: refused, not left hanging
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError("trainer is shutting down"))

    def _next(self) -> tuple[Msg | None, Future[Any] | None]:
        if self.trainer.rank != 0:
            return self.fanout.recv(), None
        while True:
            try:
                item = self._inbox.get(timeout=self.keepalive_s)
            except queue.Empty:
                if self.trainer.world > 1:
                    # keeps the other ranks' pending receive under the process-group timeout during a
                    # long rollout phase; its error ends the loop (the others would time out later)
                    self.fanout.send(Ping())
                continue
            return (None, None) if item is None else item

    def _run_one(self, msg: Msg, reply: Future[Any] | None) -> None:
        if reply is None:  # ranks 1..
            try:
                self.trainer.execute(msg)
            except Exception:
                # Rank 0 hit the same deterministic error (same input) and answers it; keep in step.
                log.exception("%s failed", type(msg).__name__)
            return
        try:
            handed = self.trainer.beside(msg)  # also refuses a PrepareWeights during a publication
            if handed is not None:
                _chain(handed, reply)
                return
            if self.trainer.world > 1:  # alone: nobody to fan out to
                self.fanout.send(msg)
            reply.set_result(self.trainer.execute(msg))
        except Exception as e:  # noqa: BLE001 - this command's error reply
            reply.set_exception(e)


def _chain(src: Future[Any], dst: Future[Any]) -> None:
    def done(f: Future[Any]) -> None:
        if f.cancelled():
            dst.set_exception(RuntimeError("trainer is shutting down"))
        elif (e := f.exception()) is not None:
            dst.set_exception(e)
        else:
            dst.set_result(f.result())

    src.add_done_callback(done)


class Server(Protocol):
    async def serve(self) -> None: ...


async def serve(commands: CommandLoop, make_server: Callable[[Callable[[Msg], Any]], Server],
                busy: Callable[[], bool] = lambda: False, wait_s: float = WAIT_LOOP_S,
                stop: asyncio.Event | None = None, address: str = "") -> bool:
    """Rank 0: the RPC shell around ``commands`` (run on a thread of its own) until Shutdown or SIGTERM
    (which sets ``stop``; a test sets it itself).

    Returns whether the loop thread ended (False: a command was still running, or ``busy()``, e.g.
    a weight send, at SIGTERM: the caller exits without waiting for it). Raises TaskDied at once
    when the loop or the server ends before a stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event() if stop is None else stop
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    ended: Future[None] = Future()
    ended.set_running_or_notify_cancel()  # its watcher's cancel must not cancel it

    def run_loop() -> None:
        try:
            commands.run()
        except BaseException as e:  # noqa: BLE001 - delivered to the watching task
            ended.set_exception(e)
        else:
            ended.set_result(None)

    async def watch_loop() -> None:
        await asyncio.wrap_future(ended)
        stop.set()  # the loop returns only after Shutdown or close: either way a stop

    async def handle(msg: Msg) -> Msg | None:
        if isinstance(msg, Ping):
            return Pong(version=commands.trainer.version)
        if isinstance(msg, DropWeightPeer):  # at once: a send in the queue's way may be waiting on that peer
            return commands.trainer.drop_weight_peer(msg.peer)
        if stop.is_set() or commands.closed:
            return Error(message="trainer is shutting down", kind="shutdown")
        return await asyncio.wrap_future(commands.submit(msg))

    threading.Thread(target=run_loop, name="trainer-loop", daemon=True).start()
    server = make_server(handle)
    tasks = [loop.create_task(server.serve(), name="trainer-rpc"), loop.create_task(watch_loop(), name="trainer-loop")]
    log.info("rank 0 serving %s (world %d)", address or "(in process)", commands.trainer.world)
    try:
        await until_stopped(stop, tasks)
    except TaskDied:
        commands.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the one that died is the TaskDied's cause
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    # close: no new commands (the handler refuses them), then let the last reply (Shutdown's Ok) leave
    commands.close()
    await asyncio.sleep(0.2)
    # cancel: the RPC server
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    # wait: the loop thread, unless it sits in a command whose peers may be gone
    if commands.running is not None or busy():
        log.warning("SIGTERM during a command (%s): exiting without waiting for it",
                    type(commands.running).__name__ if commands.running is not None else "a weight send")
        return False
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(ended)), wait_s)
    except TimeoutError:
        log.warning("the command loop did not end within %.0f s of the stop: exiting without it", wait_s)
        return False
    return True
