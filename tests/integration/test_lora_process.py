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
from flashrl.trainer.lora import (  # noqa: E402
    LoraSpec,
    adapter_config,
    adapter_state_dict,
    apply_lora,
    export_merged,
    reference_disabled,
    save_adapter,
)
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
    # the in-process engine made this process's default process group: gone with it, so later modules (world1) can
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


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


def _sync(policy, adapter: PolicyAdapter, llm, version: int, stage: bool = False) -> int:
    """One adapter version into the engine, as the server does it (``stage``: its folder written first, beside
    generation). Returns how many folder writes the paused load itself did."""
    import flashrl.engine.lora as engine_lora

    manifest, flats = build_manifest(adapter_state_dict(policy), version, bucket_mb=0.05)
    tensors = verify_adapter(manifest, [f.clone() for f in flats])
    if stage:
        adapter.stage(version, tensors)
    writes, save = [], engine_lora.save_adapter
    engine_lora.save_adapter = lambda *a, **k: (writes.append(a[0]), save(*a, **k))[1]
    try:
        adapter.load(llm, version, tensors)
    finally:
        engine_lora.save_adapter = save
    return len(writes)


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
        # staged beside generation: the paused load writes nothing, it only runs add_lora
        assert _sync(policy, adapter, llm, version, stage=True) == 0
        tokens, lps = _generate(llm, f"v{version}", adapter.request)
        assert _max_diff(policy, tokens, lps) < 1e-4  # the engine serves exactly this version
        seen.append(lps)
        # the folder of the version served, alone (the previous one removed once this one loaded)
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [f"v{version}"]
    assert max(abs(a - b) for a, b in zip(*seen)) > 1e-3  # version 2 replaced version 1
    assert llm.list_loras() == {1}  # one slot, reloaded in place
    assert _generate(llm, "base-again", None)[1] == pytest.approx(base_lps, abs=1e-6)  # the base is untouched

    # export: the adapter folder the engine loaded (peft format) and the merged model both load in
    # transformers, and their greedy continuation is the engine's, with its logprobs
    from peft import PeftModel

    v2 = save_adapter(tmp_path / "v2", adapter_state_dict(policy), adapter.config)  # the tensors the engine loaded
    merged_dir = export_merged(model_dir, v2, tmp_path / "merged")
    for name, model in {
        "adapter": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                             str(v2)).eval(),
        "merged": AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval(),
    }.items():
        ids = torch.tensor([PROMPT + tokens])
        with torch.no_grad():
            greedy = model(ids).logits[0, len(PROMPT) - 1 : -1].argmax(-1).tolist()
        assert greedy == tokens, name
        assert _max_diff(model, tokens, lps) < 1e-4, name


IDS = [[1, 12, 5, 13, 7, 14, 9, 10]] * 2


def _train(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two AdamW steps over the trainable (adapter) parameters; (base logits before, reference after, policy after)."""
    ids = torch.tensor(IDS)
    with torch.no_grad():
        before = model(ids).logits
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        torch.log_softmax(model(ids).logits.float(), -1)[..., 3].mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        with reference_disabled(model):
            ref = model(ids).logits
        return before, ref, model(ids).logits


def _fsdp_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from flashrl.trainer.lora import adapter_from_state_dict
    from flashrl.trainer.worker import Trainer, _decoder_layers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), SPEC).eval()
        for layer in _decoder_layers(model.get_base_model()):  # as trainer/worker.py build_policy shards
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        before, ref, pol = _train(model)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # the sync's own gather (trainer/worker.py Trainer.adapter_state): the adapter's shards alone
        synced = Trainer.adapter_state(SimpleNamespace(model=model, rank=rank))
        if rank == 0:
            torch.save({"before": before, "ref": ref, "pol": pol, "adapter": adapter_from_state_dict(full),
                        "synced": synced}, out)
        else:
            assert synced == {}
    finally:
        dist.destroy_process_group()


def test_fsdp2_trains_only_the_adapter_as_one_process_does(model_dir: Path, tmp_path: Path) -> None:
    """Two gloo ranks, FSDP2 per decoder layer as the trainer shards: the adapter's update equals an
    unsharded one's, the reference (adapter disabled) stays the base model bit for bit."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from flashrl.wire.transport import free_port

    out = tmp_path / "rank0.pt"
    mp.start_processes(_fsdp_rank, args=(free_port(), str(model_dir), str(out)), nprocs=2, start_method="spawn")
    got = torch.load(out)
    torch.manual_seed(0)
    plain = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), SPEC).eval()
    before, ref, pol = _train(plain)
    assert torch.equal(got["before"], before) and torch.equal(got["ref"], before)  # reference = base, exactly
    assert (got["pol"] - ref).abs().max() > 1e-2  # the adapter learned something
    assert torch.allclose(got["pol"], pol, atol=1e-5)
    want = adapter_state_dict(plain)
    assert got["adapter"].keys() == want.keys()
    assert all(torch.allclose(got["adapter"][k], want[k], atol=1e-6) for k in want)
    assert got["synced"].keys() == want.keys()  # the sync's gather of the adapter alone: the same tensors
    assert all(torch.equal(got["synced"][k], got["adapter"][k]) for k in want)


def _trainer_run(rank: int, port: int, model_dir: str, root: str) -> None:
    """A child process: the real Trainer (one gloo rank) trains the adapter two steps and checkpoints it in a run
    folder (tests/integration/test_lora_checkpoint.py train_and_checkpoint)."""
    import torch.distributed as dist

    from tests.integration.test_lora_checkpoint import lora_cfg, train_and_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        train_and_checkpoint(lora_cfg(Path(model_dir), Path(root), rank=SPEC.rank, dropout=0.0), Path(model_dir))
    finally:
        dist.destroy_process_group()


def test_exported_checkpoint_adapter_and_merged_give_the_engines_greedy_output(llm, model_dir: Path, tmp_path: Path) -> None:
    """`flashrl export` of a LoRA checkpoint: the adapter folder (--adapter), served by the vLLM engine through
    its LoRA API, and the same folder in transformers + peft, and the merged model in transformers, all
    continue the prompt with the same greedy tokens (and the engine's logprobs)."""
    import torch.multiprocessing as mp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner
    from vllm.lora.request import LoRARequest

    from flashrl.cli import app
    from flashrl.wire.transport import free_port

    mp.start_processes(_trainer_run, args=(free_port(), str(model_dir), str(tmp_path)), nprocs=1, start_method="spawn")
    run = tmp_path / "r"
    for flag, out in (("--adapter", "adapter"), (None, "merged")):
        res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / out), *([flag] if flag else [])])
        assert res.exit_code == 0, res.output
    tokens, lps = _generate(llm, "exported", LoRARequest("exported", 2, str(tmp_path / "adapter")))
    base_tokens, base_lps = _generate(llm, "base-export", None)
    # the trained adapter is not a no-op: it changes the greedy continuation or, where two steps of training on
    # the CI's freshly built model leave the argmax alone (seen once), the continuation's logprobs
    assert tokens != base_tokens or max(abs(a - b) for a, b in zip(lps, base_lps)) > 1e-3
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, model in {
        "adapter": PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval(),
        "merged": AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(),
    }.items():
        with torch.no_grad():  # greedy decoding, teacher-forced on the engine's tokens (EOS included: ignore_eos)
            greedy = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].argmax(-1).tolist()
        assert greedy == tokens, name
        assert _max_diff(model, tokens, lps) < 1e-4, name


def test_a_refused_adapter_keeps_the_served_version_and_the_engine(llm, model_dir: Path, tmp_path: Path) -> None:
    """An adapter vLLM refuses (rank 32 on an engine started for rank 16) is AdapterRefused, counted, after every
    attempt; vLLM validates a new adapter before it replaces the slot's, so the engine keeps serving the
    previous version with the same output, and the next good version loads."""
    from transformers import AutoModelForCausalLM

    from flashrl.engine.lora import LOAD_ATTEMPTS, AdapterRefused

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), SPEC)
    torch.manual_seed(3)
    for n, p in policy.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    adapter = PolicyAdapter(tmp_path / "adapters", adapter_config(SPEC, str(model_dir)))
    _sync(policy, adapter, llm, 10)
    before = _generate(llm, "before-refusal", adapter.request)
    assert _max_diff(policy, *before) < 1e-4

    wide = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
                      LoraSpec(rank=32, alpha=64))
    big = PolicyAdapter(tmp_path / "big", adapter_config(LoraSpec(rank=32, alpha=64), str(model_dir)))
    big.version, big.request = adapter.version, adapter.request  # the same slot, as the engine's one adapter
    with pytest.raises(AdapterRefused, match=rf"adapter v11 refused by vLLM after {LOAD_ATTEMPTS} attempts \(still "
                                             r"serving v10\): .*rank"):
        _sync(wide, big, llm, 11)
    assert big.refused == 1 and big.version == 10 and not (tmp_path / "big" / "v11").exists()
    assert _generate(llm, "after-refusal", adapter.request) == before  # the engine serves v10, unchanged
    _sync(policy, adapter, llm, 12)  # and takes the next good version
    assert _max_diff(policy, *_generate(llm, "v12", adapter.request)) < 1e-4
