"""LoRA checkpoints with the real Trainer (one gloo rank in this process): the checkpoint holds the adapter
and its optimizer state only (the frozen base is the model folder's), a resumed trainer continues from the
same adapter, optimizer state, RNG and version bit for bit (dropout on, so the RNG matters), and `flashrl
export` of the checkpoint writes the merged model or (--adapter) the peft adapter folder, both giving the
trainer's logprobs in transformers. The engine's side of the export: tests/integration/test_lora_process.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from flashrl.config import Config, from_dict, to_toml  # noqa: E402
from flashrl.trainer.lora import adapter_state_dict  # noqa: E402
from flashrl.wire.protocol import TrainBatch  # noqa: E402
from flashrl.wire.trajectory import Trajectory  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [1, 12, 5, 13]


def lora_cfg(model_dir: Path, out: Path, rank: int = 8, dropout: float = 0.1) -> Config:
    return from_dict({"run": {"output_dir": str(out), "name": "r"}, "model": {"path": str(model_dir),
                      "lora": {"rank": rank, "dropout": dropout}},
                      "trainer": {"backend": "gloo", "lr": 1e-2, "threads": 1, "warmup_steps": 0},
                      "rollout": {"temperature": 1.0}})


def batch(step: int) -> TrainBatch:
    samples = [Trajectory(prompt_ids=PROMPT, response_ids=r, loss_mask=[1] * len(r), behav_logp=[-3.0] * len(r),
                           versions=[step] * len(r), reward=float(i % 2), group=0, sample_id=str(i))
               for i, r in enumerate(([7, 8, 2], [9, 10, 11, 2], [7, 9, 2], [10, 2]))]
    return TrainBatch(step=step, samples=samples)


def train_and_checkpoint(cfg: Config, model_dir: Path, steps: int = 2) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run folder with config.toml and checkpoints/step-<steps>/trainer after ``steps`` steps; the adapter then."""
    from flashrl.trainer.worker import Trainer

    run = cfg.run_dir
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(to_toml(cfg))
    t = Trainer(cfg, str(model_dir), torch.device("cpu"))
    for s in range(steps):
        t.train_step(batch(s))
    t.save_checkpoint(str(run / "checkpoints" / f"step-{steps}" / "trainer"))
    return run, {k: v.clone() for k, v in adapter_state_dict(t.model).items()}


def _dcp_keys(path: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_adapter_only_checkpoint_resumes_exactly(world1, model_path: Path, tmp_path: Path) -> None:
    from flashrl.trainer.worker import Trainer

    cfg = lora_cfg(model_path, tmp_path)
    t = Trainer(cfg, str(model_path), torch.device("cpu"))
    t.train_step(batch(0))
    ckpt = tmp_path / "step-1"
    t.save_checkpoint(str(ckpt))
    saved = {k: v.clone() for k, v in adapter_state_dict(t.model).items()}
    saved_optim = {k: {n: x.clone() for n, x in st.items()} for k, st in t.optimizer.state_dict()["state"].items()}
    t.train_step(batch(1))  # the uninterrupted run's next step (dropout draws from torch's RNG)
    want = adapter_state_dict(t.model)

    keys = _dcp_keys(ckpt)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert not any("embed_tokens" in k or "base_layer" in k for k in keys)  # the frozen base is not re-saved
    base_bytes = _bytes(model_path)
    assert _bytes(ckpt) < 0.5 * base_bytes, (_bytes(ckpt), base_bytes)  # a full checkpoint is ~3x the model

    r = Trainer(cfg, str(model_path), torch.device("cpu"))
    assert any((adapter_state_dict(r.model)[k] != saved[k]).any() for k in saved)  # a fresh adapter differs
    r.load_checkpoint(str(ckpt))
    assert r.version == 1
    got = adapter_state_dict(r.model)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    optim = r.optimizer.state_dict()["state"]
    assert len(optim) == len(saved_optim) == len(saved)  # AdamW state for the adapter's tensors only
    assert all(torch.equal(optim[k][n], saved_optim[k][n]) for k in saved_optim for n in saved_optim[k])
    r.train_step(batch(1))
    cont = adapter_state_dict(r.model)
    assert all(torch.equal(cont[k], want[k]) for k in want)  # the same step the uninterrupted run took

    full = Trainer(lora_cfg(model_path, tmp_path, rank=0), str(model_path), torch.device("cpu"))
    with pytest.raises(ValueError, match="holds a LoRA adapter only"):
        full.load_checkpoint(str(ckpt))


def test_export_of_a_lora_checkpoint_merged_or_adapter(world1, model_path: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from flashrl.cli import app
    from flashrl.models.export import ExportError, export_run
    from flashrl.trainer.lora import apply_lora, spec_of

    cfg = lora_cfg(model_path, tmp_path, rank=16, dropout=0.0)
    run, adapter = train_and_checkpoint(cfg, model_path)
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter"])
    assert res.exit_code == 0 and "adapter" in res.output, res.output
    out, what = export_run(run, tmp_path / "merged")
    assert "merged" in what

    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == adapter.keys() and all(torch.equal(got[k], adapter[k]) for k in adapter)
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32), spec_of(cfg.model.lora))
    policy.load_state_dict({k.replace(".weight", ".default.weight"): v for k, v in adapter.items()}, strict=False)
    ids = torch.tensor([PROMPT + [7, 8, 9, 10]])
    with torch.no_grad():
        want = policy.eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        assert (base(ids).logits - want).abs().max() > 1e-3  # the adapter moved the policy
        for name, model in {
            "adapter": PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval(),
            "merged": AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(),
        }.items():
            assert torch.allclose(model(ids).logits, want, atol=1e-5), name

    with pytest.raises(ExportError, match="trained the full model"):
        full = lora_cfg(model_path, tmp_path / "full", rank=0)
        full.run_dir.mkdir(parents=True)
        (full.run_dir / "config.toml").write_text(to_toml(full))
        export_run(full.run_dir, tmp_path / "x", adapter=True)


def _sharded_rank(rank: int, port: int, model_dir: str, root: str) -> None:
    """Two gloo ranks (FSDP2-sharded Trainer) train a step and save an adapter-only checkpoint."""
    import torch.distributed as dist

    from flashrl.trainer.lora import adapter_from_state_dict
    from flashrl.trainer.worker import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        t = Trainer(lora_cfg(Path(model_dir), Path(root)), model_dir, torch.device("cpu"))
        assert t.sharded
        t.train_step(batch(0))
        t.save_checkpoint(str(Path(root) / "step-1"))
        adapter = adapter_from_state_dict(t.full_state_dict())
        if rank == 0:
            torch.save(adapter, Path(root) / "adapter.pt")
    finally:
        dist.destroy_process_group()


def test_adapter_checkpoint_of_two_sharded_ranks_resumes_on_one(world1, model_path: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from flashrl.trainer.worker import Trainer
    from flashrl.wire.transport import free_port

    mp.start_processes(_sharded_rank, args=(free_port(), str(model_path), str(tmp_path)), nprocs=2, start_method="spawn")
    want = torch.load(tmp_path / "adapter.pt")
    assert not any(".base_layer." in k or "embed_tokens" in k for k in _dcp_keys(tmp_path / "step-1"))
    r = Trainer(lora_cfg(model_path, tmp_path), str(model_path), torch.device("cpu"))
    r.load_checkpoint(str(tmp_path / "step-1"))
    got = adapter_state_dict(r.model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert r.version == 1 and len(r.optimizer.state_dict()["state"]) == len(want)


def _resume_rank(rank: int, port: int, model_dir: str, root: str, resume: bool) -> None:
    """Two gloo ranks with adapter dropout: either train steps 0 and 1 with a checkpoint between them (the
    uninterrupted run), or resume from that checkpoint and train step 1 again; rank 0 saves the adapter."""
    import torch.distributed as dist

    from flashrl.trainer.lora import adapter_from_state_dict
    from flashrl.trainer.worker import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        t = Trainer(lora_cfg(Path(model_dir), Path(root), dropout=0.5), model_dir, torch.device("cpu"))
        if resume:
            t.load_checkpoint(str(Path(root) / "step-1"))
        else:
            t.train_step(batch(0))
            t.save_checkpoint(str(Path(root) / "step-1"))
        t.train_step(batch(1))
        adapter = adapter_from_state_dict(t.full_state_dict())
        if rank == 0:
            torch.save(adapter, Path(root) / ("resumed.pt" if resume else "uninterrupted.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_dropout_resume_every_ranks_rng(world1, model_path: Path, tmp_path: Path) -> None:
    """Each rank's generator is saved and restored (trainer/rng.py): the two ranks draw different amounts of
    dropout (their samples differ in length), so one shared state would give rank 1 other masks after the
    resume and the step would differ."""
    import torch.multiprocessing as mp

    from flashrl.wire.transport import free_port

    for resume in (False, True):
        mp.start_processes(_resume_rank, args=(free_port(), str(model_path), str(tmp_path), resume), nprocs=2,
                           start_method="spawn")
    want, got = torch.load(tmp_path / "uninterrupted.pt"), torch.load(tmp_path / "resumed.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_kl_anchor_is_the_frozen_base_not_a_second_model(world1, model_path: Path, tmp_path: Path) -> None:
    """The real Trainer with algorithm.kl_coef > 0: full fine-tuning builds a frozen copy of the initial weights
    as the KL anchor; with LoRA the anchor is the policy's own base (adapters bypassed), so no second model is
    built, and a step trains with the KL term on."""
    from flashrl.trainer.worker import Trainer

    def params(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    cfg = lora_cfg(model_path, tmp_path)
    cfg.algorithm.kl_coef = 0.1
    lora = Trainer(cfg, str(model_path), torch.device("cpu"))
    assert lora.ref_model is None and lora.has_ref
    res = lora.train_step(batch(0))
    assert res is not None and "kl/mean" in res.metrics
    full_cfg = lora_cfg(model_path, tmp_path, rank=0)
    full_cfg.algorithm.kl_coef = 0.1
    full = Trainer(full_cfg, str(model_path), torch.device("cpu"))
    assert full.ref_model is not None and params(full.ref_model) == params(full.model)


def _other_base(model_dir: Path, out: Path) -> Path:
    """A copy of ``model_dir`` whose weights differ in one element: another base of the same architecture."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    (f,) = out.glob("*.safetensors")
    sd = load_file(str(f))
    name = sorted(sd)[0]
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] += 1.0
    save_file(sd, str(f), metadata={"format": "pt"})
    return out


def test_adapter_checkpoint_records_its_base_and_refuses_another(world1, model_path: Path, tmp_path: Path) -> None:
    """An adapter checkpoint records its base's fingerprint; resuming it, or exporting it, on another base (the
    same architecture and names, other weights) is refused, naming both fingerprints and the fix."""
    import json

    from flashrl.config import load
    from flashrl.models.export import ExportError, export_run
    from flashrl.trainer.lora import base_fingerprint
    from flashrl.trainer.worker import Trainer

    cfg = lora_cfg(model_path, tmp_path / "out")
    run, _ = train_and_checkpoint(cfg, model_path, steps=1)
    ckpt = run / "checkpoints" / "step-1" / "trainer"
    meta = json.loads((ckpt / "trainer.json").read_text())
    assert meta["base_fingerprint"] == base_fingerprint(model_path) and meta["base_model"] == str(model_path)

    other = _other_base(model_path, tmp_path / "other")
    theirs, ours = base_fingerprint(other), meta["base_fingerprint"]
    assert theirs != ours
    t = Trainer(lora_cfg(other, tmp_path / "out2"), str(other), torch.device("cpu"))
    with pytest.raises(ValueError, match="another base") as ei:
        t.load_checkpoint(str(ckpt))
    assert ours in str(ei.value) and theirs in str(ei.value) and "Point model.path" in str(ei.value)
    same = Trainer(cfg, str(model_path), torch.device("cpu"))
    same.load_checkpoint(str(ckpt))  # its own base resumes
    assert same.version == 1

    moved = load(run / "config.toml")
    (run / "config.toml").write_text(to_toml(from_dict({**_as_dict(moved), "model": {
        **_as_dict(moved)["model"], "path": str(other)}})))
    for adapter in (False, True):
        with pytest.raises(ExportError, match="another base") as ei:
            export_run(run, tmp_path / f"x{adapter}", adapter=adapter)
        assert ours in str(ei.value) and theirs in str(ei.value)
        assert not (tmp_path / f"x{adapter}").exists()


def _as_dict(cfg: Config) -> dict:
    import msgspec

    return msgspec.to_builtins(cfg)


def test_sync_gathers_the_adapter_alone_under_fsdp2(world1, model_path: Path, tmp_path: Path, monkeypatch) -> None:
    """LoRA under FSDP2: a sync's prepare all-gathers the adapter's shards only, never the frozen base (a full
    state-dict gather each step costs as much as a full-weight sync), and sends exactly the adapter's tensors."""
    import torch.distributed.checkpoint.state_dict as dcp_sd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from flashrl.trainer.lora import spec_of
    from flashrl.trainer.worker import Trainer, build_policy

    cfg = lora_cfg(model_path, tmp_path, dropout=0.0)
    t = Trainer(cfg, str(model_path), torch.device("cpu"))
    t.model = build_policy(str(model_path), init_device_mesh("cpu", (1,)), None, True, spec_of(cfg.model.lora))
    t.sharded = True  # as with two ranks or a GPU mixed-precision policy: a world of one shards the same way
    with torch.no_grad():
        for n, p in t.model.named_parameters():
            if "lora_B" in n:
                p.copy_(DTensor.from_local(torch.full_like(p.to_local(), 0.25), p.device_mesh, p.placements))
    want = adapter_state_dict(t.model)  # peft's names and values (a local gather, before the spies)

    gathered: list[int] = []
    real_full = DTensor.full_tensor

    def full_tensor(self, *a, **k):
        gathered.append(self.numel())
        return real_full(self, *a, **k)

    def no_full_gather(*a, **k):
        raise AssertionError("the sync gathered the whole model's state dict (the frozen base too)")

    monkeypatch.setattr(DTensor, "full_tensor", full_tensor)
    monkeypatch.setattr(dcp_sd, "get_model_state_dict", no_full_gather)
    monkeypatch.setattr(dcp_sd, "get_state_dict", no_full_gather)
    manifest = t.prepare_weights(1)
    assert manifest is not None
    names = [tm.name for b in manifest.buckets for tm in b.tensors]
    assert sorted(names) == sorted(want) and len(gathered) == len(want)
    assert sum(gathered) == sum(v.numel() for v in want.values())
    base = sum(p.numel() for n, p in t.model.named_parameters() if ".lora_" not in n)
    assert sum(gathered) < 0.5 * base  # the adapter, not the model
    from flashrl.wire.lora import verify_adapter

    got = verify_adapter(manifest, [b.clone() for b in t.weights.prepared[1]])
    assert all(torch.equal(got[k], want[k].to_local() if isinstance(want[k], DTensor) else want[k]) for k in want)
