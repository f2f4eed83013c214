"""A LoRA engine process (EngineSpec.lora_rank > 0): each weight sync is an adapter version, received and
checksum-verified as a full sync is, then loaded in place through vLLM's LoRA API (engine/lora.py); a
request in flight across the update continues with the new adapter, its tokens labelled with the version
that produced them; a corrupt adapter is never loaded. In-process engine and trainer parts:
tests/integration/test_lora_process.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from flashrl.trainer.lora import LoraSpec, adapter_config, adapter_state_dict, apply_lora  # noqa: E402
from flashrl.wire.protocol import Generate  # noqa: E402
from flashrl.wire.weights import build_manifest, manifest_nbytes  # noqa: E402
from tests.helpers import running_engine  # noqa: E402
from tests.integration.test_engine_process import (  # noqa: E402
    PROMPT,
    _reference_logprobs,
    _start_and_pin,
    _sync,
    join_sender,
)

pytestmark = pytest.mark.slow
SPEC = LoraSpec(rank=16, alpha=32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrl.models.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_engine(tmp_path_factory.mktemp("logs"), model_dir, "lora-engine", max_model_len=256,
                        max_num_seqs=32, kv_cache_gib=0.25, lora_rank=SPEC.rank,
                        lora_config=adapter_config(SPEC, str(model_dir))) as ep:
        yield ep


@pytest.fixture(scope="module")
def sender(engine):
    return join_sender(engine)


async def test_adapter_versions_sync_verified_and_in_place(engine, sender, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    client = engine.new_client()
    try:
        policy = apply_lora(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), SPEC).eval()
        base = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True))
        assert base.versions == [0] * 16  # v0: the base model (peft's init: B = 0, the same function)
        with policy.disable_adapter():
            assert torch.allclose(torch.tensor(base.logprobs), _reference_logprobs(policy, PROMPT, base.token_ids), atol=1e-3)

        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)
        manifest, flats = build_manifest(adapter_state_dict(policy), version=1, bucket_mb=0.05)
        full, _ = build_manifest(policy.get_base_model().state_dict(), version=1, bucket_mb=64)
        assert len(manifest.buckets) > 1 and manifest_nbytes(manifest) < 0.2 * manifest_nbytes(full)

        long = await _start_and_pin(client, Generate(prompt_ids=PROMPT, max_tokens=200, ignore_eos=True))
        reply, _ = await _sync(client, sender, manifest, flats)
        assert reply.ok and reply.version == 1, reply
        out = await long
        assert out.versions[0] == 0 and out.versions[-1] == 1 and out.versions == sorted(out.versions)

        after = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True))
        assert after.versions == [1] * 16
        want = _reference_logprobs(policy, PROMPT, after.token_ids)
        assert torch.allclose(torch.tensor(after.logprobs), want, atol=1e-3), (after.logprobs, want)
        assert after.logprobs != pytest.approx(base.logprobs, abs=1e-3)  # the adapter is what is served

        # a corrupt adapter: rejected on its checksum, never loaded; v1 keeps serving
        bad, bad_flats = build_manifest({k: torch.zeros_like(v) for k, v in adapter_state_dict(policy).items()}, 2, 0.05)
        bad.buckets[0].checksum = bad.buckets[0].checksum[:-4] + "0000"
        reply, _ = await _sync(client, sender, bad, bad_flats)
        assert not reply.ok and reply.version == 1 and "checksum" in reply.error
        again = await client.generate(Generate(prompt_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True))
        assert again.token_ids == after.token_ids and again.versions == [1] * 16
    finally:
        await client.close()
