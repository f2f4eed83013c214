"""LoRA through a real vLLM engine (LLMEngine in this process, LoRA enabled): the trainer's adapter, packed
in the weight-sync format, verified and loaded in place through vLLM's LoRA API (flashrl/engine/lora.py),
gives the logprobs transformers + peft give; a second version replaces the first in the same slot; the
base model (no adapter) is untouched. The pure parts: tests/unit/test_lora.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from flashrl.engine.lora import PolicyAdapter, lora_engine_kwargs  # noqa: E402
from flashrl.engine.server import EngineSpec, engine_kwargs  # noqa: E402
from flashrl.trainer.lora import LoraSpec, adapter_config, adapter_state_dict, apply_lora, reference_disabled  # noqa: E402
from flashrl.wire.lora import verify_adapter  # noqa: E402
from flashrl.wire.weights import build_manifest  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [1, 12, 5, 13, 7, 14]
SPEC = LoraSpec(rank=16, alpha=32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashrl.models.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    opts = EngineSpec(address="tcp://127.0.0.1:0", model=str(model_dir), max_model_len=64, max_num_seqs=8, kv_cache_gib=0.25)
    eng = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(opts), **lora_engine_kwargs(SPEC.rank)),
                                     enable_multiprocessing=False)
    yield eng
    del eng


def _generate(llm, rid: str, lora) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams

    llm.add_request(rid, {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True),
                    lora_request=lora)
    for _ in range(1000):
        for out in llm.step():
            if out.finished:
                c = out.outputs[0]
                return list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
    raise TimeoutError(f"request {rid} did not finish in 1000 engine steps")


def _max_diff(model, tokens: list[int], logprobs: list[float]) -> float:
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1 : -1].float(), -1)
    return max(abs(lp[i, t].item() - logprobs[i]) for i, t in enumerate(tokens))


def _sync(policy, adapter: PolicyAdapter, llm, version: int) -> None:
    manifest, flats = build_manifest(adapter_state_dict(policy), version, bucket_mb=0.05)
    adapter.load(llm, version, verify_adapter(manifest, [f.clone() for f in flats]))


def test_adapter_versions_load_in_place_and_match_transformers(llm, model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), SPEC)
    adapter = PolicyAdapter(tmp_path / "adapters", adapter_config(SPEC, str(model_dir)))
    base_tokens, base_lps = _generate(llm, "base", None)
    with reference_disabled(policy):
        assert _max_diff(policy, base_tokens, base_lps) < 1e-4

    torch.manual_seed(1)
    seen = []
    for version in (1, 2):
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)  # a "trained" adapter, different per version
        _sync(policy, adapter, llm, version)
        tokens, lps = _generate(llm, f"v{version}", adapter.request)
        assert _max_diff(policy, tokens, lps) < 1e-4  # the engine serves exactly this version
        seen.append(lps)
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir() if not p.name.startswith(".")) == [f"v{version}"]
    assert max(abs(a - b) for a, b in zip(*seen)) > 1e-3  # version 2 replaced version 1
    assert llm.list_loras() == {1}  # one slot, reloaded in place
    assert _generate(llm, "base-again", None)[1] == pytest.approx(base_lps, abs=1e-6)  # the base is untouched
