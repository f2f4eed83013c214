"""ZeroMQ channels over real loopback sockets: multiplexing, errors, malformed frames, dead peers."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from flashrl.wire import protocol as P
from flashrl.wire.transport import (
    PeerDead,
    RemoteError,
    RpcClient,
    RpcServer,
    TransportError,
    free_port,
)


async def _handler(msg: P.Msg) -> P.Msg | None:
    if isinstance(msg, P.Ping):
        return P.Pong(version=7)
    if isinstance(msg, P.Generate):
        # answer later requests first: replies must still reach the right caller
        await asyncio.sleep(0.05 * (5 - len(msg.prompt_ids)))
        return P.Generated(request_id=msg.request_id, token_ids=list(reversed(msg.prompt_ids)))
    if isinstance(msg, P.Abort):
        raise RuntimeError("abort exploded")
    return P.Ok()


@pytest.fixture
async def pair():
    addr = f"tcp://127.0.0.1:{free_port()}"
    server = RpcServer(addr, P.ENGINE_REQUESTS, _handler, name="srv")
    task = asyncio.create_task(server.serve())
    client = RpcClient(addr, P.ENGINE_REPLIES, name="srv")
    client.start()
    yield client, server, addr
    await client.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_concurrent_requests_get_their_own_replies(pair) -> None:
    client, _, _ = pair
    reqs = [P.Generate(request_id=f"r{i}", prompt_ids=list(range(i + 1))) for i in range(4)]
    replies = await asyncio.gather(*(client.request(r, timeout=5) for r in reqs))
    assert [r.request_id for r in replies] == ["r0", "r1", "r2", "r3"]
    assert replies[3].token_ids == [3, 2, 1, 0]


async def test_handler_error_is_per_request(pair) -> None:
    client, _, _ = pair
    with pytest.raises(RemoteError, match="Abort failed: RuntimeError: abort exploded"):
        await client.request(P.Abort(request_ids=["x"]), timeout=5)
    # the peer is still healthy: the next request gets the handler's own answer
    reply = await client.request(P.Ping(), timeout=5)
    assert isinstance(reply, P.Pong) and reply.version == 7


async def test_late_reply_to_an_abandoned_request_is_dropped_quietly(pair, caplog: pytest.LogCaptureFixture) -> None:
    client, _, _ = pair
    caplog.set_level("DEBUG", logger="flashrl.wire.transport")
    slow = P.Generate(request_id="slow", prompt_ids=[0])  # the handler answers it after 0.2 s
    with pytest.raises(TimeoutError):
        await client.request(slow, timeout=0.05)
    task = asyncio.create_task(client.request(P.Generate(request_id="cancelled", prompt_ids=[1]), timeout=5))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.4)  # both late replies arrive
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [] and sum("abandoned" in r.getMessage() for r in caplog.records) == 2
    assert client._abandoned == set()  # each late reply cleared its rid
    assert isinstance(await client.request(P.Ping(), timeout=5), P.Pong)  # the channel is fine


async def test_malformed_frame_rejected_and_sender_untrusted(pair) -> None:
    _, server, addr = pair
    ctx = zmq.asyncio.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(addr)
    await rogue.send(b"\x93not-msgpack")
    await asyncio.sleep(0.1)
    assert server.rejected == 1
    # a valid frame from the same (now untrusted) peer is ignored
    await rogue.send(P.encode(P.Ping(rid=1)))
    assert not await rogue.poll(200)
    rogue.close(linger=0)


async def test_malformed_reply_kills_the_channel() -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(addr)
    client = RpcClient(addr, P.ENGINE_REPLIES, name="bad")
    client.start()
    req = asyncio.create_task(client.request(P.Ping(), timeout=5))
    ident, _ = await router.recv_multipart()
    await router.send_multipart([ident, b"\x01\x02junk"])
    with pytest.raises(PeerDead, match="malformed"):
        await req
    with pytest.raises(PeerDead):
        await client.request(P.Ping(), timeout=1)
    await client.close()
    router.close(linger=0)


async def test_heartbeat_detects_silent_peer() -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # binds but never answers
    router.bind(addr)
    client = RpcClient(addr, P.ENGINE_REPLIES, name="silent")
    client.start(heartbeat_s=0.05, heartbeat_timeout_s=0.1)
    await asyncio.sleep(0.4)
    assert isinstance(client.dead, PeerDead)
    assert "heartbeat" in str(client.dead)
    await client.close()
    router.close(linger=0)


# --------------------------------------------------------------------------- CURVE off loopback
def _non_loopback_ip() -> str:
    from flashrl.launch.base import LaunchError, primary_address

    try:
        return primary_address()
    except LaunchError as e:
        pytest.skip(f"this machine has no non-loopback address: {e}")


async def _refused_after(server: RpcServer, before: int, timeout: float = 5.0) -> int:
    for _ in range(int(timeout / 0.02)):  # the monitor reports a refusal a moment after the handshake
        if server.refused > before:
            break
        await asyncio.sleep(0.02)
    return server.refused


async def test_curve_server_off_loopback_takes_only_the_run_client(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    import socket

    from flashrl.wire.keys import CurveKeys
    from flashrl.wire.transport import refused_total

    ip = _non_loopback_ip()
    port = free_port(ip)
    addr = f"tcp://{ip}:{port}"
    # plain TCP off loopback: refused before anything binds (the port stays free)
    with pytest.raises(TransportError, match="not loopback"):
        RpcServer(addr, P.ENGINE_REQUESTS, _handler, name="plain")
    with pytest.raises(TransportError, match="not loopback"):
        RpcClient(addr, P.ENGINE_REPLIES, name="plain")
    with socket.socket() as s:
        s.bind((ip, port))

    keys = CurveKeys.generate(tmp_path / "keys.json")
    other = CurveKeys.new()  # another run's keys
    caplog.set_level("WARNING", logger="flashrl.wire.transport")
    server = RpcServer(addr, P.ENGINE_REQUESTS, _handler, name="srv", curve=keys.server())
    task = asyncio.create_task(server.serve())
    good = RpcClient(addr, P.ENGINE_REPLIES, name="good", curve=keys.client())
    intruders: list[RpcClient] = []
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    try:
        reply = await good.request(P.Ping(), timeout=10.0)
        assert isinstance(reply, P.Pong) and reply.version == 7
        assert server.refused == 0

        # 1. no keys at all (a plain ZeroMQ peer): no reply, refused and counted
        total = refused_total()
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(addr)
        await raw.send(P.encode(P.Ping(rid=1)))
        assert await raw.poll(1000) == 0
        assert await _refused_after(server, 0) >= 1
        assert refused_total() > total
        raw.close(linger=0)

        # 2. keys of another run (client key unknown to the server's ZAP handler)
        # 3. this run's client key pair but another server key (talking to the wrong server)
        for name, curve in (
            ("other-client", other.client()),
            ("wrong-server", dict(keys.client(), server_public=other.server_public)),
        ):
            before = server.refused
            c = RpcClient(addr, P.ENGINE_REPLIES, name=name, curve=curve)
            intruders.append(c)
            with pytest.raises(TimeoutError):
                await c.request(P.Ping(), timeout=1.0)
            assert await _refused_after(server, before) > before, name
            await c.close()

        # the run's own client is unaffected
        reply = await good.request(P.Ping(), timeout=10.0)
        assert isinstance(reply, P.Pong)
        text = caplog.text
        assert "refused" in text and "transport/refused" in text and addr in text
        for secret in (keys.server_secret, keys.client_secret):
            assert secret.decode() not in text
    finally:
        raw.close(linger=0)
        for c in intruders:
            await c.close()
        await good.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_replies_are_never_dropped_while_the_client_is_busy() -> None:
    """3000 replies pile up while the client's loop is blocked: a ROUTER at its default high-water mark drops
    the excess silently (about 500 here before the fix) and those requests wait forever; all must arrive."""
    import threading
    import time

    from flashrl.wire.transport import local_address

    addr = local_address("hwm")
    ready = threading.Event()
    stop: dict[str, asyncio.AbstractEventLoop | asyncio.Event] = {}

    async def echo(msg: P.Msg) -> P.Msg | None:
        assert isinstance(msg, P.Generate)
        return P.Generated(request_id=msg.request_id, token_ids=msg.prompt_ids)

    async def serve() -> None:  # another thread, its own loop and context: like an engine process
        stop["loop"], stop["event"] = asyncio.get_running_loop(), asyncio.Event()
        ctx = zmq.asyncio.Context()
        server = RpcServer(addr, P.ENGINE_REQUESTS, echo, name="busy-peer", ctx=ctx)
        task = asyncio.create_task(server.serve())
        ready.set()
        await stop["event"].wait()  # type: ignore[union-attr]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)

    async def main() -> list[object]:
        client = RpcClient(addr, P.ENGINE_REPLIES, name="busy")
        try:
            calls = [asyncio.create_task(client.request(P.Generate(request_id=str(i), prompt_ids=list(range(2000))),
                                                        timeout=30)) for i in range(3000)]
            await asyncio.sleep(0.5)  # every request is out
            time.sleep(2.0)  # noqa: ASYNC251 - the loop is busy (a long step, a GC pause): replies pile up
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await client.close()

    try:
        results = asyncio.run(main())
    finally:
        loop, event = stop["loop"], stop["event"]
        loop.call_soon_threadsafe(event.set)  # type: ignore[union-attr]
        thread.join(10)
    lost = [r for r in results if not isinstance(r, P.Generated)]
    assert lost == [], f"{len(lost)} of 3000 replies lost: {lost[0]!r}"


# --------------------------------------------------------------------------- coalescing (one frame per tick)
async def _held(msg: P.Msg, release: dict[str, asyncio.Event]) -> P.Msg | None:
    """A Generate waits until its request id is released (or aborted: finish_reason "abort")."""
    if isinstance(msg, P.Generate):
        if msg.request_id.startswith("bad"):
            raise ValueError(f"prompt of {msg.request_id} too long")
        ev = release.setdefault(msg.request_id, asyncio.Event())
        await ev.wait()
        reason = "abort" if msg.request_id in release.get("_aborted", set()) else "length"  # type: ignore[operator]
        return P.Generated(request_id=msg.request_id, token_ids=msg.prompt_ids, finish_reason=reason)
    if isinstance(msg, P.Abort):
        aborted: set[str] = release.setdefault("_aborted", set())  # type: ignore[arg-type]
        for rid in msg.request_ids:
            aborted.add(rid)
            release.setdefault(rid, asyncio.Event()).set()
        return P.Ok(info=",".join(msg.request_ids))
    if isinstance(msg, P.Ping):
        return P.Pong()
    return P.Ok()


@pytest.fixture
async def held():
    addr = f"tcp://127.0.0.1:{free_port()}"
    release: dict[str, asyncio.Event] = {}

    async def handler(msg: P.Msg) -> P.Msg | None:
        return await _held(msg, release)

    server = RpcServer(addr, P.ENGINE_REQUESTS, handler, name="held")
    task = asyncio.create_task(server.serve())
    client = RpcClient(addr, P.ENGINE_REPLIES, name="held")
    client.start()
    yield client, server, release
    await client.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _until(cond, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {timeout}s: {what}")


async def test_requests_of_one_tick_go_as_one_frame_and_get_their_own_replies(held) -> None:
    client, server, release = held
    calls = [asyncio.create_task(client.request(P.Generate(request_id=f"g{i}", prompt_ids=[i, i + 1]), timeout=10))
             for i in range(16)]
    await _until(lambda: server.messages_received == 16, "16 requests received")
    assert (client.frames_sent, client.messages_sent) == (1, 16)
    assert server.frames_received == 1
    for i in range(16):  # finished in one tick: one reply frame
        release[f"g{i}"].set()
    replies = await asyncio.gather(*calls)
    assert [(r.request_id, r.token_ids) for r in replies] == [(f"g{i}", [i, i + 1]) for i in range(16)]
    assert (server.frames_sent, server.messages_sent) == (1, 16)
    # finished in different ticks: each reply goes when it is ready
    late = [asyncio.create_task(client.request(P.Generate(request_id=f"h{i}", prompt_ids=[i]), timeout=10))
            for i in range(3)]
    await _until(lambda: server.messages_received == 19, "3 more requests received")
    for i in (2, 0, 1):
        release[f"h{i}"].set()
        await asyncio.sleep(0.02)
    assert [r.request_id for r in await asyncio.gather(*late)] == ["h0", "h1", "h2"]
    assert (client.frames_sent, server.frames_sent, server.messages_sent) == (2, 4, 19)


async def test_a_failing_item_fails_only_its_own_request(held) -> None:
    client, server, release = held
    names = ["g0", "bad1", "g2", "g3"]
    calls = [asyncio.create_task(client.request(P.Generate(request_id=n, prompt_ids=[1]), timeout=10)) for n in names]
    await _until(lambda: server.messages_received == 4, "4 requests received")
    assert client.frames_sent == 1
    with pytest.raises(RemoteError, match="bad1 too long"):
        await calls[1]
    for n in ("g0", "g2", "g3"):
        release[n].set()
    assert [r.request_id for r in await asyncio.gather(calls[0], calls[2], calls[3])] == ["g0", "g2", "g3"]
    # an item that cannot even be encoded fails in its caller; the others of its tick still go
    ok = asyncio.create_task(client.request(P.Ping(), timeout=10))
    with pytest.raises(OverflowError):
        await client.request(P.Generate(request_id="huge", prompt_ids=[1 << 70]), timeout=10)
    assert isinstance(await ok, P.Pong)


async def test_a_cancelled_item_is_aborted_alone(held) -> None:
    """As rollout._generate does: a cancelled request sends Abort for its own id; the rest are untouched."""
    client, server, release = held

    async def generate(rid: str) -> P.Msg:
        try:
            return await client.request(P.Generate(request_id=rid, prompt_ids=[7]), timeout=10)
        except asyncio.CancelledError:
            await asyncio.shield(client.request(P.Abort(request_ids=[rid]), timeout=5))
            raise

    calls = {f"g{i}": asyncio.create_task(generate(f"g{i}")) for i in range(8)}
    await _until(lambda: server.messages_received == 8, "8 requests received")
    calls["g5"].cancel()
    await _until(lambda: "_aborted" in release, "the abort arrived")
    assert release["_aborted"] == {"g5"}  # type: ignore[comparison-overlap]
    for i in range(8):
        release[f"g{i}"].set()
    with pytest.raises(asyncio.CancelledError):
        await calls.pop("g5")
    outs = await asyncio.gather(*calls.values())
    assert all(o.finish_reason == "length" for o in outs) and len(outs) == 7
    await _until(lambda: server.messages_sent == 9, "the aborted request's late reply sent")
    await asyncio.sleep(0.05)
    assert client._abandoned == set() and client._pending == {}  # the late reply was expected and dropped


async def test_a_dead_peer_fails_every_pending_request_promptly() -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    release: dict[str, asyncio.Event] = {}

    async def handler(msg: P.Msg) -> P.Msg | None:
        return await _held(msg, release)

    server = RpcServer(addr, P.ENGINE_REQUESTS, handler, name="dying")
    task = asyncio.create_task(server.serve())
    client = RpcClient(addr, P.ENGINE_REPLIES, name="dying")
    client.start(heartbeat_s=0.1, heartbeat_timeout_s=0.3)
    try:
        calls = [asyncio.create_task(client.request(P.Generate(request_id=f"g{i}", prompt_ids=[1]))) for i in range(16)]
        await _until(lambda: server.messages_received >= 16, "16 requests received")
        task.cancel()  # the server's socket closes: no reply, no Pong ever again
        await asyncio.gather(task, return_exceptions=True)
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
        assert asyncio.get_running_loop().time() - t0 < 1.5
        assert all(isinstance(r, PeerDead) and "heartbeat" in str(r) for r in results)
        assert len({id(r) for r in results}) == 1  # the same named error for every one
        with pytest.raises(PeerDead):
            await client.request(P.Ping(), timeout=1)
        # the process-exit path (EngineProcessClient.fail): every pending request gets that error
        other = RpcClient(f"tcp://127.0.0.1:{free_port()}", P.ENGINE_REPLIES, name="gone")
        pending = [asyncio.create_task(other.request(P.Ping())) for _ in range(5)]
        await asyncio.sleep(0.05)
        other.fail(PeerDead("gone: process exited with -9"))
        assert [str(r) for r in await asyncio.gather(*pending, return_exceptions=True)] == \
            ["gone: process exited with -9"] * 5
        await other.close()
    finally:
        await client.close()


async def test_a_malformed_item_makes_the_whole_frame_malformed(pair) -> None:
    _, server, addr = pair
    ctx = zmq.asyncio.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(addr)
    await rogue.send(P.encode_batch([P.encode(P.Ping(rid=1)), P.encode(P.Pong(rid=2))]))  # a reply is no request
    await asyncio.sleep(0.1)
    assert server.rejected == 1 and server.messages_received == 0
    assert not await rogue.poll(200)
    rogue.close(linger=0)
    with pytest.raises(P.ProtocolError, match=r"malformed engine request message .*\$\[1\]\.type"):
        P.ENGINE_REQUESTS.decode_frame(P.encode_batch([P.encode(P.Ping(rid=1)), P.encode(P.Pong(rid=2))]))


def test_a_curve_handler_starts_again_in_a_later_event_loop() -> None:
    """Each asyncio.run() gets its own ZAP handler on the shared context; the previous one's ZAP address is
    freed by ZeroMQ a few ms after its socket closes. Binding the new one at once failed with "Address
    already in use (inproc://zeromq.zap.01)" (a CI failure, depending on which test ran before)."""
    import zmq.asyncio

    from flashrl.wire import transport as T

    async def gate(key: bytes) -> None:
        T._allow_client(zmq.asyncio.Context.instance(), key)
        entry = T._GATES[id(zmq.asyncio.Context.instance())]
        assert key in entry[3].keys and entry[2].zap_socket is not None

    for k in (b"a" * 40, b"b" * 40, b"c" * 40):  # a new loop (and handler) each time
        asyncio.run(gate(k))
