"""The engine process: options, load accounting, the ZeroMQ boundary, and (slow) a real vLLM engine.

The slow tests share one engine process (module fixture, ~30 s to start) and run in file order:
generation, abort, pause/resume, weight sync (the test process is trainer rank 0), a rejected
sync, generation while the weights arrive, and last the engine's death (SIGKILL) seen by the client as PeerDead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from safetensors.torch import load_file

from flashrl.engine.client import (
    EngineProcess,
    EngineProcessClient,
    spawn_engine,
)
from flashrl.engine.load import LoadMeter
from flashrl.engine.server import EngineSpec
from flashrl.interfaces import EngineClient
from flashrl.trainer.weights import WeightSender
from flashrl.wire.protocol import ENGINE_REPLIES, ENGINE_REQUESTS, Generate, Generated, Ping, Pong, encode
from flashrl.wire.transport import PeerDead, RemoteError, RpcClient, RpcServer, free_port
from flashrl.wire.weights import build_manifest

# --------------------------------------------------------------------------- over loopback ZeroMQ, no engine


def test_the_stat_logger_feeds_the_meter_and_replaces_vllms_prometheus_logger() -> None:
    """vLLM adds its Prometheus logger to an engine unless a custom logger is one (StatLoggerManager);
    ours is, so the engine's only logger is the meter's, and it registers no Prometheus metric."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase, PrometheusStatLogger

    from flashrl.engine.load import stat_logger_factory

    meter = LoadMeter(now=0.0)
    cls = stat_logger_factory(meter)
    assert issubclass(cls, PrometheusStatLogger) and issubclass(cls, AggregateStatLoggerBase)
    before = set(REGISTRY._names_to_collectors)
    logger = cls(vllm_config=None, engine_indexes=[0])
    assert set(REGISTRY._names_to_collectors) == before
    logger.record(SimpleNamespace(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25),
                  SimpleNamespace(num_generation_tokens=7), engine_idx=0)
    logger.record(None, SimpleNamespace(num_generation_tokens=5))
    logger.record_sleep_state(1, 1)
    logger.log_engine_initialized()
    logger.log()
    assert (meter.sched_running, meter.sched_waiting, meter.kv_usage, meter.generated_tokens) == (3, 2, 0.25, 12)


async def test_client_is_an_engine_client() -> None:
    c = EngineProcessClient("e", f"tcp://127.0.0.1:{free_port()}")
    try:
        assert isinstance(c, EngineClient) and c.inflight == 0
    finally:
        await c.close()


async def test_malformed_frame_is_rejected_and_its_sender_ignored() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    handled: list[str] = []

    async def handler(msg):  # a trivial engine: only Ping is valid here
        handled.append(type(msg).__name__)
        return Pong(version=3)

    server = RpcServer(address, ENGINE_REQUESTS, handler, name="trivial")
    task = asyncio.create_task(server.serve())
    ctx = zmq.asyncio.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.connect(address)
    try:
        await bad.send(msgspec.msgpack.encode({"type": "Generate", "prompt_ids": "not a list"}))
        await bad.send(encode(Ping(rid=5)))  # a valid frame from the same, now untrusted, peer
        good = RpcClient(address, ENGINE_REPLIES, name="good")
        assert isinstance(await good.request(Ping(), timeout=5), Pong)
        await good.close()
        assert server.rejected == 1
        assert await bad.poll(200) == 0  # no reply, not even to its valid Ping
        assert handled == ["Ping"]
    finally:
        bad.close(linger=0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# --------------------------------------------------------------------------- slow: a real engine

PROMPT = [10, 11, 12, 13, 14, 15]  # characters of the built-in tokenizer


def _reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under a transformers model."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrl.models.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    opts = EngineSpec(
        address=f"tcp://127.0.0.1:{free_port()}", model=str(model_dir), name="test-engine",
        max_model_len=256, max_num_seqs=32, kv_cache_gib=0.25,
    )
    ep = spawn_engine(opts, tmp_path_factory.mktemp("logs") / "engine.log")
    try:
        ready_s = asyncio.run(ep.wait_ready(600))
        print(f"engine ready in {ready_s:.1f}s")
        yield ep
    finally:
        asyncio.run(ep.terminate(timeout=20))
        # No orphans: anything the engine started was in its process group.
        with pytest.raises(ProcessLookupError):
            os.killpg(ep.proc.pid, 0)


@pytest.fixture
async def client(engine: EngineProcess):
    c = engine.new_client()
    yield c
    await c.close()


@pytest.mark.slow
async def test_generate_tokens_logprobs_versions(client: EngineProcessClient, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reqs = [Generate(request_id=f"g{i}", prompt_ids=PROMPT, max_tokens=12, temperature=1.0, seed=i) for i in range(8)]
    outs = await asyncio.gather(*(client.generate(r) for r in reqs))
    for r, o in zip(reqs, outs):
        assert o.request_id == r.request_id and o.engine == "test-engine"
        assert 1 <= len(o.token_ids) <= 12 and len(o.logprobs) == len(o.versions) == len(o.token_ids)
        assert all(lp <= 0 for lp in o.logprobs) and o.versions == [0] * len(o.token_ids)
        assert o.finish_reason == "length" or (o.finish_reason == "stop" and o.token_ids[-1] == 2)
    # Same seed, same sample; greedy is the argmax path, with the untrained model's logprobs.
    again = await client.generate(reqs[3])
    assert again.token_ids == outs[3].token_ids
    greedy = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    expected = _reference_logprobs(ref, PROMPT, greedy.token_ids)
    assert torch.allclose(torch.tensor(greedy.logprobs), expected, atol=1e-3)
    # stop_token_ids end the sample at the first stop token the engine produces.
    stop = greedy.token_ids[3]
    stopped = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=10, temperature=0.0, stop_token_ids=[stop]))
    first = greedy.token_ids.index(stop)
    assert stopped.token_ids == greedy.token_ids[: first + 1] and stopped.finish_reason == "stop"
    load = await client.load()
    assert load.generated_tokens >= sum(len(o.token_ids) for o in outs) and load.version == 0


@pytest.mark.slow
async def test_burst_of_seeded_prompts_over_the_token_budget(client: EngineProcessClient) -> None:
    # 32 seeded 120-token prompts at once: 3840 prompt tokens, over vLLM's 2048-token step budget. With
    # chunked prefill the CPU engine died here ("CPU Generator does not use offset"); it must serve all.
    prompt = (PROMPT * 40)[:120]
    reqs = [Generate(request_id=f"b{i}", prompt_ids=prompt, max_tokens=4, temperature=1.0, seed=100 + i, ignore_eos=True)
            for i in range(32)]
    outs = await asyncio.wait_for(asyncio.gather(*(client.generate(r) for r in reqs)), 300)
    assert [o.request_id for o in outs] == [r.request_id for r in reqs]
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)
    assert (await client.generate(reqs[5])).token_ids == outs[5].token_ids  # seeded: the same sample again


async def _wait_tokens(client: EngineProcessClient, start: int, n: int) -> None:
    for _ in range(1000):  # until the engine has generated n more tokens
        if (await client.load()).generated_tokens >= start + n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine did not generate {n} tokens in 20 s")


async def _start_and_pin(client: EngineProcessClient, req: Generate) -> asyncio.Task[Generated]:
    """Start ``req`` and pause the engine (keep) once it has produced a few tokens: pinned mid-flight.

    On a busy shared machine a 200-token request can finish between two polls; then try again.
    """
    for _ in range(3):
        task = asyncio.create_task(client.generate(req))
        await _wait_tokens(client, (await client.load()).generated_tokens, 5)
        await client.pause("keep")
        await asyncio.sleep(0.2)  # let a reply that was already on its way arrive
        if not task.done():
            return task
        await client.resume()
    pytest.fail(f"could not catch a {req.max_tokens}-token request mid-flight in 3 tries")


@pytest.mark.slow
async def test_abort_returns_the_tokens_so_far(client: EngineProcessClient) -> None:
    task = await _start_and_pin(client, Generate(request_id="long", prompt_ids=PROMPT, max_tokens=240, ignore_eos=True))
    try:
        await client.abort(["long"])
        out = await asyncio.wait_for(task, 30)
    finally:
        await client.resume()
    assert out.finish_reason == "abort" and out.request_id == "long" and 5 <= len(out.token_ids) < 240
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids) and all(lp <= 0 for lp in out.logprobs)
    assert client.inflight == 0


@pytest.mark.slow
async def test_one_tick_of_requests_is_one_frame_and_each_item_stands_alone(client: EngineProcessClient) -> None:
    """A group's requests started in one tick cross as one ZeroMQ message (and their replies come back
    coalesced); inside it, a bad request fails alone and a cancelled one is aborted alone on the engine."""
    rpc = client._rpc
    await client.pause("keep")  # everything waits in the engine until resume: the order below is deterministic
    sent0 = (rpc.frames_sent, rpc.messages_sent)
    reqs = [Generate(request_id=f"t{i}", prompt_ids=PROMPT, max_tokens=4, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(13)]
    reqs += [Generate(request_id="too-long", prompt_ids=PROMPT * 50, max_tokens=4),  # 300 > max_model_len 256
             Generate(request_id="cancelled", prompt_ids=PROMPT, max_tokens=200, ignore_eos=True),
             Generate(request_id="kept", prompt_ids=PROMPT, max_tokens=200, ignore_eos=True)]
    tasks = {r.request_id: asyncio.create_task(client.generate(r)) for r in reqs}

    async def cancel_and_abort(rid: str) -> None:  # what rollout._generate does for a cancelled rollout
        tasks[rid].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[rid]
        await client.abort([rid])

    try:
        with pytest.raises(RemoteError, match="maximum context length is 256"):
            await asyncio.wait_for(tasks.pop("too-long"), 30)
        assert (rpc.frames_sent - sent0[0], rpc.messages_sent - sent0[1]) == (1, 16)
        await cancel_and_abort("cancelled")
        tasks.pop("cancelled")
        await client.resume()
        outs = await asyncio.wait_for(asyncio.gather(*tasks.values()), 120)
    finally:
        await client.resume()
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert [o.request_id for o in outs] == [f"t{i}" for i in range(13)] + ["kept"]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in outs[:13])
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 200  # the abort was not its
    assert len({tuple(o.token_ids) for o in outs[:13]}) > 1  # per-request seeds: not one sample 13 times
    again = await client.generate(reqs[7])
    assert again.token_ids == outs[7].token_ids  # seeded alone as in the batch
    assert client.inflight == 0


@pytest.mark.slow
async def test_pause_holds_requests_until_resume(client: EngineProcessClient) -> None:
    await client.pause("keep")
    task = asyncio.create_task(client.generate(Generate(prompt_ids=PROMPT, max_tokens=5, ignore_eos=True)))
    await asyncio.sleep(1.0)
    assert not task.done()
    assert (await client.load()).busy_fraction > 0  # a held request keeps the engine occupied
    await client.resume()
    out = await asyncio.wait_for(task, 30)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def join_sender(engine: EngineProcess) -> WeightSender:
    """The test process as trainer rank 0 of a weight-sync group (gloo) with ``engine`` as rank 1."""
    port = free_port()
    sender = WeightSender()
    th = threading.Thread(target=sender.join, args=("engine", "127.0.0.1", port, "gloo", 60), daemon=True)
    th.start()

    async def join() -> None:
        c = engine.new_client()
        try:
            await c.init_weight_sync("127.0.0.1", port, 1, 2, "gloo", 60)
        finally:
            await c.close()

    asyncio.run(join())
    th.join(60)
    assert sender.backend == "gloo"
    return sender


@pytest.fixture(scope="module")
def sender(engine: EngineProcess) -> WeightSender:
    return join_sender(engine)


async def _sync(client: EngineProcessClient, sender: WeightSender, manifest, flats):
    reply, (send_s, failed) = await asyncio.gather(client.update_weights(manifest), asyncio.to_thread(sender.send, flats))
    assert failed == {}
    return reply, send_s


@pytest.mark.slow
async def test_weight_sync_serves_the_new_weights(
    engine: EngineProcess, client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    before = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    manifest, flats = build_manifest(model.state_dict(), version=1, bucket_mb=0.25)
    assert len(manifest.buckets) > 1

    # A long request in flight across the update: its tokens switch from version 0 to 1 mid-way.
    # It is pinned paused; the update pauses again, loads, and resumes.
    long = await _start_and_pin(client, Generate(prompt_ids=PROMPT, max_tokens=200, ignore_eos=True))
    reply, send_s = await _sync(client, sender, manifest, flats)
    assert reply.ok and reply.version == 1 and reply.error == "", reply
    print(f"weight sync: engine {reply.seconds:.3f}s, trainer send {send_s:.3f}s, {sum(f.numel() for f in flats) * 4 / 2**20:.1f} MiB")
    out = await long
    assert len(out.versions) == 200 and out.versions[0] == 0 and out.versions[-1] == 1
    assert out.versions == sorted(out.versions)

    after = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True))
    assert after.versions == [1] * 16 and await client.ping() == 1
    expected = _reference_logprobs(model, PROMPT, after.token_ids)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-3), (after.logprobs, expected)
    # The perturbation was big enough to matter: the same tokens under the old weights score differently.
    assert before.logprobs != after.logprobs
    # vLLM's expected per-sync lines (the tied LM head's and rotary cache's "Failed to load weights", the
    # reload's timing) are left out of the engine's log; the sync's own line is there.
    text = engine.log_path.read_text()
    assert "test-engine: weights v1 loaded" in text and "left out of this log" in text
    vllm_lines = [line for line in text.splitlines() if "left out of this log" not in line]
    assert not [line for line in vllm_lines if "Failed to load weights" in line or "Reloading and processing" in line]


@pytest.mark.slow
async def test_a_request_across_an_update_continues_with_kv_of_the_new_weights(
    client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    """After an update mid-generation the engine resets its prefix cache, running requests included: the
    request in flight recomputes the KV of its prompt and of its tokens so far with the new weights. Each
    token it generates after the update then has the logprob the new weights give over that same prefix
    (scored here by transformers over prompt + every token before it); with the old KV kept, attention over
    the prefix would still see the old weights' keys and values and every later logprob would be off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    version = await client.ping() + 1
    manifest, flats = build_manifest(model.state_dict(), version=version, bucket_mb=0.25)
    long = await _start_and_pin(client, Generate(prompt_ids=PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True))
    reply, _ = await _sync(client, sender, manifest, flats)
    assert reply.ok and reply.version == version, reply
    out = await asyncio.wait_for(long, 60)
    assert len(out.token_ids) == 200
    k = out.versions.index(version)  # the first token of the new weights
    assert k >= 5 and out.versions[k:] == [version] * (200 - k), out.versions
    expected = _reference_logprobs(model, PROMPT + out.token_ids[:k], out.token_ids[k:])
    got = torch.tensor(out.logprobs[k:])
    assert torch.allclose(got, expected, atol=1e-3), (k, (got - expected).abs().max().item())


@pytest.mark.slow
async def test_corrupt_sync_is_rejected_and_the_engine_keeps_serving(
    client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    before = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True))
    version = await client.ping()
    sd = {k: torch.zeros_like(v) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    manifest, flats = build_manifest(sd, version=version + 1, bucket_mb=0.25)
    manifest.buckets[-1].checksum = manifest.buckets[-1].checksum[:-4] + "0000"  # a wrong checksum: never load
    reply, _ = await _sync(client, sender, manifest, flats)
    assert not reply.ok and reply.version == version and "checksum" in reply.error
    after = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True))
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    assert after.versions == [version] * 8 and await client.ping() == version


@pytest.mark.slow
async def test_the_engine_serves_while_new_weights_arrive(
    client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    """The receive runs beside generation: while the engine waits for the trainer's broadcast, a request is
    served by the weights it has; only the load, once every bucket passed, switches the version."""
    version = await client.ping()
    sd = load_file(str(model_dir / "model.safetensors"))
    manifest, flats = build_manifest(sd, version=version + 1, bucket_mb=0.25)
    update = asyncio.ensure_future(client.update_weights(manifest))
    await asyncio.sleep(0.5)  # the engine is inside the receive by now; the trainer has not sent a byte
    during = await asyncio.wait_for(
        client.generate(Generate(prompt_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)), 30)
    assert during.versions == [version] * 8 and not update.done()
    send_s, failed = await asyncio.to_thread(sender.send, flats)
    assert failed == {}
    reply = await asyncio.wait_for(update, 30)
    assert reply.ok and reply.version == version + 1, reply
    assert reply.timings["receive_s"] >= 0.4  # it waited for the sender, beside generation
    after = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True))
    assert after.versions == [version + 1] * 8 and await client.ping() == version + 1


@pytest.mark.slow
async def test_dead_engine_raises_peer_dead(engine: EngineProcess) -> None:
    c = EngineProcessClient(engine.name, engine.address, heartbeat_s=0.3, heartbeat_timeout_s=1.0)
    try:
        await c.pause("keep")  # the next requests cannot finish before the kill
        pending = [asyncio.create_task(c.generate(Generate(prompt_ids=PROMPT, max_tokens=4))) for _ in range(8)]
        await asyncio.sleep(0.3)
        os.killpg(engine.proc.pid, signal.SIGKILL)
        errors = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
        assert all(isinstance(e, PeerDead) and "heartbeat" in str(e) for e in errors), errors
        assert c.inflight == 0
        with pytest.raises(PeerDead):
            await c.generate(Generate(prompt_ids=PROMPT))
    finally:
        await c.close()


@pytest.mark.slow
def test_spawn_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    opts = EngineSpec(address=f"tcp://127.0.0.1:{free_port()}", model=str(tmp_path / "no-such-model"))
    ep = spawn_engine(opts, tmp_path / "bad.log")
    try:
        with pytest.raises(RuntimeError, match="exited with code") as err:
            asyncio.run(ep.wait_ready(120))
        assert "no-such-model" in str(err.value)
    finally:
        asyncio.run(ep.terminate(timeout=5))


def test_yield_cpu_lowers_the_process_and_its_session() -> None:
    """engine.nice: the engine process (in a session of its own, as every flashrl child) lowers its own
    priority and, where the kernel groups by session (autogroup), its session's CPU weight."""
    import subprocess
    import sys

    code = ("import os; from pathlib import Path; from flashrl.engine.server import yield_cpu; yield_cpu(7); "
            "ag = Path('/proc/self/autogroup'); print(os.getpriority(os.PRIO_PROCESS, 0), "
            "ag.read_text().split()[-1] if ag.exists() else 'none')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         start_new_session=True, check=True).stdout.split()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert int(out[0]) == min(19, base + 7)
    if out[1] != "none":
        assert out[1] == "7"
