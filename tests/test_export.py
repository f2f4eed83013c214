"""Export: the policy as a Hugging Face folder, from a state dict (the run's final) or a DCP checkpoint.

The end-to-end check (a real run, exported, greedy outputs equal to the last engine's) is in
tests/test_chat_run.py; here the folder format, atomicity, checkpoint reading and errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import from_dict, to_toml
from flashrl.models.chat_model import build_chat_model
from flashrl.models.export import ExportError, export_run, save_hf_folder
from flashrl.models.tiny import TinySpec, build_untrained
from flashrl.wire.transport import free_port

SMALL = TinySpec(layers=1, hidden=32, heads=1, kv_heads=1, intermediate=64, max_position=64)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "m", layers=1)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)


def _changed(path: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model of ``path`` with every weight moved (as training would)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in _load(path).state_dict().items()}


@pytest.mark.parametrize("which", ["chat", "tiny"])
def test_save_hf_folder_loads_in_transformers_with_the_new_weights(tmp_path: Path, chat_dir: Path, which: str) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    base = chat_dir if which == "chat" else build_untrained(tmp_path / "tiny", spec=SMALL)
    sd = _changed(base)
    if which == "tiny":  # tied embeddings: the state dict holds both names of one tensor
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    out = save_hf_folder(sd, base, tmp_path / "out")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    got = _load(out).state_dict()
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert AutoTokenizer.from_pretrained(str(out)).encode("12+3=") == AutoTokenizer.from_pretrained(str(base)).encode("12+3=")
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == GenerationConfig.from_pretrained(str(base)).eos_token_id
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left

    with pytest.raises(ExportError, match="already exists; choose another --out"):
        save_hf_folder(sd, base, out)
    save_hf_folder(_changed(base, seed=2), base, out, replace=True)
    assert not torch.equal(_load(out).state_dict()["model.norm.weight"], got["model.norm.weight"])
    half = save_hf_folder(sd, base, tmp_path / "half", dtype="bfloat16")
    assert _load(half).state_dict()["model.norm.weight"].dtype == torch.float32  # loaded as asked, stored bf16
    assert "bfloat16" in (half / "config.json").read_text()


def test_bad_weights_are_refused_and_leave_nothing(tmp_path: Path, chat_dir: Path) -> None:
    sd = _changed(chat_dir)
    del sd["model.norm.weight"]
    with pytest.raises(ExportError, match="missing"):
        save_hf_folder(sd, chat_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def world1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_export_reads_final_or_a_dcp_checkpoint(world1, tmp_path: Path, chat_dir: Path) -> None:
    """A run folder as `flashrl run` leaves it: final/ (HF) and checkpoints/step-N/trainer (DCP)."""
    from flashrl.trainer.worker import Trainer
    from flashrl.wire.protocol import TrainBatch, TrainSample

    cfg = from_dict({"run": {"output_dir": str(tmp_path), "name": "r"}, "model": {"path": str(chat_dir)},
                     "trainer": {"backend": "gloo", "lr": 1e-2, "threads": 1}})
    run = cfg.run_dir
    run.mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(cfg))
    with pytest.raises(ExportError, match="no final policy .* and no checkpoints"):
        export_run(run, tmp_path / "x")

    t = Trainer(cfg, str(chat_dir), torch.device("cpu"))
    samples = [TrainSample(prompt_ids=[1, 5, 6], response_ids=[7, 8, 2], loss_mask=[1, 1, 1], behav_logp=[-3.0] * 3,
                           versions=[0] * 3, reward=float(r), group=0) for r in (0, 1)]
    t.train_step(TrainBatch(step=0, samples=samples))
    t.save_checkpoint(str(run / "checkpoints" / "step-1" / "trainer"))
    at_1 = {k: v.clone() for k, v in t.full_state_dict().items()}
    t.train_step(TrainBatch(step=1, samples=samples))
    t.save_model(str(run / "final"))
    final = t.full_state_dict()
    assert not torch.equal(at_1["model.norm.weight"], final["model.norm.weight"])

    out, what = export_run(run, tmp_path / "final-export")
    assert what.startswith("final policy")
    got = _load(out).state_dict()
    assert all(torch.equal(got[k], final[k]) for k in final)

    out, what = export_run(run, tmp_path / "step1", step=1)
    assert what.startswith("checkpoint step 1")
    got = _load(out).state_dict()
    assert all(torch.equal(got[k], at_1[k]) for k in at_1)

    with pytest.raises(ExportError, match=r"no checkpoint for step 7 \(checkpoints: 1\)"):
        export_run(run, tmp_path / "s7", step=7)
    with pytest.raises(ExportError, match="already exists"):
        export_run(run, tmp_path / "step1")

    # the CLI: exit 2 with the message on a problem, the folder on success
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "s7"), "--step", "7"])
    assert res.exit_code == 2 and "no checkpoint for step 7" in res.output
    res = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "not a run folder" in res.output
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "cli")])
    assert res.exit_code == 0 and "exported final policy" in res.output
    assert (tmp_path / "cli" / "model.safetensors").is_file()
