"""LoRA's pure parts (flashrl/trainer/lora.py, flashrl/engine/lora.py): the spec's checks, the adapter's
packing for the weight sync and its verification, the peft folder. The real engine loading adapters:
tests/integration/test_lora_process.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from flashrl.engine.lora import lora_engine_kwargs  # noqa: E402
from flashrl.trainer.lora import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    TARGET_MODULES,
    LoraSpec,
    adapter_config,
    adapter_from_state_dict,
    adapter_state_dict,
    apply_lora,
    model_problems,
    reference_disabled,
    save_adapter,
)
from flashrl.wire.lora import verify_adapter, vllm_max_rank  # noqa: E402
from flashrl.wire.weights import build_manifest, manifest_nbytes  # noqa: E402

HF = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 512}


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=91, num_hidden_layers=2, tie_word_embeddings=True, **HF)
    return LlamaForCausalLM(cfg).eval()


def test_spec_names_a_bad_target_module_and_bounds() -> None:
    assert LoraSpec(rank=16, alpha=32).problems() == []
    (msg,) = LoraSpec(rank=16, alpha=32, target_modules=("q_proj", "qkv")).problems()
    assert "'qkv'" in msg and "q_proj" in msg
    assert len(LoraSpec(rank=0, alpha=0, dropout=1.0, target_modules=()).problems()) == 4


def test_rank_the_model_cannot_take() -> None:
    assert model_problems(64, TARGET_MODULES, HF) == []
    probs = model_problems(65, TARGET_MODULES, HF)  # k_proj, v_proj: 128 -> 64
    assert len(probs) == 2 and "k_proj's smaller side (64" in probs[0]
    assert model_problems(65, ("q_proj",), HF) == []
    assert any("largest rank vLLM serves" in p for p in model_problems(1024, TARGET_MODULES, {}))


def test_vllm_rank_is_the_smallest_allowed_above() -> None:
    assert [vllm_max_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    assert lora_engine_kwargs(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    with pytest.raises(ValueError, match="largest rank"):
        vllm_max_rank(513)


def test_only_adapters_train_and_disabled_is_the_base() -> None:
    base = _model()
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        want = base(ids).logits
    model = apply_lora(base, LoraSpec(rank=8, alpha=16))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B x 7 projections x 2 layers
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max() > 1e-3  # the adapter moves the policy
        with reference_disabled(model):
            assert torch.equal(model(ids).logits, want)  # the reference: the base model, bit for bit


def test_adapter_packs_in_kilobytes_verifies_and_loads_in_peft(tmp_path) -> None:
    from peft import PeftModel

    model = apply_lora(_model(), LoraSpec(rank=8, alpha=16))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    state = adapter_state_dict(model)
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    gathered = adapter_from_state_dict(model.state_dict())  # the FSDP2 path: from the full state dict
    assert gathered.keys() == state.keys() and all(torch.equal(gathered[k], state[k]) for k in state)
    manifest, flats = build_manifest(state, version=3, bucket_mb=0.05)
    full, _ = build_manifest(model.get_base_model().state_dict(), version=3, bucket_mb=64)
    assert len(manifest.buckets) > 1 and manifest_nbytes(manifest) < 0.2 * manifest_nbytes(full)
    got = verify_adapter(manifest, [f.clone() for f in flats])
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)

    bad = [f.clone() for f in flats]
    bad[1][0] += 1.0
    with pytest.raises(ValueError, match="bucket 1 checksum"):
        verify_adapter(manifest, bad)
    with pytest.raises(ValueError, match="2 buckets received"):
        verify_adapter(manifest, flats[:2])

    folder = save_adapter(tmp_path / "v3", got, adapter_config(LoraSpec(rank=8, alpha=16), "base"))
    assert {p.name for p in folder.iterdir()} == {ADAPTER_WEIGHTS, ADAPTER_CONFIG}
    save_adapter(folder, got, adapter_config(LoraSpec(rank=8, alpha=16), "base"))  # replaced in place
    loaded = PeftModel.from_pretrained(_model(), str(folder)).eval()
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)


def test_config_is_off_by_default_and_names_bad_keys() -> None:
    from flashrl.config import ConfigError, load

    assert load("configs/tiny.toml").model.lora.rank == 0  # existing configs: full fine-tuning, unchanged
    lora = load("configs/tiny.toml", ["model.lora.rank=16", "model.lora.target_modules=['q_proj','v_proj']"]).model.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (16, 32, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules\[1\].*'qkv'"):
        load("configs/tiny.toml", ["model.lora.rank=16", "model.lora.target_modules=['q_proj','qkv']"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank.*512"):
        load("configs/tiny.toml", ["model.lora.rank=1024"])


def test_validate_and_run_refuse_a_rank_the_model_cannot_take() -> None:
    from typer.testing import CliRunner

    from flashrl.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["validate", "configs/tiny.toml", "--set", "model.lora.rank=64"])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, ["validate", "configs/tiny.toml", "--set", "model.lora.rank=100"])
    assert bad.exit_code == 2 and "k_proj's smaller side (64" in bad.output
    run = runner.invoke(app, ["run", "configs/tiny.toml", "--set", "model.lora.rank=100"])  # refused before any start
    assert run.exit_code == 2 and "k_proj's smaller side (64" in run.output


def _lora_trainer(model_path, dropout: float):
    """A PolicyTrainer over the built-in model with a rank-8 adapter (lora_B non-zero: the adapter moves the
    policy), the same initial adapter for every dropout."""
    from transformers import AutoModelForCausalLM

    from flashrl.config import from_dict
    from flashrl.trainer.step import PolicyTrainer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    model = apply_lora(base, LoraSpec(rank=8, alpha=16, dropout=dropout))
    model.train(False)  # as worker.build_policy leaves it
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    cfg = from_dict({"trainer": {"lr": 1e-2, "threads": 1, "warmup_steps": 0, "mini_batches": 1},
                     "algorithm": {"loss": "ppo"}, "rollout": {"temperature": 1.0}})
    return PolicyTrainer(cfg, model, torch.device("cpu"))


def test_dropout_applies_to_the_training_forward_only(model_path) -> None:
    """model.lora.dropout acts in the gradient forwards (the update differs from dropout 0's), never in the
    logprobs the engines must match: the proximal logprobs are the no-dropout ones (mismatch 0 against
    behaviour logprobs computed without dropout), and the model is back in eval mode after the step."""
    from flashrl.wire.protocol import TrainBatch
    from flashrl.wire.trajectory import Trajectory

    prompt, good, bad = [1, 10, 11, 12], [20, 21, 22, 2], [30, 31, 2]
    trained = {}
    for dropout in (0.0, 0.5):
        t = _lora_trainer(model_path, dropout)
        assert len(t.dropouts) == (0 if dropout == 0 else 2 * 7)  # one per adapted projection
        samples = [Trajectory(prompt_ids=prompt, response_ids=r, loss_mask=[1] * len(r),
                               behav_logp=t.compute_logprobs(prompt, r), versions=[0] * len(r),
                               reward=float(r is good), group=0, sample_id=str(j))
                   for j, r in enumerate((good, bad, good, bad))]
        torch.manual_seed(1)
        res = t.train_step(TrainBatch(step=0, samples=samples))
        assert res is not None
        assert res.metrics["mismatch/max_abs"] < 1e-5, dropout  # proximal = the engines' (no dropout) logprobs
        assert t.compute_logprobs(prompt, good) == t.compute_logprobs(prompt, good)  # no dropout left on
        assert not any(m.training for m in t.model.modules())
        trained[dropout] = adapter_state_dict(t.model)
    moved = max((trained[0.5][k] - trained[0.0][k]).abs().max().item() for k in trained[0.0])
    assert moved > 1e-6  # dropout changed the update (it had no effect while the model stayed in eval mode)


def test_fit_names_a_module_the_model_lacks_and_its_own(tmp_path) -> None:
    """A model folder is checked against its own projections (built on the meta device from config.json):
    a target it lacks is named with the ones it has; a rank above a projection's smaller side is refused."""
    from transformers import LlamaConfig, PhiConfig

    from flashrl.trainer.lora import fit_problems, linear_sides

    llama = tmp_path / "llama"
    LlamaConfig(vocab_size=91, num_hidden_layers=2, **HF).save_pretrained(llama)
    arch, sides = linear_sides(llama)
    assert arch == "LlamaForCausalLM" and set(sides) == set(TARGET_MODULES) and sides["k_proj"] == (128, 64)
    assert fit_problems(LoraSpec(rank=64, alpha=16), llama) == []
    (msg, _) = fit_problems(LoraSpec(rank=65, alpha=16), llama)  # k_proj and v_proj: 128 -> 64
    assert "k_proj's smaller side (64" in msg

    phi = tmp_path / "phi"  # attention q/k/v_proj + dense, MLP fc1/fc2: no o_proj, no gate/up/down_proj
    PhiConfig(vocab_size=91, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4).save_pretrained(phi)
    (msg,) = fit_problems(LoraSpec(rank=8, alpha=16, target_modules=("q_proj", "o_proj", "gate_proj")), phi)
    assert "'o_proj', 'gate_proj' not in" in msg and "PhiForCausalLM" in msg
    assert "LoRA can target are q_proj, k_proj, v_proj" in msg and "dense, fc1, fc2" in msg
    assert fit_problems(LoraSpec(rank=8, alpha=16, target_modules=("q_proj", "v_proj")), phi) == []


def test_validate_names_a_bad_target_module_with_the_allowed_ones() -> None:
    from typer.testing import CliRunner

    from flashrl.cli import app

    bad = CliRunner().invoke(app, ["validate", "configs/tiny.toml", "--set", "model.lora.rank=16",
                                   "--set", "model.lora.target_modules=['q_proj','qkv']"])
    assert bad.exit_code == 2
    assert "model.lora.target_modules[1]: invalid value 'qkv'; expected one of: 'q_proj', 'k_proj'" in bad.output


def test_validate_checks_a_model_folder_by_its_own_projections(model_path) -> None:
    from typer.testing import CliRunner

    from flashrl.cli import app

    runner = CliRunner()
    args = ["validate", "configs/tiny.toml", "--set", f"model.path={model_path}", "--set", "model.lora.rank="]
    assert runner.invoke(app, [*args[:-1], args[-1] + "64"]).exit_code == 0
    bad = runner.invoke(app, [*args[:-1], args[-1] + "100"])
    assert bad.exit_code == 2 and "model.lora: rank 100 is above k_proj's smaller side (64" in bad.output, bad.output


LOSSES = ("ppo", "grpo", "decoupled_ppo", "tis", "topr", "cispo", "gspo", "asyppo")


def _steps_with_lora(model_path, **algorithm: object):
    """A LoRA PolicyTrainer (rank 8, dropout 0.1) over the built-in model, two steps of 2 mini-batches on a
    batch with a good and a bad answer per group; (trainer, each step's metrics, the base's weights before)."""
    from transformers import AutoModelForCausalLM

    from flashrl.config import from_dict
    from flashrl.trainer.step import PolicyTrainer
    from flashrl.wire.protocol import TrainBatch
    from flashrl.wire.trajectory import Trajectory

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = apply_lora(base, LoraSpec(rank=8, alpha=16, dropout=0.1))
    model.train(False)  # as worker.build_policy leaves it
    cfg = from_dict({"trainer": {"lr": 1e-2, "threads": 1, "warmup_steps": 0, "mini_batches": 2},
                     "algorithm": algorithm, "rollout": {"temperature": 1.0}})
    t = PolicyTrainer(cfg, model, torch.device("cpu"))
    prompt, good, bad = [1, 10, 11, 12], [20, 21, 22, 2], [30, 31, 2]
    metrics = []
    for step in range(2):
        samples = [Trajectory(prompt_ids=prompt + [13] * g, response_ids=r, loss_mask=[1] * len(r),
                               behav_logp=t.compute_logprobs(prompt + [13] * g, r), versions=[step] * len(r),
                               reward=float(r is good), group=g, sample_id=f"{g}-{j}")
                   for g in range(2) for j, r in enumerate((good, bad, good, bad))]
        res = t.train_step(TrainBatch(step=step, samples=samples))
        assert res is not None
        metrics.append(res.metrics)
    return t, metrics, before


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_the_adapter_alone(model_path, loss: str) -> None:
    """Each policy loss trains with [model.lora]: finite losses, the adapter moves, the base model's weights
    stay bit for bit, and the engines' logprobs are the trainer's (mismatch 0: the sampled policy is the one
    trained). AsyPPO's critics train beside it (their own modules, not adapted)."""
    t, metrics, before = _steps_with_lora(model_path, loss=loss)
    for m in metrics:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items() if k.startswith("loss/")), m
        assert m["mismatch/max_abs"] < 1e-5
    base = dict(t.model.get_base_model().named_parameters())
    frozen = {n.replace(".base_layer.", "."): p for n, p in base.items() if "lora_" not in n}
    assert frozen.keys() == before.keys()
    assert all(torch.equal(frozen[n], before[n]) for n in before)  # the base never trains
    moved = [n for n, p in base.items() if "lora_B" in n and p.abs().max() > 0]  # B starts at 0
    assert len(moved) == 2 * 7, loss  # every adapted projection learned
    if loss == "asyppo":
        assert t.critics is not None and "critic/loss" in metrics[-1]


@pytest.mark.parametrize("credit", ["rhythm"])
def test_attention_credit_reads_the_adapted_model(model_path, credit: str) -> None:
    """algorithm.credit reads the attention of the policy with its adapter (an eager forward through peft)."""
    t, metrics, _ = _steps_with_lora(model_path, loss="decoupled_ppo", credit=credit)
    assert all(torch.isfinite(torch.tensor(m["loss/total"])) for m in metrics)
    assert metrics[-1]["credit/amplified_frac"] > 0, sorted(metrics[-1])


def test_kl_reference_is_the_base_model_with_no_second_copy(model_path) -> None:
    """kl_coef > 0 with LoRA: the KL anchor is the base model (the initial policy, never trained), computed by
    the policy's own module with its adapters bypassed; no frozen second copy is built. After the adapter has
    moved, the reference logprobs are still the base model's, and the KL is no longer 0."""
    from transformers import AutoModelForCausalLM

    from flashrl.trainer.batch import pad_batch
    from flashrl.wire.trajectory import Trajectory

    t, metrics, _ = _steps_with_lora(model_path, loss="decoupled_ppo", kl_coef=0.1)
    assert t.ref_model is None and t.has_ref
    assert metrics[-1]["kl/mean"] > 1e-6  # the adapter moved away from the anchor
    sample = Trajectory(prompt_ids=[1, 10, 11, 12], response_ids=[20, 21, 22, 2], loss_mask=[1] * 4,
                        behav_logp=[0.0] * 4, versions=[0] * 4, reward=1.0, group=0, sample_id="x")
    b = pad_batch([sample], t.pad_id)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = t.forward_logprobs(base, b)[0]
        current = t.forward_logprobs(t.model, b)[0]
    got = t.reference_logprobs(b)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    assert (current - want).abs().max() > 1e-4  # the policy itself has moved


def test_adapter_refused_defined_once_and_spec_built_by_spec_of() -> None:
    """One AdapterRefused for both ends (the engine's per-load refusal and the controller's final one: a
    supervisor that treats it as final matches one class), and every LoraSpec of a config built by spec_of
    (a field added to model.lora reaches the trainer, the engines and export alike)."""
    import re
    from pathlib import Path

    import flashrl
    from flashrl.controller.publisher import AdapterRefused as controller_side
    from flashrl.engine.lora import AdapterRefused as engine_side
    from flashrl.trainer.lora import spec_of

    assert engine_side is controller_side
    root = Path(flashrl.__file__).parent
    sources = {p: p.read_text() for p in root.rglob("*.py")}
    assert [p.relative_to(root).as_posix() for p, s in sources.items() if "class AdapterRefused" in s] == ["wire/protocol.py"]
    built = [p.relative_to(root).as_posix() for p, s in sources.items() if re.search(r"\bLoraSpec\(\s*rank=", s)]
    assert built == ["trainer/lora.py"], built  # spec_of itself, nowhere else

    class Lora:  # a [model.lora] section
        rank, alpha, dropout, target_modules = 8, 16, 0.1, ["q_proj", "v_proj"]

    assert spec_of(Lora()) == LoraSpec(8, 16, 0.1, ("q_proj", "v_proj"))


def _safetensors_folder(folder, tensors, shards: int = 1, metadata=None):
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    names = sorted(tensors)
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(folder / f"model-{k}.safetensors"), metadata=metadata)
    return folder


def test_base_fingerprint_sees_every_byte_not_the_layout(tmp_path) -> None:
    """The fingerprint an adapter checkpoint records of its base: one element changed anywhere (here the last
    row of the embedding, as a new token's would) changes it; the same tensors re-saved in other shards, with
    other header metadata, keep it."""
    from flashrl.trainer.lora import base_fingerprint, base_mismatch

    torch.manual_seed(0)
    w = {"embed.weight": torch.randn(64, 16), "layers.0.q_proj.weight": torch.randn(16, 16),
         "norm.weight": torch.ones(16, dtype=torch.bfloat16)}
    fp = base_fingerprint(_safetensors_folder(tmp_path / "a", w))
    assert fp.startswith("xxh3-128:") and fp == base_fingerprint(tmp_path / "a")  # deterministic
    assert base_fingerprint(_safetensors_folder(tmp_path / "b", w, shards=2, metadata={"format": "pt"})) == fp
    other = dict(w, **{"embed.weight": w["embed.weight"].clone()})
    other["embed.weight"][-1, -1] += 1e-3
    assert base_fingerprint(_safetensors_folder(tmp_path / "c", other)) != fp
    retyped = dict(w, **{"norm.weight": w["norm.weight"].to(torch.float16)})  # same bytes, another dtype
    assert base_fingerprint(_safetensors_folder(tmp_path / "d", retyped)) != fp

    assert base_mismatch(fp, "/x/a", tmp_path / "b", "checkpoint s") is None
    assert base_mismatch(None, None, tmp_path / "c", "checkpoint s") is None  # older checkpoints: nothing recorded
    msg = base_mismatch(fp, "/x/a", tmp_path / "c", "checkpoint s")
    assert msg is not None and fp in msg and base_fingerprint(tmp_path / "c") in msg and "/x/a" in msg
    assert "Point model.path at the base the run trained" in msg
    with pytest.raises(FileNotFoundError, match="no weight files"):
        base_fingerprint(tmp_path)
