"""weight_sync.load = "bucket" on a real vLLM engine process (EngineSpec.sync_load): the sync loads bucket by bucket
into vLLM through its own reload_weights and serves exactly the sent weights; a corrupt first bucket is refused with
the old weights serving on; a bucket corrupt after others loaded stops the engine, which exits naming the bucket and
never reports the new version. The same without vLLM (a fake group and loader): tests/unit/test_bucket_load.py.

One engine process (~30 s to start), tests in file order; the last one ends it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrl.engine.client import EngineProcess, EngineProcessClient
from flashrl.trainer.weights import WeightSender
from flashrl.wire.protocol import Generate
from flashrl.wire.transport import PeerDead, RemoteError
from flashrl.wire.weights import build_manifest
from tests.helpers import running_engine
from tests.integration.test_engine_process import PROMPT, _reference_logprobs, join_sender

pytestmark = pytest.mark.slow

GREEDY = Generate(prompt_ids=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrl.models.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_engine(tmp_path_factory.mktemp("logs"), model_dir, "bucket-engine", max_model_len=256,
                        max_num_seqs=8, kv_cache_gib=0.25, sync_load="bucket") as ep:
        yield ep


@pytest.fixture
async def client(engine: EngineProcess):
    c = engine.new_client()
    yield c
    await c.close()


@pytest.fixture(scope="module")
def sender(engine: EngineProcess) -> WeightSender:
    return join_sender(engine)


def _perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(model_dir / "model.safetensors"))
    return {k: v + torch.randn(v.shape, generator=g) * 0.05 for k, v in sd.items()}


async def _sync(client: EngineProcessClient, sender: WeightSender, manifest, flats):
    reply, (_, failed) = await asyncio.gather(client.update_weights(manifest), asyncio.to_thread(sender.send, flats))
    return reply, failed


async def test_bucket_by_bucket_sync_serves_exactly_the_new_weights(
    engine: EngineProcess, client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    sd = _perturbed(model_dir, 1)
    manifest, flats = build_manifest(sd, version=1, bucket_mb=0.25)
    assert len(manifest.buckets) > 4
    reply, failed = await _sync(client, sender, manifest, flats)
    assert failed == {} and reply.ok and reply.version == 1, reply
    total = sum(f.numel() * f.element_size() for f in flats)
    assert 0 < reply.extra_bytes < total  # a few buckets, not the model (whole mode holds `total`)
    after = await client.generate(GREEDY)
    assert after.versions == [1] * 12 and await client.ping() == 1
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.load_state_dict(sd, strict=False)  # the tied lm_head follows the embedding
    expected = _reference_logprobs(model, PROMPT, after.token_ids)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-3), (after.logprobs, expected)
    assert "bucket-engine: weights v1 loaded" in engine.log_path.read_text()
    assert "(bucket load:" in engine.log_path.read_text() and "engine/sync_extra_bytes" in engine.log_path.read_text()


async def test_a_corrupt_first_bucket_is_refused_and_the_old_weights_serve_on(
    client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    before = await client.generate(GREEDY)
    manifest, flats = build_manifest(_perturbed(model_dir, 2), version=2, bucket_mb=0.25)
    manifest.buckets[0].checksum = manifest.buckets[0].checksum[:-4] + "0000"
    reply, failed = await _sync(client, sender, manifest, flats)
    assert failed == {}  # the engine took the whole broadcast
    assert not reply.ok and reply.version == 1 and reply.error.startswith("bucket 0 of"), reply
    after = await client.generate(GREEDY)
    assert after.versions == [1] * 12 and after.token_ids == before.token_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)


async def test_a_bucket_corrupt_mid_sync_stops_the_engine_which_never_claims_the_new_version(
    engine: EngineProcess, client: EngineProcessClient, sender: WeightSender, model_dir: Path
) -> None:
    manifest, flats = build_manifest(_perturbed(model_dir, 3), version=3, bucket_mb=0.25)
    bad = len(manifest.buckets) // 2
    manifest.buckets[bad].checksum = manifest.buckets[bad].checksum[:-4] + "0000"
    with pytest.raises((RemoteError, PeerDead)) as err:
        await _sync(client, sender, manifest, flats)
    if isinstance(err.value, RemoteError):
        assert f"bucket {bad} of {len(flats)}" in str(err.value) and "partly" in str(err.value)
    try:  # whatever it answers before it is gone: never version 3
        assert await asyncio.wait_for(client.ping(), 5) == 1
    except (PeerDead, RemoteError, TimeoutError):
        pass
    assert await asyncio.to_thread(engine.proc.wait, 60) == 1  # it exited: a partly-loaded model never serves
    log = engine.log_path.read_text()
    assert f"bucket {bad} of {len(flats)}" in log and "partly-loaded" in log and "fatal" in log
    assert "weights v3 loaded" not in log
