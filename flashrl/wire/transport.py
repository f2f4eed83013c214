"""ZeroMQ request/reply channels carrying msgspec messages (protocol.py). No pickle.

    RpcClient (DEALER, controller side)            RpcServer (ROUTER, engine / trainer rank 0)
      request(msg) -> rid, future  ---- frame --->   recv loop -> decode -> one task per request
      recv loop: reply.rid -> future  <--- frame ---   handler(msg) -> reply (same rid)
      heartbeat loop: Ping every interval; no Pong within timeout -> peer dead, all futures fail

Coalescing: what one event-loop tick sends to one peer goes as one frame (protocol.encode_batch: a
msgpack array of the messages, each encoded on its own). request() queues its encoded message and the
first request of a tick schedules the flush (loop.call_soon), so a group's 16 Generate requests started
together, or an eval's 400, cross as one ZeroMQ message; the server answers the same way, one frame per
peer for the replies finished in one tick. Nothing else changes: every item keeps its rid, its own
task on the server, its own future, error, timeout and cancellation. Per message, one ZeroMQ send and receive (and their futures and poller wake-ups)
are what coalescing saves; on a 2-core machine they were most of the engine server's own CPU time.

Two error tiers (as in vLLM's engine client): a per-request ``Error`` reply becomes ``RemoteError``
for that request only; a dead or untrusted peer becomes ``PeerDead`` for every pending and later
request. A malformed frame is logged and its sender is not trusted further.

Sockets bind to loopback unless the address names another host; then CURVE keys are required
(``check_address``: refused before binding or connecting). A CURVE server (``curve`` with
"client_public", as wire.keys.CurveKeys.server() gives) runs a ZAP handler in its context that accepts
only that client key; a socket monitor counts every refused handshake (no keys, wrong server key,
unknown client key): ``RpcServer.refused``, ``refused_total()``, and a ``transport/refused`` log line.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import logging
import os
import random
import shutil
import socket
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import zmq
import zmq.asyncio

from flashrl.wire.protocol import Codec, Error, Msg, Ping, Pong, ProtocolError, encode, encode_batch

log = logging.getLogger(__name__)


class TransportError(Exception):
    """Base of transport failures."""


class PeerDead(TransportError):
    """The peer stopped answering, closed, or sent a malformed frame; nothing more is sent to it."""


class RemoteError(TransportError):
    """The peer answered this one request with an Error; the peer itself is still healthy."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


_IPC_DIR: str | None = None


def local_address(name: str) -> str:
    """A fresh ``ipc://`` address for a socket between processes of this machine.

    Unix-domain paths in a private directory cannot collide with another process's port, unlike a TCP
    port picked by ``free_port`` and bound later by a child (another program may take it in between).
    """
    global _IPC_DIR
    if _IPC_DIR is None or not os.path.isdir(_IPC_DIR):
        _IPC_DIR = tempfile.mkdtemp(prefix="flashrl-ipc-")
        atexit.register(shutil.rmtree, _IPC_DIR, True)
    return f"ipc://{_IPC_DIR}/{name}-{uuid.uuid4().hex[:12]}"


_GIVEN: set[tuple[str, int]] = set()  # ports free_port handed out in this process (a child may not have bound one yet)
_PICKS = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive): where a port-0 bind and every outgoing connection's source
    port come from."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``, for a child to bind a moment later (the parent picks, the child binds).

    Picked outside the kernel's ephemeral range when there is room (20000 up to it, or above it): a port from that
    range can be taken in between by any outgoing connection or port-0 bind on the machine (vLLM's, Ray's, gloo's
    own; seen in a test suite: an engine's start failed with "Address already in use"). Random, never the same port
    twice in one process; a port of the ephemeral range (the kernel's pick) only when no other is free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo, hi = ephemeral_range()
    spans = [(20000, lo - 1), (hi + 1, 65535)]
    ports = [p for a, b in spans if b - a >= 1000 for p in range(a, b + 1)]
    rng = random.SystemRandom()
    for port in rng.sample(ports, min(_PICKS, len(ports))):
        if (host, port) in _GIVEN:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add((host, port))
        return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _GIVEN.add((host, port))
    return port


def is_loopback(host: str) -> bool:
    """``host`` (a name or an IP literal) stays on this machine: "localhost" or a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(address: str, curve_keys: bool) -> None:
    """Refuse a non-loopback TCP address without CURVE keys (docs/design.md, "Boundaries")."""
    url = urllib.parse.urlparse(address)
    if url.scheme != "tcp":
        return
    if not is_loopback(url.hostname or "") and not curve_keys:
        raise TransportError(
            f"address {address!r} is not loopback: set transport CURVE keys "
            "(zmq.curve_keypair()) or bind to 127.0.0.1"
        )


RECONNECT_MS = 20


def _no_hwm(sock: zmq.Socket) -> None:
    """No high-water mark: a ROUTER silently DROPS replies to a peer whose queue is full (1000 messages by
    default), e.g. while the controller's loop is busy and thousands of replies arrive; the request would
    then wait for a reply that never comes. Queues are bounded by the requests in flight instead."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _apply_curve(sock: zmq.Socket, curve: dict[str, bytes] | None, server: bool) -> None:
    if not curve:
        return
    if server and "client_public" in curve:  # before bind: no connection is ever let in unchecked
        _allow_client(sock.context, curve["client_public"])
    if server:
        sock.curve_secretkey = curve["secret"]
        sock.curve_publickey = curve["public"]
        sock.curve_server = True
    else:
        sock.curve_secretkey = curve["secret"]
        sock.curve_publickey = curve["public"]
        sock.curve_serverkey = curve["server_public"]


def _socket(ctx: zmq.asyncio.Context, kind: int, curve: dict[str, bytes] | None, *, server: bool) -> zmq.asyncio.Socket:
    """A client (DEALER) or server (ROUTER) socket as both ends need it: no linger, no high-water mark,
    CURVE when given (set before connect/bind)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if not server:
        # A client connecting before its server binds (every start-up: a process is spawned, then asked
        # for Ping) retries every RECONNECT_IVL, 100 ms by default: that was the lag between an engine
        # being up and the controller's first request. 20 ms costs a few failed connects a second.
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
    _no_hwm(sock)
    _apply_curve(sock, curve, server=server)
    return sock


# --------------------------------------------------------------------------- CURVE gate (ZAP)
class _AllowedKeys:
    """zmq.auth credentials provider: only the run's client public key(s) (Z85) get in."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


# one ZAP handler per (context, event loop): ZeroMQ routes every CURVE handshake of a context to it
_GATES: dict[int, tuple[zmq.Context, asyncio.AbstractEventLoop, object, _AllowedKeys]] = {}


ZAP_REBIND_S = 2.0  # how long a new ZAP handler waits for the previous one's address to be freed


def _stop_gate(auth: object) -> None:
    """Stop a ZAP handler whose event loop may be closed, and always close its ZAP socket.

    Should ``AsyncioAuthenticator.stop`` raise (a task of a closed loop), its ZAP socket would stay open
    and keep the context's ZAP address bound; the socket is closed here whatever ``stop`` managed."""
    with contextlib.suppress(Exception):
        auth.stop()  # type: ignore[attr-defined]
    zap = getattr(auth, "zap_socket", None)
    if zap is not None and not zap.closed:
        try:
            zap.close(linger=0)
        except Exception:  # noqa: BLE001 - the loop is gone: close the ZeroMQ socket itself
            zmq.Socket.close(zap, linger=0)


def _allow_client(ctx: zmq.Context, client_public: bytes) -> None:
    """Install (once per context and loop) the ZAP handler that accepts only ``client_public`` keys."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    loop = asyncio.get_running_loop()  # the handler is a task of this loop (servers are built inside it)
    entry = _GATES.get(id(ctx))
    if entry is not None and (entry[0] is not ctx or entry[1] is not loop or loop.is_closed()):
        _stop_gate(entry[2])  # a previous asyncio.run()'s handler: its loop is gone
        entry = None
    if entry is None:
        allowed = _AllowedKeys()
        auth = AsyncioAuthenticator(ctx, log=logging.getLogger("flashrl.wire.transport.zap"))
        deadline = time.monotonic() + ZAP_REBIND_S
        while True:
            try:
                auth.start()
                break
            except zmq.ZMQError as e:
                # The previous handler's ZAP socket is closed, but ZeroMQ frees its inproc address a few
                # ms later (its reaper thread): bind again until it does.
                _stop_gate(auth)
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise TransportError(f"cannot start this process's CURVE handler (ZAP): {e}") from e
                time.sleep(0.01)
        auth.configure_curve_callback("*", allowed)
        entry = (ctx, loop, auth, allowed)
        _GATES[id(ctx)] = entry
    entry[3].keys.add(client_public)


_REFUSED = 0
_REFUSAL_EVENTS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (no CURVE keys, or not this run's server key)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key not this run's (ZAP denied)",
}


def refused_total() -> int:
    """Handshakes refused by every CURVE server of this process (the ``transport/refused`` counter)."""
    return _REFUSED


class RpcClient:
    """Controller-side channel to one server. Many concurrent requests share the socket."""

    def __init__(
        self,
        address: str,
        replies: Codec,
        *,
        name: str = "peer",
        curve: dict[str, bytes] | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        check_address(address, curve is not None)
        self.name = name
        self.address = address
        self._codec = replies
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = _socket(self._ctx, zmq.DEALER, curve, server=False)
        self._sock.connect(address)
        self._next_rid = 1
        self._pending: dict[int, asyncio.Future[Msg]] = {}
        # rids whose caller gave up (cancelled, timed out): a late reply for one is expected, not a warning.
        # Bounded: the oldest are forgotten (a reply that late is then warned about, harmlessly).
        self._abandoned: set[int] = set()
        self._dead: PeerDead | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._outbox: dict[int, bytes] = {}  # rid -> encoded request, sent by the next _flush
        self._flush_at: asyncio.Handle | None = None
        self.frames_sent = 0  # ZeroMQ messages sent
        self.messages_sent = 0  # requests in them

    @property
    def dead(self) -> PeerDead | None:
        return self._dead

    def start(self, heartbeat_s: float = 0.0, heartbeat_timeout_s: float = 30.0) -> None:
        """Start the receive loop (and the heartbeat when heartbeat_s > 0). Needs a running loop."""
        self._tasks.append(asyncio.get_running_loop().create_task(self._recv_loop(), name=f"{self.name}-recv"))
        if heartbeat_s > 0:
            self._tasks.append(
                asyncio.get_running_loop().create_task(
                    self._heartbeat(heartbeat_s, heartbeat_timeout_s), name=f"{self.name}-heartbeat"
                )
            )

    async def request(self, msg: Msg, timeout: float | None = None) -> Msg:
        """Send ``msg`` and wait for its reply. Raises RemoteError, PeerDead or TimeoutError."""
        if self._dead is not None:
            raise self._dead
        if not self._tasks:
            self.start()
        rid = self._next_rid
        self._next_rid += 1
        msg.rid = rid
        data = encode(msg)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._pending[rid] = fut
        self._outbox[rid] = data
        if self._flush_at is None:
            self._flush_at = loop.call_soon(self._flush)
        try:
            reply = await asyncio.wait_for(fut, timeout) if timeout else await fut
        finally:
            self._pending.pop(rid, None)
            if fut.cancelled() or not fut.done():  # cancelled or timed out: its late reply is expected
                self._abandoned.add(rid)
                if len(self._abandoned) > _ABANDONED_MAX:
                    self._abandoned = {r for r in self._abandoned if r > rid - _ABANDONED_MAX // 2}
        if isinstance(reply, Error):
            raise RemoteError(f"{self.name}: {reply.message}", reply.kind)
        return reply

    def _flush(self) -> None:
        """Send every request queued this tick: one frame (a batch when there are several)."""
        self._flush_at = None
        if not self._outbox:
            return
        parts = list(self._outbox.values())
        self._outbox.clear()
        if self._dead is not None:  # their futures already failed
            return
        for frame, n in _frames(parts):
            try:
                sent = cast("asyncio.Future[object]", self._sock.send(frame, copy=len(frame) < _ZERO_COPY_MIN))
            except zmq.ZMQError as e:  # the socket is closed
                self._kill(PeerDead(f"{self.name}: send failed: {e}"))
                return
            self.frames_sent += 1
            self.messages_sent += n
            if sent.done():
                self._sent(sent)
            else:  # queued by zmq.asyncio (it could not send at once); it keeps the order
                sent.add_done_callback(self._sent)

    def _sent(self, sent: asyncio.Future[object]) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            self._kill(PeerDead(f"{self.name}: send failed: {sent.exception()}"))

    async def _recv_loop(self) -> None:
        try:
            while True:
                frame = await self._sock.recv()
                try:
                    replies = self._codec.decode_frame(frame)
                except ProtocolError as e:
                    log.error("%s sent a malformed frame, closing the channel: %s", self.name, e)
                    self._kill(PeerDead(f"{self.name} sent a malformed frame: {e}"))
                    return
                for reply in replies:
                    fut = self._pending.get(reply.rid)
                    if fut is None and reply.rid in self._abandoned:  # e.g. an aborted redundant rollout
                        self._abandoned.discard(reply.rid)
                        log.debug("%s: late reply for abandoned request %d dropped", self.name, reply.rid)
                    elif fut is None:
                        log.warning("%s: reply for unknown request %d (%s) ignored", self.name, reply.rid,
                                    type(reply).__name__)
                    elif not fut.done():
                        fut.set_result(reply)
        except (asyncio.CancelledError, zmq.ContextTerminated):
            raise
        except Exception as e:  # socket closed under us
            self._kill(PeerDead(f"{self.name}: receive failed: {e}"))

    async def _heartbeat(self, interval: float, timeout: float) -> None:
        while self._dead is None:
            await asyncio.sleep(interval)
            try:
                reply = await self.request(Ping(), timeout=timeout)
                if not isinstance(reply, Pong):
                    raise PeerDead(f"{self.name} answered Ping with {type(reply).__name__}")
            except TimeoutError:
                self._kill(PeerDead(f"{self.name} missed its heartbeat ({timeout:.0f}s without a Pong)"))
            except PeerDead:
                return

    def fail(self, err: PeerDead) -> None:
        """Declare the peer dead (e.g. its process exited): every pending and later request raises ``err``."""
        self._kill(err)

    def _kill(self, err: PeerDead) -> None:
        if self._dead is None:
            self._dead = err
        self._outbox.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._dead)

    async def close(self) -> None:
        self._kill(PeerDead(f"{self.name}: channel closed"))
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        self._sock.close(linger=0)


_ABANDONED_MAX = 1 << 16
_FRAME_BYTES = 4 << 20  # a batch is cut into frames of about this size at most
_ZERO_COPY_MIN = 64 << 10  # ZeroMQ copies smaller frames (cheaper than tracking the buffer)


def _frames(parts: list[bytes]) -> list[tuple[bytes, int]]:
    """Encoded messages -> frames (one message alone, several as a batch) and their message counts."""
    if len(parts) == 1:
        return [(parts[0], 1)]
    out: list[tuple[bytes, int]] = []
    start, size = 0, 0
    for k, p in enumerate(parts):
        if size and size + len(p) > _FRAME_BYTES:
            out.append((_one_or_batch(parts[start:k]), k - start))
            start, size = k, 0
        size += len(p)
    out.append((_one_or_batch(parts[start:]), len(parts) - start))
    return out


def _one_or_batch(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else encode_batch(parts)


Handler = Callable[[Msg], Awaitable[Msg | None]]


class RpcServer:
    """Process-side channel: decode each request, run ``handler`` in its own task, send the reply.

    ``handler`` returns the reply (its rid is set here) or None for no reply. An exception in the
    handler becomes an ``Error`` reply for that request only. A malformed frame is logged and its
    sender (ZeroMQ identity) is ignored from then on. A frame may carry a batch of requests (each
    gets its own task, in order); replies finished in one tick go back to their peer as one frame.
    """

    def __init__(
        self,
        address: str,
        requests: Codec,
        handler: Handler,
        *,
        name: str = "server",
        curve: dict[str, bytes] | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        check_address(address, curve is not None)
        self.name = name
        self._codec = requests
        self._handler = handler
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = _socket(self._ctx, zmq.ROUTER, curve, server=True)
        self._monitor: zmq.asyncio.Socket | None = None
        if curve:  # count refused handshakes (the monitor exists before the first connection)
            self._monitor = self._sock.get_monitor_socket(sum(_REFUSAL_EVENTS))
        self._sock.bind(address)
        self.address = address
        self._untrusted: set[bytes] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox: dict[bytes, list[bytes]] = {}  # peer identity -> encoded replies, sent by _flush
        self._flush_at: asyncio.Handle | None = None
        self.frames_received = 0
        self.messages_received = 0
        self.frames_sent = 0
        self.messages_sent = 0
        self.rejected = 0
        self.refused = 0  # CURVE handshakes refused (no keys, wrong keys)
        self._refusal_logged = (0.0, 0)  # (when, count) of the last log line

    async def _watch_handshakes(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        global _REFUSED
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            what = _REFUSAL_EVENTS.get(int(event["event"]))
            if what is None:
                continue
            self.refused += 1
            _REFUSED += 1
            now = time.monotonic()
            last_at, last_count = self._refusal_logged
            if now - last_at >= 5.0:  # a peer retrying every 100 ms: one line per 5 s, with the count
                log.warning("%s: refused %d unauthenticated connection attempt(s) on %s (transport/refused = %d; "
                            "last: %s)", self.name, self.refused - last_count, self.address, self.refused, what)
                self._refusal_logged = (now, self.refused)

    async def serve(self) -> None:
        """Run until cancelled."""
        if self._monitor is not None:
            watch = asyncio.get_running_loop().create_task(self._watch_handshakes(), name=f"{self.name}-handshakes")
            self._tasks.add(watch)
            watch.add_done_callback(self._tasks.discard)
        try:
            while True:
                parts = await self._sock.recv_multipart()
                if len(parts) != 2:
                    log.error("%s: dropped a message with %d frames (expected 2)", self.name, len(parts))
                    self.rejected += 1
                    continue
                ident, frame = parts
                if ident in self._untrusted:
                    continue
                try:
                    msgs = self._codec.decode_frame(frame)
                except ProtocolError as e:
                    log.error("%s: %s; ignoring this peer from now on", self.name, e)
                    self.rejected += 1
                    self._untrusted.add(ident)
                    continue
                self.frames_received += 1
                self.messages_received += len(msgs)
                loop = asyncio.get_running_loop()
                for msg in msgs:
                    task = loop.create_task(self._run(ident, msg))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            for t in list(self._tasks):
                t.cancel()
            if self._flush_at is not None:  # replies not sent yet are dropped with the socket (linger 0)
                self._flush_at.cancel()
                self._flush_at = None
            if self.messages_received:  # how well requests coalesced (one frame per peer and tick)
                log.info("%s: %d requests in %d frames received, %d replies in %d frames sent", self.name,
                         self.messages_received, self.frames_received, self.messages_sent, self.frames_sent)
            if self.refused > self._refusal_logged[1]:
                log.warning("%s: refused %d unauthenticated connection attempt(s) on %s in all (transport/refused)",
                            self.name, self.refused, self.address)
            if self._monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                self._monitor.close(linger=0)
            self._sock.close(linger=0)

    async def _run(self, ident: bytes, msg: Msg) -> None:
        try:
            reply = await self._handler(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("%s: %s failed", self.name, type(msg).__name__)
            reply = Error(message=f"{type(msg).__name__} failed: {type(e).__name__}: {e}")
        if reply is None:
            return
        reply.rid = msg.rid
        self._outbox.setdefault(ident, []).append(encode(reply))
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the replies finished this tick: one frame per peer (a batch when there are several)."""
        self._flush_at = None
        outbox, self._outbox = self._outbox, {}
        for ident, parts in outbox.items():
            for frame, n in _frames(parts):
                try:
                    sent = cast("asyncio.Future[object]",
                                self._sock.send_multipart([ident, frame], copy=len(frame) < _ZERO_COPY_MIN))
                except zmq.ZMQError as e:  # the socket is closed (the server is stopping)
                    log.warning("%s: %d repl(ies) not sent: %s", self.name, n, e)
                    return
                self.frames_sent += 1
                self.messages_sent += n
                if sent.done():
                    self._sent(sent)
                else:
                    sent.add_done_callback(self._sent)

    def _sent(self, sent: asyncio.Future[object]) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            log.warning("%s: a reply frame was not sent: %s", self.name, sent.exception())
